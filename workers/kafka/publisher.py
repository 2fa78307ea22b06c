"""Publishing records and knowing when the broker has them (which topics exist, and
their partition counts: topic_metadata.py).

`publish()` returns a future that resolves when the broker acknowledged the record;
workers release an offset only then (docs/design.md §4: commit only past acknowledged work).
`in_flight` counts unacknowledged records: the generate worker coalesces tokens while
it is high (the producer lags), and streams token by token while it is low.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Awaitable, Callable, Collection

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError, KafkaTimeoutError
from aiokafka.producer.message_accumulator import BatchBuilder

from workers.broker.topics import BATCH_OVERHEAD_BYTES
from workers.kafka.lanes import STUCK_AFTER_S, Lanes
from workers.kafka.records import DlqCopy, Outgoing, dlq_copy
from workers.kafka.settings import MAX_RECORD_BYTES
from workers.kafka.topic_metadata import TopicCounts, TopicUnavailable, key_partition
from workers.log_digest import LogDigest

log = logging.getLogger(__name__)


# Shutdown: how long a worker waits for the broker to take and acknowledge the records it
# handed over. With the broker away, aiokafka waits for it as long as it is away, and a
# worker told to stop never stopped (docs/design.md §7). Past this it stops without them;
# their work was not committed, so the partitions' next owner redoes it.
SHUTDOWN_WAIT_S = 10.0
# Rebalance: how long a worker giving partitions up waits for the records it handed over
# to be acknowledged (so a partition that moves is not re-run past finished work). With a
# partition of the cluster without a leader that wait had no end, and the whole group's
# rebalance waited with it: every member, whatever its partitions (docs/design.md §7, "Fleet").
REBALANCE_WAIT_S = 10.0


def request_size_for(max_record_bytes: int) -> int:
    """The producer's max_request_size for a record limit: never the one that refuses."""
    return max(1 << 20, max_record_bytes + (64 << 10))


