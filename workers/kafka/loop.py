"""The consume → process → produce → commit loop, written once for every worker.

A worker supplies a `Handler` with its logic; this module owns the consumer group, the
rebalance listener, per-partition offset trackers, periodic commits (with the handler's
commit metadata), backpressure (pause/resume, per topic), and the shutdown sequence.
Offsets are committed only as far as the trackers allow, so a crash or a rebalance
re-delivers what was not finished and loses nothing.

Rebalances (docs/design.md §7). aiokafka's protocol is eager: every rebalance revokes
every partition of every member. A handler with `keeps_work = True` (the generate
worker) keeps its work through that: on revoke the loop commits but keeps the trackers;
on assignment, partitions that came back in the very next generation (nobody else can
have owned them in between) continue where they were, read on from where this worker
had read, and only the partitions that really moved are given to `on_lost`. With the
sticky assignor (workers/kafka/assignor.py) few partitions move.
"""

from __future__ import annotations

import asyncio
import logging
import time
from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import OffsetAndMetadata

from workers.kafka.assignor import StickyAssignor
from workers.kafka.clients import make_admin, make_consumer, wait_at_most
from workers.kafka.offsets import PartitionOffsets
from workers.kafka.settings import KafkaSettings
from workers.metrics import REBALANCES, series, update_lag

log = logging.getLogger(__name__)

COMMITTED_WAIT_S = 10.0  # `_committed_offsets`: a third of the session timeout (30 s)


class Handler:
    """A worker's logic. `handle` is the one hook every worker writes; the others default
    to doing nothing. A handler holds a record's offset with `offsets.hold(message)` (the
    `PartitionOffsets` it was built with) and calls the returned release once the work is
    safely published: the loop commits no further than the lowest held offset."""

    keeps_work = False  # True: work of partitions that come back after a rebalance goes on

    async def handle(self, message) -> None:
        """One consumed record, in partition order."""
        raise NotImplementedError

    async def on_assigned(self, partitions: list[TopicPartition],
                          committed: dict[TopicPartition, OffsetAndMetadata]) -> None:
        """New partitions; `committed`: their committed offsets, with the metadata stored
        with them (absent for a partition never committed)."""

    async def on_revoked(self, partitions: list[TopicPartition]) -> None:
        """A rebalance takes these partitions. Without `keeps_work`: stop their work
        (their new owner redoes it). With it: they may come back; `on_lost` says which
        did not."""

    async def on_lost(self, partitions: list[TopicPartition]) -> None:
        """Partitions that were revoked and did not come back (with `keeps_work`; without
        it, or with the round-robin assignor, every revoked one, right after `on_revoked`):
        stop their work, their new owner redoes it."""

    async def tick(self) -> None:
        """Called every loop turn (timers: coalescing delays, deadlines)."""

    def wants_pause(self, topic: str) -> bool:
        """True while the worker wants no more of `topic`: the loop pauses its partitions."""
        return False

    def commit_metadata(self, tp: TopicPartition) -> str:
        """Stored with each commit of `tp` (e.g. how far results were published)."""
        return ""

    async def drain(self, deadline: float) -> None:
        """Shutdown: finish what can finish before `deadline` (monotonic seconds)."""


