"""Prometheus metrics of both workers, defined once (docs/design.md §7, `--metrics-port`).

Names follow Prometheus conventions (`genpipe_<thing>_<unit>`); the `worker` label says
which side counted. Served by prometheus_client's own HTTP server thread, so scraping
never touches the event loop or the engine thread.
"""

from __future__ import annotations

import bisect
import functools
import gc
import time

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)

REQUESTS = Counter("genpipe_requests_total", "Requests taken, by outcome", ["worker", "outcome"])
TOKENS = Counter("genpipe_tokens_total", "Tokens generated (generate) or rendered (derender)", ["worker"])
CHUNKS = Counter("genpipe_chunks_total", "Chunk records published (generate) or consumed (derender)", ["worker"])
RESULTS = Counter("genpipe_results_total", "Result records published", ["worker"])
ERRORS = Counter("genpipe_errors_total", "Requests ended with an error result or chunk", ["worker"])
DLQ = Counter("genpipe_dlq_records_total", "Records copied to the DLQ", ["worker"])
REPLY_REFUSED = Counter("genpipe_reply_topic_refused_total",
                        "Requests answered on the default results topic because their reply_topic was "
                        "not allowed, missing or refused the record", ["worker"])
PUBLISH_REFUSED = Counter("genpipe_publish_refused_total",
                          "Records the broker refused for good (too large for their topic, not allowed): "
                          "their request is answered with an error in their place", ["worker"])
IN_FLIGHT = Gauge("genpipe_in_flight_requests", "Requests started and not finished", ["worker"])
REBALANCES = Counter("genpipe_rebalances_total", "Partition assignments this worker received "
                     "(one per rebalance it took part in)", ["worker"])
WAITING = Gauge("genpipe_waiting_requests", "Requests read and queued, not yet started (generate)", ["worker"])
BATCH_SIZE = Histogram("genpipe_batch_size", "Requests in one engine step", ["worker"],
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
CHUNK_STRETCH = Gauge("genpipe_chunk_stretch", "How many times rarer and bigger than configured a generate "
                      "worker makes its chunks, because it is behind its engine (1: not behind)", ["worker"])
CHUNK_HOLD = Histogram("genpipe_chunk_hold_seconds", "How long the oldest token of a chunk waited to be "
                       "coalesced (from its step reaching the engine's token holder to the chunk being "
                       "taken in the generate worker)", ["worker"],
                       # finer where the policy acts: a step or two (the latency setting's cap,
                       # --coalesce-max-delay-ms 4 at 2 ms steps), and the default cap (20 ms) up
                       # to 4x that, stretched
                       buckets=(0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025,
                                0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.5, 1, 5))
CONSUMER_LAG = Gauge("genpipe_consumer_lag_records", "Records behind the end of the input topic", ["worker"])
TTFT = Histogram("genpipe_time_to_first_token_seconds", "Request read to first token sampled", ["worker"],
                 buckets=_LATENCY_BUCKETS)
INTER_TOKEN = Histogram("genpipe_inter_token_latency_seconds",
                        "Between a request's consecutive tokens (generate: the longest gap of each engine "
                        "step, observed once per step)",
                        ["worker"], buckets=_LATENCY_BUCKETS)
STEP_TIME = Histogram("genpipe_step_time_seconds", "One engine step (prefill and decode)", ["worker"],
                      buckets=_LATENCY_BUCKETS)
GATEWAY_RELAY = Histogram("genpipe_gateway_relay_seconds",
                          "A result record's arrival at the gateway's reader of its reply topic to its "
                          "server-sent event handed to the HTTP server (what the gateway adds to a token)",
                          buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5))
GATEWAY_REQUESTS = Counter("genpipe_gateway_requests_total",
                           "Generation requests the gateway answered, by route and HTTP status (a stream: 200 "
                           "when it ended with [DONE], else its error event's code; 499: the client went away or stopped reading)",
                           ["route", "status"])
DERENDER_LATENCY = Histogram("genpipe_derender_latency_seconds",
                             "Token sampled (chunk sampled_at_ns) to its result handed to the producer",
                             ["worker"], buckets=_LATENCY_BUCKETS)


