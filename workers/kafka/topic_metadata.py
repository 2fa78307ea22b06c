"""What a worker's producer knows of the topics it writes: whether one exists, how many
partitions it has, how large a record batch it takes, and when one was deleted under
records queued for it. Lookups are bounded (aiokafka alone waits its request timeout for
a missing topic, and raises)."""

from __future__ import annotations

import asyncio
import logging
import time

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, UnknownTopicOrPartitionError
from aiokafka.partitioner import murmur2

from workers.kafka.clients import retrieve_failure

log = logging.getLogger(__name__)

# How long a worker waits to learn whether a topic exists. aiokafka alone waits its whole
# request timeout and then raises, which stopped the derender on a reply topic with a
# typo (and again after every restart: a crash loop); a lookup is bounded by this and a
# missing topic is remembered for UNKNOWN_TOPIC_RECHECK_S, so a stream of records naming
# it costs one metadata request, not one wait each.
METADATA_WAIT_S = 5.0
UNKNOWN_TOPIC_RECHECK_S = 10.0
_UNKNOWN_TOPICS_KEPT = 10_000

# A topic deleted while records for it were queued: aiokafka waits for it for good (our
# producers never expire a batch: workers/kafka/clients.py `keep_batches_until_sent`).
# Absent from the cluster's metadata this long, and again in a fresh lookup, it is gone.
DELETED_TOPIC_WAIT_S = 30.0

# A topic's `max.message.bytes` is read when the topic is first looked up, and again this
# often while it is known: a client that raises its reply topic's limit after being told
# to sees it taken within this time.
LIMITS_RECHECK_S = 60.0


class TopicUnavailable(Exception):
    """The topic does not exist (or this client may not see it): nothing was sent."""

    def __init__(self, topic: str):
        super().__init__(f"topic {topic!r} does not exist (or this worker may not write to it)")
        self.topic = topic


def key_partition(key: str | bytes, count: int) -> int:
    """The partition of `key` among `count`, as aiokafka's (and Java's) default partitioner
    picks it for a record sent without one: murmur2 of the key's bytes."""
    return (murmur2(key if key.__class__ is bytes else key.encode()) & 0x7FFFFFFF) % count


