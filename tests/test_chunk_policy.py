"""When a request's pending tokens are published (workers/generate/chunks.py ChunkPolicy): pure.

`due_at` answers on the monotonic clock; a due time at or before now means "publish now".
`due` is what the handler asks at every step (the same rule over many requests at once).
"""

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from workers.generate.chunks import ChunkPolicy

NEVER_PUBLISHED = float("-inf")


def test_a_small_batch_publishes_every_step():
    policy = ChunkPolicy(max_records_per_s=10_000)
    interval = policy.interval(running=16)  # 16 requests: 1.6 ms between chunks at most
    assert interval == 0.0016
    # the previous chunk went one 2 ms step ago; this step's token is due as it is sampled
    assert policy.due_at(1, first_pending_at=10.002, last_chunk_at=10.0, lagging=False, interval_s=interval) == 10.002


def test_a_request_s_first_token_never_waits_for_the_rate_aim():
    policy = ChunkPolicy(max_records_per_s=10_000)
    interval = policy.interval(running=256)  # 20 ms: a large batch coalesces...
    # ...but a request's first chunk goes out at once (time to first token)
    assert policy.due_at(1, 5.0, NEVER_PUBLISHED, lagging=False, interval_s=interval) == 5.0


def test_a_token_sampled_long_after_the_previous_chunk_leaves_at_once():
    # The regression this rule fixes: one request at a model's pace (a token every 20 ms)
    # has a 0.1 ms interval; counted from the token itself, a token published 80 µs after
    # it was sampled was "not yet due" and waited for the next loop turn (up to 20 ms).
    policy = ChunkPolicy(max_records_per_s=10_000)
    interval = policy.interval(running=1)
    assert interval == 0.0001
    assert policy.due_at(1, first_pending_at=7.020, last_chunk_at=7.0, lagging=False, interval_s=interval) == 7.020


def test_a_large_batch_coalesces_to_stay_near_the_chunk_rate():
    policy = ChunkPolicy(max_records_per_s=10_000, max_delay_s=0.02)
    interval = policy.interval(running=128)  # 12.8 ms: ~6 tokens a chunk at 2 ms steps
    assert abs(interval - 0.0128) < 1e-9
    # previous chunk at t=1.0; tokens pending since the next step: due 12.8 ms after the chunk
    due = policy.due_at(3, first_pending_at=1.002, last_chunk_at=1.0, lagging=False, interval_s=interval)
    assert abs(due - 1.0128) < 1e-9
    # 256 at 2 ms steps: 25.6 ms, but no token waits past max_delay_s (20 ms) from the first
    # pending one (sampled a step after the previous chunk): a chunk every ~22 ms
    interval = policy.interval(running=256)
    assert abs(interval - 0.0256) < 1e-9
    due = policy.due_at(11, first_pending_at=2.002, last_chunk_at=2.0, lagging=False, interval_s=interval)
    assert abs(due - 2.022) < 1e-9


def test_limits_hold_whatever_the_rate():
    policy = ChunkPolicy(max_records_per_s=10_000, max_tokens=16, max_delay_s=0.02, lag_threshold=64)
    interval = policy.interval(running=256)
    # max_tokens: due at once, even right after a chunk and with the producer lagging
    assert policy.due_at(16, 3.0, last_chunk_at=3.0, lagging=True, interval_s=interval) == 3.0
    # a lagging producer holds tokens up to max_delay_s from the first of them, whatever the rate
    assert policy.due_at(5, 3.0, NEVER_PUBLISHED, lagging=True, interval_s=0.0) == 3.02
    # and the delay cap holds when the interval would hold longer
    assert policy.due_at(5, 3.0, last_chunk_at=2.999, lagging=False, interval_s=1.0) == 3.02


def test_no_rate_aim_publishes_every_step_as_before():
    policy = ChunkPolicy(max_records_per_s=0)
    assert policy.interval(running=10_000) == 0.0
    assert policy.due_at(1, 4.0, last_chunk_at=3.999, lagging=False, interval_s=policy.interval(256)) == 4.0


times = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


@given(policy=st.builds(ChunkPolicy, max_tokens=st.integers(1, 20), max_delay_s=st.floats(0.0, 0.1),
                        max_records_per_s=st.sampled_from([0.0, 100.0, 10_000.0])),
       requests=st.lists(st.tuples(st.integers(0, 25), times, st.one_of(st.just(NEVER_PUBLISHED), times),
                                   st.booleans()), max_size=20),
       lagging=st.booleans(), after=st.floats(0.0, 0.2))