@functools.lru_cache(maxsize=None)
def series(metric, *labels: str):
    """`metric.labels(*labels)`, looked up once. `labels()` validates and takes a lock on
    every call; per token and chunk it was ~5% of a generate worker's loop (py-spy)."""
    return metric.labels(*labels)


class HistogramBatch:
    """Observations of one histogram series, counted here and added to it once a loop
    turn (`flush`): the exposition is the same as observing each one
    (tests/test_histogram_batch.py holds it to that). Histogram.observe takes two locks and
    walks the buckets: once per chunk it cost the derender 1.06-1.12x per record
    (BENCHMARKS.md, "Each stage alone ... three derender cuts"). Reads prometheus_client's
    bucket bounds and values; where a release lacks them, each observation is passed to
    `observe` at flush instead."""

    def __init__(self, histogram_series):
        self.series = histogram_series
        self.bounds = list(getattr(histogram_series, "_upper_bounds", ()))
        direct = not (self.bounds and hasattr(histogram_series, "_buckets") and hasattr(histogram_series, "_sum"))
        self.amounts: list[float] | None = [] if direct else None
        self.counts = [0] * len(self.bounds)
        self.total = 0.0

    def observe(self, amount: float) -> None:
        if self.amounts is not None:
            self.amounts.append(amount)
            return
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1  # the first bound >= amount, as observe
        self.total += amount

    def flush(self) -> None:
        if self.amounts is not None:
            amounts, self.amounts = self.amounts, []
            for amount in amounts:
                self.series.observe(amount)
            return
        counts = self.counts
        if not any(counts):
            return
        buckets = self.series._buckets
        for i, n in enumerate(counts):
            if n:
                buckets[i].inc(n)
                counts[i] = 0
        self.series._sum.inc(self.total)
        self.total = 0.0


class GcPauses:
    """How long the garbage collector held this process, by generation, exported as
    `genpipe_gc_pause_seconds_total{generation}` (prometheus_client's own
    `python_gc_collections_total` counts them). A collection holds the GIL: the event loop,
    and so every record and token, waits that long; under load it was 9-13% of a
    derender's CPU before workers/gc_tuning.py (BENCHMARKS.md, "The collector's young
    threshold"). The gc callback only adds to plain numbers, read at scrape time: it takes
    no lock, where a prometheus counter's `inc` would (a collection starting in a thread
    that holds that lock would wait on itself)."""

    def __init__(self) -> None:
        self.ns = [0, 0, 0]  # per generation
        self._started = 0

    def on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter_ns()
        else:
            self.ns[info["generation"]] += time.perf_counter_ns() - self._started

    def describe(self):
        return self.collect()

    def collect(self):
        family = CounterMetricFamily("genpipe_gc_pause_seconds", "Time this process spent in garbage "
                                     "collections (holding the GIL), by generation", labels=["generation"])
        for generation, ns in enumerate(self.ns):
            family.add_metric([str(generation)], ns / 1e9)
        yield family


_gc_pauses: GcPauses | None = None


def watch_gc_pauses() -> GcPauses:
    """Time every collection from now on and export it (once per process)."""
    global _gc_pauses
    if _gc_pauses is None:
        _gc_pauses = GcPauses()
        gc.callbacks.append(_gc_pauses.on_collection)
        REGISTRY.register(_gc_pauses)
    return _gc_pauses


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> None:
    watch_gc_pauses()
    start_http_server(port, addr=addr)


def update_lag(consumer, offsets: dict, worker: str) -> None:
    """Sum over assigned partitions of (high watermark - next offset to read), where known."""
    lag = 0
    assigned = consumer.assignment()
    for tp, tracker in offsets.items():
        if tp not in assigned:
            continue  # being revoked: highwater() asserts on unassigned partitions
        high = consumer.highwater(tp)
        if high is not None and tracker.next_offset is not None:
            lag += max(0, high - tracker.next_offset)
    series(CONSUMER_LAG, worker).set(lag)
