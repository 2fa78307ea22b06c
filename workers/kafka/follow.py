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
from aiokafka.errors import KafkaTimeoutError, TopicAuthorizationFailedError

from workers.kafka.clients import make_consumer
from workers.kafka.settings import KafkaSettings

log = logging.getLogger(__name__)


async def partitions_of(consumer, topic: str, timeout_s: float = 30.0) -> list[TopicPartition]:
    """Every partition of `topic`, waiting up to `timeout_s` for the metadata."""
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
    return [TopicPartition(topic, p) for p in sorted(partitions)]


async def assign_all(consumer, topic: str, since_ms: int | None, timeout_s: float = 30.0,
                     wait_for_leaders: bool = False) -> list[TopicPartition]:
    """Assign every partition of `topic` and seek to `since_ms` (None: the end). The
    offset lookups need every partition's leader; without one they fail after the
    consumer's request timeout, or with `wait_for_leaders` (a worker starting while a
    broker of the cluster is away) are tried again until it answers."""
    tps = await partitions_of(consumer, topic, timeout_s)
    # Both lookups before assigning: the ends first, so a record that lands between the
    # two is either found by the time lookup or at/after the end we fall back to — never
    # skipped (the other order lost a cancel produced while a generate worker started).
    # (An end looked up long before the time lookup is as safe: it is only used where no
    # record of `since_ms` or later was found, and so none came after it.)
    ends = await _looked_up(lambda: consumer.end_offsets(tps), topic, wait_for_leaders)
    found = await _looked_up(lambda: consumer.offsets_for_times({tp: since_ms for tp in tps}),
                             topic, wait_for_leaders) if since_ms is not None else {}
    # Then assign and seek with no await in between, so the consumer's first fetch already
    # starts at these positions: a fetch sent from its default position would sit on the
    # broker for up to fetch_max_wait_ms before the seek could take effect.
    consumer.assign(tps)
    for tp in tps:
        consumer.seek(tp, found[tp].offset if found.get(tp) is not None else ends[tp])
    return tps


async def _looked_up(lookup: Callable[[], Awaitable[dict]], topic: str, wait_for_leaders: bool) -> dict:
    """`lookup()`; with `wait_for_leaders`, again after each timeout. A generate worker
    that started while a partition of its cancel topic had no leader (one replica, its
    broker away) stopped after 40 s with this lookup's timeout (tests/test_cluster.py)."""
    while True:
        try:
            return await lookup()
        except KafkaTimeoutError as exc:
            if not wait_for_leaders:
                raise
            log.warning("%s: offsets not found (%s; does every partition have a leader?): trying again", topic, exc)


async def assign_range(consumer, topic: str, start: tuple[str, int], end: int | None = None,
                       timeout_s: float = 30.0) -> dict[TopicPartition, int]:
    """Assign the partitions of `topic` that have records in a range, positioned at its
    start; return each one's stop offset (exclusive). `start` is ("offset", n), the same
    offset in every partition (clipped to the oldest retained one), or ("time", epoch ms),
    each partition's first record at or after it. The range ends at `end` in every
    partition or, without one, at the end offsets as of this call."""
    tps = await partitions_of(consumer, topic, timeout_s)
    consumer.assign(tps)
    begins = await consumer.beginning_offsets(tps)
    ends = await consumer.end_offsets(tps)
    if start[0] == "time":
        found = await consumer.offsets_for_times({tp: start[1] for tp in tps})
        first = {tp: found[tp].offset if found.get(tp) is not None else ends[tp] for tp in tps}
    else:
        first = {tp: max(start[1], begins[tp]) for tp in tps}
    stop = {tp: ends[tp] if end is None else min(ends[tp], end) for tp in tps}
    active = {tp: stop[tp] for tp in tps if first[tp] < stop[tp]}
    consumer.assign(list(active))
    for tp in active:
        consumer.seek(tp, first[tp])
    return active


def make_follower(settings: KafkaSettings, reset: str = "latest"):
    """A consumer for `assign_all` and `batches`: no group (its topic's metadata is looked
    up every `METADATA_MAX_AGE_MS`, so that `NewPartitions` finds what it gains). `reset`:
    where it goes when its position is no longer in the log (retention deleted it)."""
    return make_consumer(settings, group_id=None, auto_offset_reset=reset)


