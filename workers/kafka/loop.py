"""The consume → process → produce → commit loop, written once for every worker.

A worker supplies a `Handler` with its logic; this module owns the consumer group, the
rebalance listener, per-partition offset trackers, periodic commits (with the handler's
commit metadata), backpressure (pause/resume), and the shutdown sequence. Offsets are
committed only as far as the trackers allow, so a crash or a rebalance re-delivers what
was not finished and loses nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import OffsetAndMetadata

from workers.kafka.clients import make_admin, make_consumer
from workers.kafka.offsets import PartitionOffsets
from workers.kafka.settings import KafkaSettings
from workers.metrics import update_lag

log = logging.getLogger(__name__)


class Handler:
    """A worker's logic. `handle` is the one hook every worker writes; the others default
    to doing nothing. A handler holds a record's offset with `offsets.hold(message)` (the
    `PartitionOffsets` it was built with) and calls the returned release once the work is
    safely published: the loop commits no further than the lowest held offset."""

    async def handle(self, message) -> None:
        """One consumed record, in partition order."""
        raise NotImplementedError

    async def on_assigned(self, partitions: list[TopicPartition], metadata: dict[TopicPartition, str]) -> None:
        """New partitions; `metadata` is what was committed with their offsets."""

    async def on_revoked(self, partitions: list[TopicPartition]) -> None:
        """Stop the work of these partitions: their new owner will redo it."""

    async def tick(self) -> None:
        """Called every loop turn (timers: coalescing delays, deadlines)."""

    def wants_pause(self) -> bool:
        """True while the worker is full: the loop pauses its partitions."""
        return False

    def commit_metadata(self, tp: TopicPartition) -> str:
        """Stored with each commit of `tp` (e.g. how far results were published)."""
        return ""

    async def drain(self, deadline: float) -> None:
        """Shutdown: finish what can finish before `deadline` (monotonic seconds)."""


class ConsumerLoop:
    def __init__(self, settings: KafkaSettings, topic: str, group_id: str, handler: Handler,
                 offsets: PartitionOffsets, *,
                 commit_interval_s: float = 0.5, poll_timeout_ms: int = 20, max_records: int = 500,
                 group_instance_id: str | None = None, consumer_overrides: dict | None = None,
                 worker: str = "worker"):
        self.settings = settings
        self.worker = worker  # metrics label
        self.topic = topic
        self.group_id = group_id
        self.handler = handler
        self.commit_interval_s = commit_interval_s
        self.poll_timeout_ms = poll_timeout_ms
        self.max_records = max_records
        self.offsets = offsets  # shared with the handler, which holds offsets through it
        self._committed: dict[TopicPartition, tuple[int, str]] = {}
        self._paused = False
        # Partitions whose assignment callback has completed. aiokafka may hand out
        # records of a new partition while the callback is still awaiting (reading the
        # commit metadata); those are re-fetched once the handler knows the partition.
        self._ready: set[TopicPartition] = set()
        overrides = dict(consumer_overrides or {})
        if group_instance_id:
            overrides["group_instance_id"] = group_instance_id  # static membership: no rebalance on quick restart
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

    async def _committed_metadata(self, partitions: list[TopicPartition]) -> dict[TopicPartition, str]:
        # consumer.committed() drops the metadata string; the admin client returns it.
        admin = make_admin(self.settings.with_client_id(f"{self.settings.client_id}-admin"))
        try:
            await admin.start()
            result = await admin.list_consumer_group_offsets(self.group_id, partitions=partitions)
            return {tp: (om.metadata or "") for tp, om in result.items() if om is not None and om.offset >= 0}
        except KafkaError as exc:
            log.warning("could not read committed metadata: %s", exc)
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
                log.info("partitions revoked: %s", sorted(tp.partition for tp in revoked))
                await loop.handler.on_revoked(revoked)
                await loop.commit(revoked)
                for tp in revoked:
                    loop.offsets.drop(tp)
                    loop._committed.pop(tp, None)
                    loop._ready.discard(tp)

            async def on_partitions_assigned(self, assigned):
                assigned = list(assigned)
                log.info("partitions assigned: %s", sorted(tp.partition for tp in assigned))
                metadata = await loop._committed_metadata(assigned) if assigned else {}
                for tp in assigned:
                    loop.offsets.reset(tp)
                await loop.handler.on_assigned(assigned, metadata)
                loop._ready.update(assigned)
                if loop._paused and assigned:
                    loop.consumer.pause(*assigned)
                loop.ready.set()

        return Listener()

    # --- the loop -------------------------------------------------------------------

    def _apply_backpressure(self) -> None:
        want = self.handler.wants_pause()
        if want and not self._paused:
            self.consumer.pause(*self.consumer.assignment())
            self._paused = True
        elif not want and self._paused:
            self.consumer.resume(*self.consumer.assignment())
            self._paused = False

    async def run(self, stop: asyncio.Event, grace_s: float = 30.0) -> None:
        await self.consumer.start()
        self.consumer.subscribe([self.topic], listener=self._listener())
        last_commit = time.monotonic()
        try:
            while not stop.is_set():
                batch = await self.consumer.getmany(timeout_ms=self.poll_timeout_ms, max_records=self.max_records)
                for tp, messages in batch.items():
                    if tp not in self._ready:
                        self.consumer.seek(tp, messages[0].offset)
                        continue
                    tracker = self.offsets.tracker(tp)
                    for message in messages:
                        tracker.seen(message.offset)
                        await self.handler.handle(message)
                await self.handler.tick()
                update_lag(self.consumer, self.offsets, self.worker)
                self._apply_backpressure()
                if time.monotonic() - last_commit >= self.commit_interval_s:
                    await self.commit()
                    last_commit = time.monotonic()
            # Shutdown: take nothing new, let in-flight work finish, commit what finished.
            self.consumer.pause(*self.consumer.assignment())
            await self.handler.drain(time.monotonic() + grace_s)
            await self.commit()
        finally:
            await self.consumer.stop()
