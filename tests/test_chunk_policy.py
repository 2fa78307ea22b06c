"""When a request's pending tokens are published (workers/generate/chunks.py ChunkPolicy): pure."""

from workers.generate.chunks import ChunkPolicy


def test_a_small_batch_publishes_every_step():
    policy = ChunkPolicy(max_records_per_s=10_000)
    interval = policy.interval(running=16)  # 16 requests: 1.6 ms between chunks at most
    assert interval == 0.0016
    assert policy.should_flush(pending=1, waited_s=0.002, in_flight=0, interval_s=interval)  # a 2 ms step


def test_a_large_batch_coalesces_to_stay_near_the_chunk_rate():
    policy = ChunkPolicy(max_records_per_s=10_000, max_delay_s=0.02)
    interval = policy.interval(running=128)  # 12.8 ms: ~6 tokens a chunk at 2 ms steps
    assert abs(interval - 0.0128) < 1e-9
    assert not policy.should_flush(pending=3, waited_s=0.006, in_flight=0, interval_s=interval)
    assert policy.should_flush(pending=7, waited_s=0.013, in_flight=0, interval_s=interval)
    assert policy.interval(running=1000) == 0.02  # never more than max_delay_s


def test_limits_hold_whatever_the_rate():
    policy = ChunkPolicy(max_records_per_s=10_000, max_tokens=16, max_delay_s=0.02, lag_threshold=64)
    interval = policy.interval(running=256)
    assert policy.should_flush(pending=16, waited_s=0.0, in_flight=0, interval_s=interval)  # max_tokens
    assert policy.should_flush(pending=1, waited_s=0.02, in_flight=1000, interval_s=interval)  # max_delay
    assert not policy.should_flush(pending=5, waited_s=0.019, in_flight=64, interval_s=0.0)  # producer lags
    assert not policy.should_flush(pending=0, waited_s=1.0, in_flight=0, interval_s=0.0)


def test_no_rate_aim_publishes_every_step_as_before():
    policy = ChunkPolicy(max_records_per_s=0)
    assert policy.interval(running=10_000) == 0.0
    assert policy.should_flush(pending=1, waited_s=0.0, in_flight=0, interval_s=policy.interval(256))
