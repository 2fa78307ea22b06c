"""Small helpers for tests against the real broker: read a topic, wait on a condition."""

from __future__ import annotations

import asyncio
import time

from aiokafka import AIOKafkaConsumer

from schemas import GenerateChunk
from workers.kafka.clients import make_admin
from workers.kafka.records import decode_message
from workers.kafka.settings import KafkaSettings


async def read_topic(settings: KafkaSettings, topic: str, *, until, timeout: float = 60.0) -> list:
    """Read `topic` from the start until `until(records)` is true; fail after `timeout`."""
    consumer = AIOKafkaConsumer(topic, **settings.client_kwargs(), group_id=None,
                                auto_offset_reset="earliest", fetch_max_wait_ms=20)
    await consumer.start()
    records = []
    deadline = time.monotonic() + timeout
    try:
        while not until(records):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s reading {topic}: {len(records)} records")
            batch = await consumer.getmany(timeout_ms=100)
            for messages in batch.values():
                records.extend(messages)
    finally:
        await consumer.stop()
    return records


def chunks_finished(request_ids):
    """A `read_topic` condition on a chunk topic: each of `request_ids` has its final chunk
    (one with a finish_reason). Counting records or keys instead would depend on how the
    worker happened to group tokens into chunks."""
    wanted, done, seen = set(request_ids), set(), 0

    def check(records) -> bool:
        nonlocal seen
        for record in records[seen:]:
            chunk = decode_message(record, GenerateChunk)
            if chunk.finish_reason is not None:
                done.add(chunk.request_id)
        seen = len(records)
        return wanted <= done
    return check


async def committed_offsets(settings: KafkaSettings, group: str, partitions: list) -> dict:
    """The group's committed offsets (with metadata) for these TopicPartitions, from the broker."""
    admin = make_admin(settings)
    await admin.start()
    try:
        return await admin.list_consumer_group_offsets(group, partitions=partitions)
    finally:
        await admin.close()


async def wait_for(condition, timeout: float = 60.0, what: str = "condition") -> None:
    """Wait until `condition()` is true, checking every 20 ms; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


async def read_to_end(settings: KafkaSettings, topic: str, timeout: float = 60.0) -> list:
    """Every record of `topic` up to its end offsets as of the call (a snapshot)."""
    consumer = AIOKafkaConsumer(topic, **settings.client_kwargs(), group_id=None,
                                auto_offset_reset="earliest", fetch_max_wait_ms=20)
    await consumer.start()
    try:
        await wait_for(lambda: consumer.assignment(), timeout, f"the partitions of {topic}")
        partitions = sorted(consumer.assignment())
        ends = await consumer.end_offsets(partitions)
        records = []
        deadline = time.monotonic() + timeout
        for tp in partitions:
            while await consumer.position(tp) < ends[tp]:
                if time.monotonic() > deadline:
                    raise AssertionError(f"timed out after {timeout}s reading {topic} to its end")
                for messages in (await consumer.getmany(tp, timeout_ms=100)).values():
                    records.extend(m for m in messages if m.offset < ends[tp])
    finally:
        await consumer.stop()
    return records


async def wait_for_commit(settings: KafkaSettings, group: str, tp, offset: int, timeout: float = 30.0,
                          what: str = "the commit") -> None:
    """Wait until `group` has committed `offset` on `tp` (workers commit every few seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        committed = (await committed_offsets(settings, group, [tp])).get(tp)
        if committed is not None and committed.offset == offset:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: {group} committed {committed} on {tp} after {timeout}s, not {offset}")
        await asyncio.sleep(0.2)


async def delete_topic(settings: KafkaSettings, name: str) -> None:
    """Delete one topic (a client's reply topic, or a deployment's own under its worker)."""
    admin = make_admin(settings)
    await admin.start()
    try:
        await admin.delete_topics([name])
    finally:
        await admin.close()


async def create_topic(settings: KafkaSettings, name: str, partitions: int = 1,
                       max_message_bytes: int | None = None) -> None:
    """One topic beside a deployment's six (a reply topic), optionally with its own record limit."""
    from aiokafka.admin import NewTopic

    configs = {"max.message.bytes": str(max_message_bytes)} if max_message_bytes is not None else {}
    admin = make_admin(settings)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1, topic_configs=configs)])
    finally:
        await admin.close()


async def set_max_message_bytes(settings: KafkaSettings, topic: str, limit: int) -> None:
    """Change a topic's record limit (an operator's `kafka-configs --alter`)."""
    await set_topic_config(settings, topic, {"max.message.bytes": str(limit)})


async def set_topic_config(settings: KafkaSettings, topic: str, configs: dict[str, str]) -> None:
    """Set a topic's configs (an operator's `kafka-configs --alter`; the others go back to
    the broker's defaults, as with a non-incremental AlterConfigs)."""
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    admin = make_admin(settings)
    await admin.start()
    try:
        await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs=configs)])
    finally:
        await admin.close()