def test_due_picks_exactly_the_requests_due_at_says_are_due(policy, requests, lagging, after):
    """The handler's per-step question, asked of many requests at once, agrees with the rule
    (`due_at(...) <= now`) for every request: open or closed, with or without pending
    tokens, before and after its first chunk, lagging or not."""
    states = [SimpleNamespace(pending_ids=[7] * pending, pending_since=since, last_chunk_at=last, closed=closed)
              for pending, since, last, closed in requests]
    now = max([s.pending_since for s in states], default=0.0) + after  # pending tokens were sampled by now
    interval = policy.interval(running=len(states))
    expected = [s for s in states if s.pending_ids and not s.closed and policy.due_at(
        len(s.pending_ids), s.pending_since, s.last_chunk_at, lagging, interval) <= now]
    assert policy.due(states, now, lagging, interval) == expected


def test_a_request_due_exactly_now_leaves_now():
    policy = ChunkPolicy(max_records_per_s=10_000, max_delay_s=0.25, max_tokens=16)
    state = SimpleNamespace(pending_ids=[1, 2], pending_since=0.375, last_chunk_at=0.25, closed=False)
    assert policy.due([state], 0.625, lagging=True, interval_s=0.25) == [state]  # the delay cap, to the tick
    assert policy.due([state], 0.6249, lagging=True, interval_s=0.25) == []
    assert policy.due([state], 0.5, lagging=False, interval_s=0.25) == [state]  # the interval, to the tick
    assert policy.due([state], 0.4999, lagging=False, interval_s=0.25) == []


# --- a worker behind its engine stretches its chunks (ChunkPolicy.stretch, Pressure) ------

def test_a_worker_keeping_up_uses_its_policy_as_configured():
    from workers.generate.chunks import Pressure

    pressure = Pressure()
    for _ in range(1000):  # every step finds at most one earlier step still publishing
        pressure.step(publishing=1)
    policy = ChunkPolicy()
    assert pressure.value == 0.0
    assert policy.stretch(pressure.value) == 1.0 and policy.stretched(1.0) is policy


def test_a_saturated_worker_makes_chunks_up_to_the_stretch_rarer_and_bigger():
    from workers.generate.chunks import Pressure

    pressure = Pressure()
    for _ in range(200):  # ~10 of its time constants behind at every step
        pressure.step(publishing=3)
    policy = ChunkPolicy(max_tokens=16, max_delay_s=0.02, max_records_per_s=10_000, saturated_stretch=4.0)
    stretch = policy.stretch(pressure.value)
    assert stretch == 4.0
    worst = policy.stretched(stretch)
    assert (worst.max_tokens, worst.max_delay_s, worst.max_records_per_s) == (64, 0.08, 2500.0)
    assert worst.interval(running=256) == 4 * policy.interval(running=256)  # ~100 ms instead of ~26
    assert worst.lag_threshold == policy.lag_threshold
    # a request's first token still leaves at once: the stretch spaces chunks, not the first one
    assert worst.due_at(1, 5.0, NEVER_PUBLISHED, lagging=False, interval_s=worst.interval(256)) == 5.0


def test_the_stretch_grows_with_pressure_in_quarters_and_goes_back_once_the_worker_keeps_up():
    from workers.generate.chunks import Pressure

    policy = ChunkPolicy(saturated_stretch=4.0)
    assert [policy.stretch(p) for p in (0.0, 0.01, 0.1, 0.5, 1.0, 3.0)] == [1.0, 1.0, 1.25, 2.5, 4.0, 4.0]
    assert ChunkPolicy(saturated_stretch=1.0).stretch(1.0) == 1.0  # 1: never
    pressure = Pressure()
    for _ in range(200):
        pressure.step(publishing=4)
    for _ in range(100):  # caught up: five time constants later the stretch is gone
        pressure.step(publishing=0)
    assert policy.stretch(pressure.value) == 1.0


def test_one_busy_step_now_and_then_barely_stretches():
    from workers.generate.chunks import Pressure

    pressure = Pressure()
    for n in range(2000):  # one step in 50 finds the worker behind
        pressure.step(publishing=2 if n % 50 == 0 else 0)
    assert 0.0 < pressure.value < 0.06 and ChunkPolicy().stretch(pressure.value) <= 1.25