class Publisher:
    def __init__(self, producer: AIOKafkaProducer, dlq_topic: str, max_record_bytes: int = MAX_RECORD_BYTES):
        self.producer = producer
        self.dlq_topic = dlq_topic
        self.max_record_bytes = max_record_bytes
        self.in_flight = 0
        self.published = 0
        self.failed = 0
        self.topics = TopicCounts(producer)  # which topics exist, their partition counts (topic_metadata.py)
        self.stuck = False  # a shutdown flush ran out of time: the broker is away, waiting again is no use
        # The deployment's topics this worker writes, where its records may go elsewhere too
        # (the derender's reply topics): failures of the others are the caller's to log.
        # None: every topic is its own.
        self.own_topics: frozenset[str] | None = None
        self.lanes = Lanes(self._send_in_lane)  # partitions the producer cannot take records for (lanes.py)
        accumulator = getattr(producer, "_message_accumulator", None)
        self._queued = getattr(accumulator, "_batches", None)  # each partition's batch not yet taken by the sender
        # The producer's batch size and compression, for batches cut smaller (`_batch_cap`);
        # where this aiokafka hides them, no batch is cut.
        self._batch_bytes = getattr(accumulator, "_batch_size", None)
        self._compression = getattr(accumulator, "_compression_type", None)
        # Each partition's last batch handed over, while the sender has not taken it: the
        # next records for the partition join it (`_join_queued`).
        self._open: dict[TopicPartition, tuple] = {}
        # A line per DLQ copy, until copies come in a flood: then a count (log_digest.py).
        self._dlq_log = LogDigest(log, logging.WARNING, "records copied to the DLQ")
        # And a line per copy the DLQ refuses (no write ACL, its limit lowered): the same flood.
        self._dlq_refused = LogDigest(log, logging.ERROR, "DLQ copies refused")

    def fits(self, record: Outgoing) -> bool:
        return record.size() <= self.max_record_bytes

    async def partition_count(self, topic: str) -> int:
        """The topic's partition count, looked up when not known (`TopicCounts.count`)."""
        return await self.topics.count(topic)

    async def deleted_topics(self) -> list[str]:
        """The topics deleted since while records for them wait in the producer, which
        stay there (`TopicCounts.deleted_with_records_queued`)."""
        return await self.topics.deleted_with_records_queued()

    def known_partitions(self, topic: str) -> int:
        """The topic's partition count if known, else 0; never waits (`TopicCounts.known`)."""
        return self.topics.known(topic)

    async def fail_records_of_deleted_topics(self) -> list[str]:
        """Fail the records queued for topics deleted since (`TopicCounts.fail_records_of_deleted`),
        and read the known topics' `max.message.bytes` again when due (`recheck_limits`)."""
        self.topics.recheck_limits()
        return await self.topics.fail_records_of_deleted()

    def record_limit(self, topic: str) -> int:
        """The largest record for `topic`: `max_record_bytes`, or less where the topic's
        `max.message.bytes` is lower (a client's reply topic; the deployment's own are
        checked at start, workers/kafka/runtime.py). Never waits: the limit was read when
        the topic was looked up (`partition_count`)."""
        limit = self.topics.limits.get(topic)
        return self.max_record_bytes if limit is None else min(self.max_record_bytes, limit - BATCH_OVERHEAD_BYTES)

    def _batch_cap(self, topic: str) -> int | None:
        """The bytes a batch for `topic` may hold where its `max.message.bytes` is below
        the producer's batches (a client's reply topic); None where it is not. The broker
        refuses a batch over the limit whole, and every record in it with it (the others'
        results beside one too large, or a batch of small ones that grew past it)."""
        limit = self.topics.limits.get(topic)
        if limit is None or self._batch_bytes is None or limit - BATCH_OVERHEAD_BYTES >= self._batch_bytes:
            return None
        return max(1, limit - BATCH_OVERHEAD_BYTES)

    def _new_batch(self, topic: str):
        """A producer batch for `topic`, cut at its `_batch_cap`."""
        cap = self._batch_cap(topic)
        if cap is None:
            return self.producer.create_batch()
        return BatchBuilder(cap, self._compression, is_transactional=False)

    async def publish(self, record: Outgoing | DlqCopy) -> asyncio.Future:
        """Hand one record to the producer. Raises TopicUnavailable (quickly) when its
        topic does not exist; the future fails if the broker refuses the record.

        It goes as a publish step's records do (`_publish_groups`): a partition the
        producer has no room for within STUCK_AFTER_S gets a lane, and the caller goes on.
        It went through aiokafka's send(), which waits its request timeout for room, and
        `_enqueue` again, for as long as the partition had no leader: a DLQ copy, an error
        sent in place of a refused record or a reply topic's first result held the
        worker's loop, every partition's records with it (docs/design.md §6)."""
        topic = record.topic
        count = await self.partition_count(topic)
        if not count:
            raise TopicUnavailable(topic)
        partition = record.partition
        if partition is None or partition >= count:  # (a reply topic with fewer partitions)
            partition = self._partition_of(record.key, topic, count)
        futures: list = [None]
        await self._publish_groups({(topic, partition): [0]}, [record], futures, None)
        return futures[0]

    def _partition_of(self, key: str | bytes | None, topic: str, count: int) -> int:
        """Where the producer's partitioner would put a record sent without a partition:
        its key's (murmur2), or with no key one of the partitions with a leader."""
        if key is not None:
            return key_partition(key, count)
        led = self.producer.client.cluster.available_partitions_for_topic(topic)
        return random.choice(sorted(led)) if led else random.randrange(count)

    async def publish_batch(self, records: list[Outgoing],
                            own_topics: Collection[str] | None = None) -> list[asyncio.Future]:
        """Publish many records with one producer batch per partition; a future per record.

        Many single send() calls cost ~3.5x more than batches (BENCHMARKS.md); the generate
        worker publishes every step's chunks this way, the derender its results, a
        client's reply topic's too. Order within a partition is the order of `records`.
        A record's partition past its topic's count (a reply topic with fewer partitions)
        is its key's (`key_partition`); records without one go through publish().

        `own_topics`: the topics where a send that fails at once (the topic vanished, this
        worker may not write to it) raises, as a deployment that is broken; for any other
        (a client's reply topic) the futures of its records fail with it instead, and the
        caller answers them as refused. None: every failure raises.
        """
        futures: list[asyncio.Future | None] = [None] * len(records)
        groups: dict[tuple[str, int], list[int]] = {}
        counts = self.topics.counts  # known topics without an await per record (~1 µs each)
        for i, record in enumerate(records):
            partition, topic = record.partition, record.topic
            count = (counts.get(topic) or await self.partition_count(topic)) if partition is not None else 0
            if count:
                if partition >= count:
                    partition = key_partition(record.key, count)
                group = groups.get((topic, partition))
                if group is None:
                    group = groups[(topic, partition)] = []
                group.append(i)
            else:
                try:
                    futures[i] = await self.publish(record)
                except (TopicUnavailable, KafkaError) as exc:
                    futures[i] = self._failed(topic, own_topics, exc)
        await self._publish_groups(groups, records, futures, own_topics)
        return futures

    async def _publish_groups(self, groups: dict[tuple[str, int], list[int]], records: list, futures: list,
                              own_topics: Collection[str] | None) -> None:
        """`records` in producer batches, per (topic, partition) the indexes of its records
        in order; sets `futures[i]` for each. Partitions the producer has no room for wait
        together, after the others were handed over, then go to lanes (`_send_when_room`)."""
        full: dict[TopicPartition, list[tuple]] = {}  # partitions whose queue the sender has not emptied
        for (topic, partition), indexes in groups.items():
            tp = TopicPartition(topic, partition)
            # (A lane opens only once the queued batch is full, so none can be joined then;
            # the check keeps a lane's records first should that change.)
            if self._open and not (self.lanes and tp in self.lanes):
                indexes = indexes[self._join_queued(tp, records, indexes, futures):]
            batch, members = self._new_batch(topic), []
            for i in indexes:
                record = records[i]
                appended = _append(batch, record)
                if appended is None:  # full: send it and start the next one
                    await self._send_batch(tp, batch, members, futures, full, own_topics)
                    batch, members = self._new_batch(topic), []
                    _append(batch, record)
                members.append(i)
            await self._send_batch(tp, batch, members, futures, full, own_topics)
        if full:
            await asyncio.gather(*(self._send_when_room(tp, batches, futures, own_topics)
                                   for tp, batches in full.items()))

    def _failed(self, topic: str, own_topics: Collection[str] | None, exc: BaseException) -> asyncio.Future:
        """`exc` raised, for one of `own_topics`; else a future failed with it."""
        if own_topics is None or topic in own_topics:
            raise exc
        future = asyncio.get_running_loop().create_future()
        future.set_exception(exc)
        return future

    async def _send_batch(self, tp: TopicPartition, batch, members: list[int], futures: list,
                          full: dict[TopicPartition, list[tuple]], own_topics: Collection[str] | None) -> None:
        """Hand `batch` over now when its partition has room (or a lane, which keeps the
        order); else keep it in `full`, behind the partition's earlier ones, to wait with
        the step's other partitions that have none (`_send_when_room`)."""
        if not members:
            return
        if tp in full or (tp not in self.lanes and self._queued is not None and self._queued.get(tp)):
            full.setdefault(tp, []).append((batch, members))
        else:
            await self._hand_over(tp, batch, members, futures, own_topics)

    async def _send_when_room(self, tp: TopicPartition, batches: list[tuple], futures: list,
                              own_topics: Collection[str] | None) -> None:
        """A partition's batches that found its queue full, in order: each waits for room
        up to STUCK_AFTER_S (aiokafka alone waits its request timeout: lanes.py), then goes
        to the producer, or past that to a lane, as does every one after it. A step's
        partitions wait at the same time, after the ones with room were handed over: a
        step waited for each such partition in turn, and every later partition's tokens
        with it (a broker away that led four of a step's partitions held all of them 4 s)."""
        for batch, members in batches:
            room = tp not in self.lanes and await self._room_for(tp)
            await self._hand_over(tp, batch, members, futures, own_topics, to_lane=not room)

    async def _hand_over(self, tp: TopicPartition, batch, members: list[int], futures: list,
                         own_topics: Collection[str] | None, to_lane: bool = False) -> None:
        if to_lane or tp in self.lanes:
            batch.close()
            future = await self.lanes.add(tp, batch, batch.size())
        else:
            try:
                future = await self._enqueue(tp.topic, tp.partition, lambda: self.producer.send_batch(
                    batch, tp.topic, partition=tp.partition))
            except KafkaError as exc:
                future = self._failed(tp.topic, own_topics, exc)
            queued = self._queued.get(tp) if self._queued is not None else None
            if queued and getattr(queued[-1], "_builder", None) is batch:  # (left open: aiokafka allows it)
                self._open[tp] = (queued[-1], future)
            else:
                batch.close()
        self._track(future, len(members), logged=self._logged_by_caller(tp.topic))
        for i in members:
            futures[i] = future

    def _join_queued(self, tp: TopicPartition, records: list[Outgoing], indexes: list[int], futures: list) -> int:
        """Append records (`indexes` of `records`, in order) to the partition's last batch
        while the sender has not taken it; how many fit. Without this a publish step
        waited for that batch to leave (`_room_for`), and its records for the request
        after it: after a pause of the broker every step waited a produce round trip in
        turn. Joined, they leave with it. A batch the sender took (it is numbered then:
        nothing may be added) is no longer in the partition's queue."""
        message_batch, future = self._open[tp] if tp in self._open else (None, None)
        queued = self._queued.get(tp) if message_batch is not None else None
        if not queued or queued[-1] is not message_batch:
            self._open.pop(tp, None)
            return 0
        builder, joined = message_batch._builder, 0
        for i in indexes:
            if _append(builder, records[i]) is None:  # full (now closed)
                break
            futures[i] = future
            joined += 1
        if joined:
            self._track(future, joined, logged=self._logged_by_caller(tp.topic))
        return joined

    async def _room_for(self, tp: TopicPartition) -> bool:
        """Whether the producer takes a batch for `tp` now, or once the batch it holds for it
        leaves, within STUCK_AFTER_S (aiokafka waits its request timeout: lanes.py)."""
        queued = self._queued.get(tp) if self._queued is not None else None
        if not queued:
            return True
        try:
            await queued[-1].wait_drain(STUCK_AFTER_S)
        except Exception:  # (the batch failed: it left the queue)
            pass
        return not self._queued.get(tp)

    async def _send_in_lane(self, tp: TopicPartition, batch) -> asyncio.Future:
        return await self._enqueue(tp.topic, tp.partition,
                                   lambda: self.producer.send_batch(batch, tp.topic, partition=tp.partition))

    async def to_dlq(self, message, error: str) -> asyncio.Future:
        """Copy a refused record to the DLQ: original key and bytes, source coordinates,
        error; cut to fit the record limit (`dlq_copy`). Whichever way the future ends, the
        record's offset may be released: a copy the broker refuses anyway is logged with
        the record's coordinates, and must not hold its partition's commits for good."""
        self._dlq_log.log("DLQ %s[%d]@%d: %s", message.topic, message.partition, message.offset, error)
        future = await self.publish(DlqCopy(self.dlq_topic, *dlq_copy(message, error, self.max_record_bytes)))
        future.add_done_callback(lambda f: f.cancelled() or f.exception() is None or self._dlq_refused.log(
            "the DLQ refused the copy of %s[%d]@%d (%r): the record is only at its source offset, while the "
            "topic's retention keeps it", message.topic, message.partition, message.offset, f.exception()))
        return future

    async def _enqueue(self, topic: str, partition: int | None,
                       send: Callable[[], Awaitable[asyncio.Future]]) -> asyncio.Future:
        """`send()` (a record or a batch to the producer), waiting as long as the broker is away.

        With the broker away aiokafka retries what it holds until the broker answers, but
        a send that finds a partition's queue still full after its request timeout (30 s:
        clients.py) raises KafkaTimeoutError. Those records were lost: a request's chunks
        had a hole, and the derender failed the request ("seq gap"), or a result never
        reached its client (tested: tests/test_broker_restart.py, the broker away 40 s).
        So the send is tried again (nothing was queued: it raised before), and what waits
        behind it waits too, in order. A partition's batches that wait here past
        STUCK_AFTER_S wait in a lane of their own, and the other partitions go on
        (lanes.py); with the whole broker away, the lanes fill and the engine is held, as
        for any slow publish. Shutdown does not wait for it for long (flush_at_shutdown, and the consumer
        loop's last turn: workers/kafka/loop.py): the work it carries is not committed."""
        started = time.monotonic()
        while True:
            try:
                return await send()
            except KafkaTimeoutError:
                if topic not in self.producer.client.cluster.topics():
                    raise  # no metadata for the topic at all: not a full queue
                if self.stuck or getattr(getattr(self.producer, "_message_accumulator", None), "_exception", None):
                    # Shutdown gave up on the broker (`stop_producer` failed every record):
                    # the producer now raises at once, and the retry spun the event loop
                    # with no await, so the producer's own close never ran (the worker
                    # never exited). Its work is not committed: the next owner redoes it.
                    raise
                log.warning("%s[%s]: no room in the producer's queue for %.0f s (is the broker reachable?); "
                            "still waiting, nothing is dropped", topic, "any" if partition is None else partition,
                            time.monotonic() - started)
                await asyncio.sleep(0)  # (a send that raises at once must not hold the loop)

    def _logged_by_caller(self, topic: str) -> bool:
        """Whether a failure to publish to `topic` is the caller's to log: the DLQ's
        (to_dlq), and with `own_topics` set, any other topic (a reply topic: the derender
        answers it and says so; logged here too, a tenant's topic made ERROR lines, twice)."""
        return topic == self.dlq_topic or (self.own_topics is not None and topic not in self.own_topics)

    def _track(self, future: asyncio.Future, records: int = 1, logged: bool = False) -> None:
        """Counted in flight until `future` ends; a failure is logged here unless `logged`
        (the caller logs it its own way)."""
        self.in_flight += records
        future.add_done_callback(lambda f: self._done(f, records, logged))

    def _done(self, future: asyncio.Future, records: int, logged: bool = False) -> None:
        self.in_flight -= records
        if future.cancelled() or future.exception() is not None:
            self.failed += records
            # (a shutdown that gave up on the broker said so once: flush_at_shutdown)
            if not self.stuck and not (logged and not future.cancelled()):
                log.error("publish failed: %s", "cancelled" if future.cancelled() else future.exception())
        else:
            self.published += records

    async def flush(self) -> None:
        """Every record handed over is acknowledged or failed, those waiting in a lane too:
        a lane's task hands them to the producer first (genpipe replay's end)."""
        self._dlq_log.flush()
        self._dlq_refused.flush()
        while self.lanes:  # (a lane may open while another empties)
            await asyncio.wait(self.lanes.tasks())
        await self.producer.flush()

    async def settle(self, pending: Collection[asyncio.Future], timeout_s: float) -> bool:
        """Wait until the `pending` tasks (still handing records over) are done and every
        record handed over is acknowledged or failed, at most `timeout_s` in all; True when
        all of it was. Cancels nothing: past the time, what waits goes on waiting."""
        deadline = time.monotonic() + timeout_s
        pending = [*pending, *self.lanes.tasks()]  # (a lane's task ends when its last batch is handed over)
        if pending:
            _, late = await asyncio.wait(pending, timeout=timeout_s)
            if late:
                return False
        try:
            await asyncio.wait_for(self.producer.flush(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return False
        return True

    async def flush_at_shutdown(self, pending: Collection[asyncio.Future] = (),
                                timeout_s: float = SHUTDOWN_WAIT_S) -> bool:
        """Shutdown: `settle`. Past the time (the broker away) the pending tasks are
        cancelled, it says so and returns False; so does every later call, at once."""
        self._dlq_log.flush()
        self._dlq_refused.flush()
        if self.stuck:
            return False
        pending = list(pending)
        if not await self.settle(pending, timeout_s):
            for task in [*pending, *self.lanes.tasks()]:  # (a lane's records fail as cancelled)
                task.cancel()
            self.stuck = True
            log.warning("records not acknowledged within %.0f s (is the broker reachable?): stopping without "
                        "them (%d handed over); their work was not committed, the partitions' next owner "
                        "redoes it", timeout_s, self.in_flight)
            return False
        failed = [task.exception() for task in pending if not task.cancelled() and task.exception() is not None]
        if failed:
            log.warning("handing records over failed at shutdown (%r): that work was not committed, the "
                        "partitions' next owner redoes it", failed[0])
        return not failed


def _append(batch, record: Outgoing | DlqCopy):
    """`record` into a producer batch; None when the batch is full."""
    return batch.append(key=record.kafka_key(), value=record.kafka_value(), timestamp=None,
                        headers=record.kafka_headers())