class ConsumerLoop:
    def __init__(self, settings: KafkaSettings, topics: str | list[str], group_id: str, handler: Handler,
                 offsets: PartitionOffsets, *,
                 commit_interval_s: float = 0.5, poll_timeout_ms: int = 20, max_records: int = 500,
                 group_instance_id: str | None = None, consumer_overrides: dict | None = None,
                 worker: str = "worker", assignor: str = "sticky", shutdown_wait_s: float = 10.0,
                 slice_s: float = 0.001):
        self.settings = settings
        # Shutdown: how long the loop's last turn, the last commit and the consumer's stop
        # may take each (all wait on the broker: _stop_turn, _final_commit, _stop_consumer).
        self.shutdown_wait_s = shutdown_wait_s
        self.worker = worker  # metrics label
        self.topics = [topics] if isinstance(topics, str) else list(topics)
        self.group_id = group_id
        self.handler = handler
        self.commit_interval_s = commit_interval_s
        self.poll_timeout_ms = poll_timeout_ms
        self.max_records = max_records
        # A poll's records are handled in slices of about this long, the event loop's other
        # work running between them. In one go, a poll of 256 new requests held the
        # generate worker's loop for 5-20 ms, and every engine step and producer ack
        # waited behind it (BENCHMARKS.md, "A poll's records in slices").
        self.slice_s = slice_s
        self.offsets = offsets  # shared with the handler, which holds offsets through it
        self._committed: dict[TopicPartition, tuple[int, str]] = {}
        # The periodic commit runs beside the loop: awaited in line it stopped the loop for
        # a broker round trip every commit_interval_s, and a record arriving then waited
        # (the low-load latency tail, BENCHMARKS.md). At most one is in flight; a revoke
        # and shutdown wait for it before their own commit, so an older commit never lands
        # after a newer one.
        self._commit_task: asyncio.Task | None = None
        self._paused: set[str] = set()  # topics paused for backpressure
        self._revoked_at: int | None = None  # generation whose partitions were revoked, kept
        # Partitions whose assignment callback has completed. aiokafka may hand out
        # records of a new partition while the callback is still awaiting (reading the
        # commit metadata); those are re-fetched once the handler knows the partition.
        self._ready: set[TopicPartition] = set()
        self._revokes = 0  # rebalances that took partitions: a poll's records stop at one
        overrides = dict(consumer_overrides or {})
        if group_instance_id:
            overrides["group_instance_id"] = group_instance_id  # static membership: no rebalance on quick restart
        # "roundrobin": aiokafka's default, and nothing kept across a rebalance (what every
        # worker did before the sticky assignor; the fleet benchmark's reference).
        self.assignor = StickyAssignor() if assignor == "sticky" else None
        self.keep_work = handler.keeps_work and self.assignor is not None
        if self.assignor is not None:
            overrides.setdefault("partition_assignment_strategy", (self.assignor,))
        self.consumer = make_consumer(settings, group_id=group_id, **overrides)
        self.ready = asyncio.Event()  # set once partitions are assigned the first time

    # --- offsets ------------------------------------------------------------------

    async def commit(self, partitions: list[TopicPartition] | None = None) -> None:
        offsets = {}
        for tp in partitions if partitions is not None else self.offsets.partitions():
            tracker = self.offsets.get(tp)
            if tracker is None:
                continue
            offset = tracker.committable()
            if offset is None:
                continue
            metadata = self.handler.commit_metadata(tp)
            if self._committed.get(tp) == (offset, metadata):
                continue  # nothing new: spare the broker
            offsets[tp] = OffsetAndMetadata(offset, metadata)
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
        except (CommitFailedError, KafkaError) as exc:
            # A rebalance took the partitions; their new owner re-reads from the last commit.
            log.warning("commit failed (%s); the partitions' next owner re-reads from the last commit", exc)
            return
        for tp, om in offsets.items():
            self._committed[tp] = (om.offset, om.metadata)

    async def _final_commit(self) -> None:
        """The shutdown commit, bounded: aiokafka retries a commit until the group
        coordinator answers, so with the broker gone a worker told to stop never did
        (measured: both workers still up 150 s after SIGTERM). Past the bound it stops
        without it; the partitions' next owner re-reads from the last commit, which
        loses nothing (docs/design.md §6)."""
        await wait_at_most(self._commit_all(), self.shutdown_wait_s, "final commit not done",
                           "stopping without it; the partitions' next owner re-reads from the last commit")

    async def _commit_all(self) -> None:
        await self._commit_settled()
        await self.commit()

    def _commit_soon(self) -> None:
        task = self._commit_task
        if task is not None:
            if not task.done():
                return
            task.result()  # an unexpected failure stops the loop, as an awaited commit did
        self._commit_task = asyncio.ensure_future(self.commit())

    async def _commit_settled(self) -> None:
        """Wait for the periodic commit in flight, if any (it never raises: commit logs)."""
        if self._commit_task is not None:
            await self._commit_task
            self._commit_task = None

    async def _committed_offsets(self, partitions: list[TopicPartition]) -> dict[TopicPartition, OffsetAndMetadata]:
        """The committed offsets of newly assigned partitions, with their metadata
        (consumer.committed() drops the string; the admin client returns it). Read inside
        aiokafka's rebalance, while the member's heartbeats are stopped: so bounded, at
        COMMITTED_WAIT_S. A broker that did not answer held it for the admin's 40 s request
        timeout, past the group's 30 s session timeout: the group evicted the member while
        it went on working the partitions. Without it the partitions start without their
        metadata, as when the read fails: work finished beyond the commit may run again
        (the client library drops what it already has)."""
        admin = make_admin(self.settings.with_client_id(f"{self.settings.client_id}-admin"))

        async def read() -> dict[TopicPartition, OffsetAndMetadata]:
            await admin.start()
            result = await admin.list_consumer_group_offsets(self.group_id, partitions=partitions)
            return {tp: OffsetAndMetadata(om.offset, om.metadata or "")
                    for tp, om in result.items() if om is not None and om.offset >= 0}
        try:
            return await asyncio.wait_for(read(), COMMITTED_WAIT_S)
        except (KafkaError, asyncio.TimeoutError) as exc:
            log.warning("could not read the committed offsets' metadata within %.0f s (%s): the partitions start "
                        "without it", COMMITTED_WAIT_S, exc.__class__.__name__ if not str(exc) else exc)
            return {}
        finally:
            await admin.close()

    # --- rebalance ------------------------------------------------------------------

    def _listener(self) -> ConsumerRebalanceListener:
        loop = self

        class Listener(ConsumerRebalanceListener):
            async def on_partitions_revoked(self, revoked):
                revoked = list(revoked)
                if not revoked:
                    return
                loop._revokes += 1  # (before any await: the loop's turn stops at its next record)
                log.info("partitions revoked: %s", _names(revoked))
                await loop.handler.on_revoked(revoked)
                await loop._commit_settled()
                await loop.commit(revoked)
                loop._ready.difference_update(revoked)
                if loop.keep_work:
                    loop._revoked_at = current_generation(loop.consumer)  # trackers stay for now
                    return
                await loop.handler.on_lost(revoked)  # nothing is kept: all of them are lost
                for tp in revoked:
                    loop._forget(tp)

            async def on_partitions_assigned(self, assigned):
                assigned = list(assigned)
                series(REBALANCES, loop.worker).inc()
                generation = current_generation(loop.consumer)
                kept = set()
                if loop._revoked_at is not None:
                    # Kept only when no generation came between: then no one else owned them.
                    if loop._revoked_at >= 0 and generation == loop._revoked_at + 1:
                        kept = {tp for tp in assigned if loop.offsets.get(tp) is not None}
                    lost = [tp for tp in loop.offsets.partitions() if tp not in kept]
                    loop._revoked_at = None
                    if lost:
                        log.info("partitions moved away: %s", _names(lost))
                        await loop.handler.on_lost(lost)
                        for tp in lost:
                            loop._forget(tp)
                new = [tp for tp in assigned if tp not in kept]
                log.info("partitions assigned (generation %d): %s%s", generation, _names(new),
                         f"; kept: {_names(kept)}" if kept else "")
                for tp in kept:  # read on from where this worker was, not from the commit
                    next_offset = loop.offsets.get(tp).next_offset
                    if next_offset is not None:
                        loop.consumer.seek(tp, next_offset)
                committed = await loop._committed_offsets(new) if new else {}
                for tp in new:
                    loop.offsets.reset(tp)
                await loop.handler.on_assigned(new, committed)
                loop._ready.update(assigned)
                paused = [tp for tp in assigned if tp.topic in loop._paused]
                if paused:
                    loop.consumer.pause(*paused)
                loop.ready.set()

        return Listener()

    # --- the loop -------------------------------------------------------------------

    def _forget(self, tp: TopicPartition) -> None:
        self.offsets.drop(tp)
        self._committed.pop(tp, None)
        self._ready.discard(tp)

    def _apply_backpressure(self) -> None:
        for topic in self.topics:
            want = self.handler.wants_pause(topic)
            if want == (topic in self._paused):
                continue
            partitions = [tp for tp in self.consumer.assignment() if tp.topic == topic]
            if want:
                self.consumer.pause(*partitions)
                self._paused.add(topic)
            else:
                self.consumer.resume(*partitions)
                self._paused.discard(topic)

    async def run(self, stop: asyncio.Event, grace_s: float = 30.0) -> None:
        await self.consumer.start()
        if self.assignor is not None:
            self.assignor.coordinator = getattr(self.consumer, "_coordinator", None)
        self.consumer.subscribe(self.topics, listener=self._listener())
        try:
            await self._stop_turn(asyncio.ensure_future(self._consume(stop)), stop)
            # Shutdown: take nothing new, let in-flight work finish, commit what finished.
            self.consumer.pause(*self.consumer.assignment())
            await self.handler.drain(time.monotonic() + grace_s)
            await self._final_commit()
        finally:
            if self._commit_task is not None and not self._commit_task.done():
                self._commit_task.cancel()  # the loop failed: its partitions' next owner re-reads
            await self._stop_consumer()

    async def _stop_consumer(self) -> None:
        """`consumer.stop()`, at most `shutdown_wait_s`: it leaves the group first, and a
        derender whose consumer had lost its group coordinator across a broker restart
        (its last commit timed out too) was still in it 50 s later, until killed (CI,
        tests/test_broker_restart.py). Past the bound the group drops this member after
        its session timeout; its partitions' next owner re-reads from the last commit."""
        await wait_at_most(self.consumer.stop(), self.shutdown_wait_s, "consumer not stopped",
                           "leaving the group to drop this member after its session timeout")

    async def _consume(self, stop: asyncio.Event) -> None:
        last_commit = time.monotonic()
        while not stop.is_set():
            batch = await self.consumer.getmany(timeout_ms=self.poll_timeout_ms, max_records=self.max_records)
            revokes, sliced_at = self._revokes, time.monotonic()
            for tp, messages in batch.items():
                if self._revokes != revokes:
                    break
                if tp not in self._ready:
                    self.consumer.seek(tp, messages[0].offset)
                    continue
                tracker = self.offsets.tracker(tp)
                for message in messages:
                    if time.monotonic() - sliced_at >= self.slice_s:
                        await asyncio.sleep(0)  # the loop's other work runs (see slice_s)
                        sliced_at = time.monotonic()
                    if self._revokes != revokes:
                        # A rebalance began while this turn waited: the rest of the poll is
                        # not handled here. Every partition is read on from where the
                        # assignment puts it (the commit, or this worker's own offset).
                        break
                    tracker.seen(message.offset)
                    tracker.handling = message.offset  # (not committed past while handled)
                    try:
                        await self.handler.handle(message)
                    except asyncio.CancelledError:
                        tracker.hold(message.offset)  # cut short (_stop_turn): never committed past
                        raise
                    finally:
                        tracker.handling = None
            await self.handler.tick()
            update_lag(self.consumer, self.offsets, self.worker)
            self._apply_backpressure()
            if time.monotonic() - last_commit >= self.commit_interval_s:
                self._commit_soon()
                last_commit = time.monotonic()

    async def _stop_turn(self, consuming: asyncio.Task, stop: asyncio.Event) -> None:
        """Wait for the loop (`consuming`) to end, as it does at the first turn after `stop`
        is set, or to fail (raised here). A turn that waits on a broker that is away (the
        producer has no room for a chunk: the worker waits, rather than drop it) would
        never end: past `shutdown_wait_s` after `stop` it is cut short. What it was doing
        is not committed: a record it was handling stays held; the partitions' next owner
        redoes it."""
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([consuming, stopping], return_when=asyncio.FIRST_COMPLETED)
            if not consuming.done():
                await asyncio.wait([consuming], timeout=self.shutdown_wait_s)
            if not consuming.done():
                log.warning("the loop's last turn not done within %.0f s of the stop (is the broker reachable?): "
                            "cutting it short; what it was doing is redone by the partitions' next owner",
                            self.shutdown_wait_s)
                consuming.cancel()
                await asyncio.wait([consuming])
                return
            consuming.result()  # (a failure stops the worker, as before)
        finally:
            stopping.cancel()
            if not consuming.done():  # (run itself cancelled)
                consuming.cancel()


def current_generation(consumer) -> int:
    """The consumer group generation this member is in (-1 when unknown: nothing is kept)."""
    coordinator = getattr(consumer, "_coordinator", None)
    generation = getattr(coordinator, "generation", -1)
    return generation if isinstance(generation, int) else -1


def _names(partitions) -> str:
    return ", ".join(f"{tp.topic}[{tp.partition}]" for tp in sorted(partitions)) or "none"
