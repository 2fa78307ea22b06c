"""HistogramBatch (workers/metrics.py): observations counted in a loop turn and added at
once must read on /metrics exactly as observing each one would. No broker."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from workers.metrics import HistogramBatch

BUCKETS = (0.001, 0.01, 0.1, 1)
# On a bound (observe counts `amount <= bound` in that bucket), between bounds, zero, and past the last.
AMOUNTS = [0.0, 0.001, 0.0010001, 0.05, 0.1, 0.5, 1.0, 7.5, 0.001, 1e-9]


def exposition(registry: CollectorRegistry) -> list[str]:
    # _created is the wall-clock time each series was made: the one line that may differ.
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_a_batch_reads_as_the_same_observations_made_one_by_one():
    direct_registry, batched_registry = CollectorRegistry(), CollectorRegistry()
    direct = Histogram("lat_seconds", "x", ["worker"], buckets=BUCKETS, registry=direct_registry)
    batched = Histogram("lat_seconds", "x", ["worker"], buckets=BUCKETS, registry=batched_registry)
    batch = HistogramBatch(batched.labels("w"))
    for amount in AMOUNTS[:4]:
        direct.labels("w").observe(amount)
        batch.observe(amount)
    assert exposition(batched_registry) != exposition(direct_registry)  # nothing added before flush
    batch.flush()
    assert exposition(batched_registry) == exposition(direct_registry)
    for amount in AMOUNTS[4:]:
        direct.labels("w").observe(amount)
        batch.observe(amount)
    batch.flush()
    batch.flush()  # nothing new: adds nothing
    assert exposition(batched_registry) == exposition(direct_registry)
    assert 'lat_seconds_bucket{le="0.001",worker="w"} 4.0' in exposition(direct_registry)


def test_without_the_client_s_internals_each_amount_is_observed_at_flush():
    registry = CollectorRegistry()
    histogram = Histogram("lat_seconds", "x", buckets=BUCKETS, registry=registry)

    class OnlyObserve:  # a prometheus_client release without the attributes the batch reads
        observe = staticmethod(histogram.observe)

    batch = HistogramBatch(OnlyObserve())
    for amount in AMOUNTS:
        batch.observe(amount)
    assert "lat_seconds_count 0.0" in exposition(registry)
    batch.flush()
    assert f"lat_seconds_count {float(len(AMOUNTS))}" in exposition(registry)
    assert f"lat_seconds_sum {sum(AMOUNTS)}" in exposition(registry)