class TopicCounts:
    """The partition counts of the topics a producer writes, and the topics it found missing."""

    def __init__(self, producer: AIOKafkaProducer):
        self.producer = producer
        self.counts: dict[str, int] = {}  # known topics: their partition counts
        self._unknown: dict[str, float] = {}  # topic -> when to look again
        self._missing_since: dict[str, float] = {}  # topics with queued records, absent from the metadata
        self._next_deleted_check = 0.0
        # max.message.bytes of the known topics the broker would describe to this client
        # (ACLs may not allow it: those are left out): `Publisher.record_limit`, `_new_batch`.
        self.limits: dict[str, int] = {}
        self._next_limits_check = 0.0
        self._limits_task: asyncio.Task | None = None

    @property
    def client(self):
        return self.producer.client

    def known(self, topic: str) -> int:
        """The topic's partition count when known and still in the producer's metadata,
        else 0; never waits (`count` looks a topic up)."""
        count = self.counts.get(topic, 0)
        return count if count and self.client.cluster.partitions_for_topic(topic) is not None else 0

    async def count(self, topic: str) -> int:
        """The topic's partition count; 0 when it does not exist or the broker did not say
        within METADATA_WAIT_S. Never raises."""
        count = self.counts.get(topic)
        if count:
            if self.client.cluster.partitions_for_topic(topic) is not None:
                return count
            # Gone from the producer's metadata (deleted?): look again, bounded. aiokafka's
            # send() waited 30 s for it, and the derender's loop with it, for every record.
            del self.counts[topic]
        now = time.monotonic()
        if self._unknown.get(topic, 0.0) > now:
            return 0
        count = await self._lookup(topic)
        if count:
            self.counts[topic] = count
            self._unknown.pop(topic, None)
            await self._read_limits([topic])
        else:
            if len(self._unknown) >= _UNKNOWN_TOPICS_KEPT:
                self._unknown.clear()
            self._unknown[topic] = now + UNKNOWN_TOPIC_RECHECK_S
        return count

    async def _lookup(self, topic: str) -> int:
        known = self.client.cluster.partitions_for_topic(topic)
        if known:
            # (known from metadata that named every topic: tracked from now on, or the
            # producer's next refresh, which names only its tracked topics, drops it)
            self.client.add_topic(topic)
            return len(known)
        # One metadata request for every topic, bounded; it names no topic, so it never
        # makes a broker with auto-create on create one.
        deadline = time.monotonic() + METADATA_WAIT_S
        try:
            cluster = await asyncio.wait_for(self.client.fetch_all_metadata(), METADATA_WAIT_S)
        except (asyncio.TimeoutError, KafkaError) as exc:
            log.warning("could not look up topic %r: %r", topic, exc)
            return 0
        count = len(cluster.partitions_for_topic(topic) or ())
        if count:
            await self._track(topic, deadline)
        return count

    async def _track(self, topic: str, deadline: float) -> None:
        """The producer's own metadata tracks `topic` from now on, as a send would make it.
        Until then `count` took the topic's absence there for a deletion and looked it up
        again on every call: a derender's first turn with a new reply topic made one
        whole-cluster request per chunk (226 for one test's 240 chunks; against a broker
        with ~5,000 topics, 0.1-0.8 s each, the loop waiting on each). `add_topic` may
        hand back an update already under way, which does not name the topic: then one
        more (bounded by `deadline`; past it, looked up again next time)."""
        for update in (lambda: self.client.add_topic(topic), self.client.force_metadata_update):
            try:
                await asyncio.wait_for(asyncio.shield(update()), max(0.1, deadline - time.monotonic()))
            except (asyncio.TimeoutError, KafkaError) as exc:
                log.warning("topic %r: the producer's metadata did not take it in: %r", topic, exc)
                return
            if self.client.cluster.partitions_for_topic(topic) is not None:
                return

    async def _read_limits(self, topics: list[str]) -> None:
        """Read `max.message.bytes` of `topics` with one DescribeConfigs request through the
        producer's own connection, bounded. A topic the broker does not describe to this
        client (ACLs) keeps no limit: its records go as before, and the broker's refusal of
        one too large is what tells (workers/derender/delivery.py `answer_refused`)."""
        from workers.broker.topics import describe_limits_request, limits_described

        node = self.client.get_random_node()
        if node is None:
            return
        try:
            response = await asyncio.wait_for(self.client.send(node, describe_limits_request(topics)),
                                              METADATA_WAIT_S)
            limits = limits_described([response])
        except (asyncio.TimeoutError, KafkaError, ValueError, KeyError) as exc:
            log.warning("could not read max.message.bytes of %s: %r", ", ".join(topics[:5]), exc)
            return
        for topic in topics:
            if topic in limits:
                self.limits[topic] = limits[topic]
            else:
                self.limits.pop(topic, None)

    def recheck_limits(self) -> None:
        """Read the known topics' limits again in the background, at most every
        LIMITS_RECHECK_S (cheap to call every loop turn)."""
        now = time.monotonic()
        if now < self._next_limits_check or (self._limits_task is not None and not self._limits_task.done()):
            return
        self._next_limits_check = now + LIMITS_RECHECK_S
        if self.counts:
            self._limits_task = asyncio.ensure_future(self._read_limits(list(self.counts)))

    async def fail_records_of_deleted(self) -> list[str]:
        """Fail the records queued for topics deleted after they were handed over (a reply
        topic its client deleted mid-stream); returns those topics. aiokafka waits for such a topic
        for good, and so did what waits on those records: a derender's chunk hold (its
        partition committed no further) and its shutdown. They fail with
        UnknownTopicOrPartitionError, which the derender answers like any refused result.
        Cheap to call every loop turn (`deleted_with_records_queued`)."""
        gone = await self.deleted_with_records_queued()
        accumulator = getattr(self.producer, "_message_accumulator", None)
        for tp in [tp for tp in getattr(accumulator, "_batches", ()) if tp.topic in gone]:
            batches = accumulator._batches.pop(tp)
            log.warning("%s[%d]: the topic was deleted with %d records queued for it: failing them", tp.topic,
                        tp.partition, sum(batch.record_count for batch in batches))
            for batch in batches:
                batch.failure(UnknownTopicOrPartitionError(f"topic {tp.topic!r} was deleted"))
                retrieve_failure(batch)
        return gone

    async def deleted_with_records_queued(self) -> list[str]:
        """The topics deleted while the producer holds records for them, missing from the
        metadata for DELETED_TOPIC_WAIT_S and confirmed by a fresh lookup; their partition
        counts and limits are forgotten (a record for one then finds it missing:
        TopicUnavailable). Their records stay queued. Cheap to call every loop turn: looks
        at most once a second. (A topic without a leader is still in the metadata: its
        records keep waiting.)"""
        now = time.monotonic()
        if now < self._next_deleted_check:
            return []
        self._next_deleted_check = now + 1.0
        accumulator = getattr(self.producer, "_message_accumulator", None)
        queued = {tp.topic for tp in getattr(accumulator, "_batches", ())}
        missing = queued - self.client.cluster.topics()
        for topic in [t for t in self._missing_since if t not in missing]:
            del self._missing_since[topic]
        due = [t for t in missing if now - self._missing_since.setdefault(t, now) >= DELETED_TOPIC_WAIT_S]
        if not due:
            return []
        try:  # confirmed by a fresh lookup: a metadata answer may lack a topic for a moment
            cluster = await asyncio.wait_for(self.client.fetch_all_metadata(), METADATA_WAIT_S)
        except (asyncio.TimeoutError, KafkaError):
            return []
        gone = [t for t in due if not cluster.partitions_for_topic(t)]
        for topic in gone:
            self._missing_since.pop(topic, None)
            self.counts.pop(topic, None)  # its next record finds it missing (TopicUnavailable)
            self.limits.pop(topic, None)
        return gone
