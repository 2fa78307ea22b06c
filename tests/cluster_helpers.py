"""Helpers of tests/test_cluster.py: a pipeline on the cluster, requests placed on a
partition, streams read with their gaps, the topics' leaders."""

from __future__ import annotations

import asyncio
import time

from tests.process_helpers import uninterrupted_texts
from workers.broker.topics import create_topics
from workers.client import Restart, make_request
from workers.kafka.clients import make_admin
from workers.kafka.settings import TOPIC_ROLES


async def partition_leaders(settings, topic: str) -> dict[int, int]:
    admin = make_admin(settings)
    await admin.start()
    try:
        described = await admin.describe_topics([topic])
        return {p["partition"]: p["leader"] for p in described[0]["partitions"]}
    finally:
        await admin.close()


async def controller_id(settings) -> int:
    admin = make_admin(settings)
    await admin.start()
    try:
        return (await admin.describe_cluster())["controller_id"]
    finally:
        await admin.close()


async def stream(client, request, gaps: list[float]) -> tuple[str, int]:
    """The last attempt's text and the restarts seen; the longest wait between results."""
    text, restarts, last = [], 0, time.monotonic()
    async for item in client.stream(request):
        now = time.monotonic()
        gaps.append(now - last)
        last = now
        if isinstance(item, Restart):
            restarts, text = restarts + 1, []
        else:
            text.append(item.choices[0].text)
    return "".join(text), restarts


class Pipeline:
    """A generate and a derender worker (in this process) on the cluster."""

    def __init__(self, settings, model_dir):
        from workers.derender.service import DerenderWorkerConfig, run_derender_worker
        from workers.generate.engine import Engine
        from workers.generate.service import GenerateWorkerConfig, run_generate_worker

        prefix = settings.topic_prefix
        self.stop = asyncio.Event()
        self.ready = [asyncio.Event(), asyncio.Event()]
        # Paced like a real model (20 tokens/s a request), so streams outlive a failover.
        self.tasks = [
            asyncio.ensure_future(run_generate_worker(
                settings, GenerateWorkerConfig(group_id=f"{prefix}-generate", max_batch=8, min_step_s=0.05),
                engine=Engine(str(model_dir), max_batch=8), stop=self.stop, on_ready=self.ready[0].set)),
            asyncio.ensure_future(run_derender_worker(
                settings, DerenderWorkerConfig(tokenizer=str(model_dir), group_id=f"{prefix}-derender"),
                stop=self.stop, on_ready=self.ready[1].set))]

    async def started(self) -> None:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in self.ready)), 120)

    def alive(self) -> bool:
        return not any(t.done() for t in self.tasks)

    async def close(self) -> list:
        self.stop.set()
        return await asyncio.wait_for(asyncio.gather(*self.tasks, return_exceptions=True), 120)


def requests_for(tag: str, n: int, max_tokens: int):
    return [make_request([1, 100 + 7 * i, 200 + i], kind="completion", request_id=f"{tag}-{i}", max_tokens=max_tokens,
                         temperature=0, ignore_eos=True, stream=True) for i in range(n)]


async def create_placed_topics(settings, victim: int) -> None:
    """genpipe's topics, 2 partitions, 1 replica each: chunks[0] on broker `victim`, every
    other partition on the other brokers (1-3)."""
    from aiokafka.admin import NewTopic

    others = [b for b in (1, 2, 3) if b != victim]
    admin = make_admin(settings)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(
            settings.topic(role), -1, -1,
            replica_assignments={0: [victim if role == "chunks" else others[0]], 1: [others[1]]},
            topic_configs={"min.insync.replicas": "1"}) for role in TOPIC_ROLES])
    finally:
        await admin.close()
    await create_topics(settings, partitions=2, replication_factor=1)  # (they exist: waits for their leaders)
    leaders = await partition_leaders(settings, settings.topic("chunks"))
    assert leaders == {0: victim, 1: others[1]}, leaders


def on_partition(tag: str, partition: int, max_tokens: int):
    """A request whose id the client's producer sends to `partition` of 2 (murmur2, as
    aiokafka's default partitioner): it stays on that partition number end to end."""
    from aiokafka.partitioner import murmur2

    i = next(i for i in range(1000) if (murmur2(f"{tag}-{i}".encode()) & 0x7FFFFFFF) % 2 == partition)
    return make_request([1, 100 + 7 * i, 200 + i], kind="completion", request_id=f"{tag}-{i}", max_tokens=max_tokens,
                        temperature=0, ignore_eos=True, stream=True)


def assert_uninterrupted(model_dir, requests, done: list[tuple[str, int]]) -> None:
    """Each request's last attempt reads as the same request run without any failure."""
    expected = uninterrupted_texts(model_dir, requests)
    for request, (text, _) in zip(requests, done):
        assert text == expected[request.request_id], request.request_id


async def wait_for_leaders(condition, settings, topic: str, what: str, timeout: float = 60) -> None:
    """Until `condition(leaders)` holds for the topic's partition leaders (-1: none)."""
    from aiokafka.errors import KafkaError

    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition(await partition_leaders(settings, topic)):
                return
        except KafkaError:  # (the admin client asked the broker that is away)
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.2)
