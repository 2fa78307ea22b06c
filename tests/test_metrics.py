"""Prometheus metrics: a worker's counters move and the endpoint serves them."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest

from schemas import GenerateRequest, SamplingParams, encode, headers_for
from tests.kafka_helpers import wait_for
from tests.process_helpers import free_port
from workers.generate.service import GenerateWorkerConfig, run_generate_worker
from workers.kafka.clients import make_producer
from workers.metrics import start_metrics_server

pytestmark = pytest.mark.kafka



def scrape(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def test_generate_worker_metrics_are_served(kafka_settings, make_topics, tiny_model_dir):
    await make_topics(kafka_settings, partitions=1)
    port = free_port()
    start_metrics_server(port, addr="127.0.0.1")
    # Earlier tests in this process moved the same counters: measure what this run adds.
    names = ('genpipe_tokens_total{worker="generate"}', 'genpipe_requests_total{outcome="length",worker="generate"}',
             'genpipe_time_to_first_token_seconds_count{worker="generate"}',
             'genpipe_step_time_seconds_count{worker="generate"}')
    start = scrape(port)
    before = {name: start.get(name, 0.0) for name in names}
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.ensure_future(run_generate_worker(
        kafka_settings, GenerateWorkerConfig(model=str(tiny_model_dir), group_id=f"{kafka_settings.topic_prefix}-g"),
        stop=stop, on_ready=ready.set))
    try:
        await asyncio.wait_for(ready.wait(), 60)
        producer = make_producer(kafka_settings)
        await producer.start()
        request = GenerateRequest(request_id="m1", prompt_token_ids=[1, 5, 6],
                                  sampling=SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        await producer.send_and_wait(kafka_settings.topic("requests"), encode(request), key=b"m1",
                                     headers=headers_for(request))
        await producer.stop()
        await wait_for(lambda: scrape(port).get(names[0], 0.0) >= before[names[0]] + 5,
                       what="5 generated tokens counted")
    finally:
        stop.set()
        await task
    values = scrape(port)
    added = {name: values.get(name, 0.0) - before[name] for name in names}
    assert added[names[0]] == 5  # five tokens, counted once
    assert added[names[1]] == 1  # one request, ended by its length
    assert added[names[2]] == 1  # one first token
    assert added[names[3]] >= 5  # a step per token at least (prefill may take its own)
    assert 'genpipe_consumer_lag_records{worker="generate"}' in values


def test_the_collectors_pauses_are_served_by_generation():
    """A collection holds the GIL: the endpoint says how long, per generation, counted by
    a gc callback that takes no lock (workers/metrics.py GcPauses)."""
    import gc

    port = free_port()
    start_metrics_server(port, addr="127.0.0.1")
    names = [f'genpipe_gc_pause_seconds_total{{generation="{g}"}}' for g in range(3)]
    before = scrape(port)
    assert all(name in before for name in names)
    held = [[i] for i in range(300_000)]  # tracked objects a full collection walks: a pause to see
    gc.collect(0)
    gc.collect()
    after = scrape(port)
    assert after[names[0]] > before[names[0]]
    assert after[names[2]] - before[names[2]] > 0.001, "a full collection over 300,000 objects took no time"
    del held