class NewPartitions:
    """Partitions that a followed topic gains (`genpipe topics create --grow`), added to the
    consumer's assignment. aiokafka re-assigns only a group's subscription: a consumer
    assigned by hand never read them, and what was written there was never seen (a
    client's requests on new partitions ended in GenpipeTimeout, a generate worker missed
    the cancels there). Found in the consumer's metadata (looked up every 30 s:
    clients.py `METADATA_MAX_AGE_MS`), looked at once a second; a new partition is read
    from its beginning, since everything in it is newer than the follower's start."""

    LOOK_EVERY_S = 1.0

    def __init__(self, consumer, topic: str):
        self.consumer, self.topic = consumer, topic
        self.known = {tp.partition for tp in consumer.assignment() if tp.topic == topic}
        self._next_look = time.monotonic() + self.LOOK_EVERY_S
        self._lookup: asyncio.Task | None = None  # the new partitions' first offsets

    async def take(self) -> None:
        """Between two polls: look for new partitions, or add those whose first offsets
        are known. The assignment changes with no await between it and the seeks, and
        every partition already read goes on from where it was."""
        lookup = self._lookup
        if lookup is None:
            now = time.monotonic()
            if now >= self._next_look:
                self._next_look = now + self.LOOK_EVERY_S
                new = sorted(set(self.consumer.partitions_for_topic(self.topic) or ()) - self.known)
                if new:
                    tps = [TopicPartition(self.topic, p) for p in new]
                    # (beside the polls: a partition without a leader yet holds no one up)
                    self._lookup = asyncio.ensure_future(
                        _looked_up(lambda: self.consumer.beginning_offsets(tps), self.topic, True))
            return
        if not lookup.done():
            return
        self._lookup = None
        try:
            firsts = lookup.result()
        except Exception as exc:  # (looked for again at the next look)
            log.warning("%s: the first offsets of its new partitions were not found (%r); trying again",
                        self.topic, exc)
            return
        consumer = self.consumer
        positions = {tp: await consumer.position(tp) for tp in consumer.assignment()}
        consumer.assign([*positions, *firsts])
        for tp, offset in {**positions, **firsts}.items():
            consumer.seek(tp, offset)
        self.known.update(tp.partition for tp in firsts)
        log.info("%s: reading its %d new partitions too (%s)", self.topic, len(firsts),
                 ", ".join(str(tp.partition) for tp in sorted(firsts)))

    def close(self) -> None:
        if self._lookup is not None:
            self._lookup.cancel()


async def batches(consumer, *, poll_ms: int = 100, until: dict[TopicPartition, int] | None = None,
                  follow: str | None = None):
    """The records of the consumer's assigned partitions, one list per poll, in partition
    order (a list may be empty, so a caller can notice an idle topic). With `until`
    (partition -> stop offset), records at or past a partition's stop are left out and the
    iteration ends once every partition has reached its stop. With `follow` (a topic), the
    partitions it gains are read too (`NewPartitions`)."""
    left = dict(until) if until is not None else None
    grown = NewPartitions(consumer, follow) if follow is not None else None
    try:
        while left is None or left:
            if grown is not None:
                await grown.take()
            fetched = await consumer.getmany(*(left or ()), timeout_ms=poll_ms)
            records = []
            for tp, messages in fetched.items():
                stop = left.get(tp) if left is not None else None
                records.extend(m for m in messages if stop is None or m.offset < stop)
            yield records
            if left is not None:
                for tp in list(left):
                    if await consumer.position(tp) >= left[tp]:
                        del left[tp]
                        consumer.pause(tp)
    finally:
        if grown is not None:
            grown.close()


async def follow(settings: KafkaSettings, topic: str, on_record: Callable[[object], Awaitable[None] | None],
                 stop: asyncio.Event, *, since_ms: int | None = None, ready: asyncio.Event | None = None,
                 poll_timeout_ms: int = 20) -> None:
    """Call `on_record(message)` for every record of `topic` until `stop` is set."""
    consumer = make_follower(settings)
    await consumer.start()
    try:
        await assign_all(consumer, topic, since_ms, wait_for_leaders=True)
        if ready is not None:
            ready.set()
        async for records in batches(consumer, poll_ms=poll_timeout_ms, follow=topic):
            for message in records:
                result = on_record(message)
                if asyncio.iscoroutine(result):
                    await result
            if stop.is_set():
                return
    finally:
        await consumer.stop()
