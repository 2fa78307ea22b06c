"""Following every partition of a topic without a consumer group.

Every generate worker must see every cancel (whichever worker runs the request), and a
client must see every result on its reply topic: both read all partitions, from a point
in time, with no group and no commits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from aiokafka import TopicPartition
from aiokafka.errors import TopicAuthorizationFailedError

from workers.kafka.clients import make_consumer
from workers.kafka.settings import KafkaSettings

log = logging.getLogger(__name__)


async def assign_all(consumer, topic: str, since_ms: int | None, timeout_s: float = 30.0) -> list[TopicPartition]:
    """Assign every partition of `topic` and seek to `since_ms` (None: the end)."""
    deadline = time.monotonic() + timeout_s
    partitions = consumer.partitions_for_topic(topic)
    while not partitions:
        if topic in consumer._client.cluster.unauthorized_topics:
            # Refused by the broker's ACLs: say so now, not "does not exist" in 30 s.
            raise TopicAuthorizationFailedError(f"not authorized to read topic {topic!r}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"topic {topic!r} does not exist (create it with `genpipe topics create`)")
        # No public call to refresh one topic. Tracking it makes the metadata request name
        # it, so a topic the ACLs refuse comes back as unauthorized, not as absent.
        await consumer._client.add_topic(topic)
        await consumer._client.force_metadata_update()
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            await asyncio.sleep(0.1)
    tps = [TopicPartition(topic, p) for p in sorted(partitions)]
    # Both lookups before assigning: the ends first, so a record that lands between the
    # two is either found by the time lookup or at/after the end we fall back to — never
    # skipped (the other order lost a cancel produced while a generate worker started).
    ends = await consumer.end_offsets(tps)
    found = await consumer.offsets_for_times({tp: since_ms for tp in tps}) if since_ms is not None else {}
    # Then assign and seek with no await in between, so the consumer's first fetch already
    # starts at these positions: a fetch sent from its default position would sit on the
    # broker for up to fetch_max_wait_ms before the seek could take effect.
    consumer.assign(tps)
    for tp in tps:
        consumer.seek(tp, found[tp].offset if found.get(tp) is not None else ends[tp])
    return tps


async def follow(settings: KafkaSettings, topic: str, on_record: Callable[[object], Awaitable[None] | None],
                 stop: asyncio.Event, *, since_ms: int | None = None, ready: asyncio.Event | None = None,
                 poll_timeout_ms: int = 20) -> None:
    """Call `on_record(message)` for every record of `topic` until `stop` is set."""
    consumer = make_consumer(settings, group_id=None, auto_offset_reset="latest")
    await consumer.start()
    try:
        await assign_all(consumer, topic, since_ms)
        if ready is not None:
            ready.set()
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=poll_timeout_ms)
            for messages in batch.values():
                for message in messages:
                    result = on_record(message)
                    if asyncio.iscoroutine(result):
                        await result
    finally:
        await consumer.stop()
