"""Publishing records and knowing when the broker has them.

`publish()` returns a future that resolves when the broker acknowledged the record;
workers release an offset only then (SPEC §4: commit only past acknowledged work).
`in_flight` counts unacknowledged records: the generate worker coalesces tokens while
it is high (the producer lags), and streams token by token while it is low.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaProducer

from workers.kafka.records import Outgoing, dlq_headers

log = logging.getLogger(__name__)

# The largest record a worker publishes (value, key and headers). Kafka's defaults refuse
# a record batch over ~1 MiB (broker message.max.bytes, producer max.request.size); this
# leaves room for the batch's own framing. A record over it would be refused by the
# broker after the work was done, and its request would never finish: workers check
# `fits()` first and publish something smaller (a cut chunk, an error) instead.
MAX_RECORD_BYTES = 1_000_000


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
        self._partitions: dict[str, int] = {}

    def fits(self, record: Outgoing) -> bool:
        return record.size() <= self.max_record_bytes

    async def partition_count(self, topic: str) -> int:
        count = self._partitions.get(topic)
        if count is None:
            partitions = await self.producer.partitions_for(topic)
            count = len(partitions or ())
            self._partitions[topic] = count
        return count

    async def publish(self, record: Outgoing) -> asyncio.Future:
        partition = record.partition
        if partition is not None and partition >= await self.partition_count(record.topic):
            partition = None  # a reply topic with fewer partitions: fall back to key hashing
        future = await self.producer.send(
            record.topic, record.kafka_value(), key=record.key.encode(),
            headers=record.kafka_headers(), partition=partition)
        self._track(future)
        return future

    async def publish_batch(self, records: list[Outgoing]) -> list[asyncio.Future]:
        """Publish many records with one producer batch per partition; a future per record.

        Many single send() calls cost ~3.5x more than batches (NOTES.md); the generate
        worker publishes every step's chunks this way. Order within a partition is the
        order of `records`. Records without a partition go through publish().
        """
        futures: list[asyncio.Future | None] = [None] * len(records)
        groups: dict[tuple[str, int], list[int]] = {}
        for i, record in enumerate(records):
            partition = record.partition
            if partition is not None and partition < await self.partition_count(record.topic):
                groups.setdefault((record.topic, partition), []).append(i)
            else:
                futures[i] = await self.publish(record)
        for (topic, partition), indexes in groups.items():
            batch, members = self.producer.create_batch(), []
            for i in indexes:
                record = records[i]
                appended = batch.append(key=record.key.encode(), value=record.kafka_value(),
                                        timestamp=None, headers=record.kafka_headers())
                if appended is None:  # full: send it and start the next one
                    await self._send_batch(batch, topic, partition, members, futures)
                    batch, members = self.producer.create_batch(), []
                    batch.append(key=record.key.encode(), value=record.kafka_value(),
                                 timestamp=None, headers=record.kafka_headers())
                members.append(i)
            await self._send_batch(batch, topic, partition, members, futures)
        return futures

    async def _send_batch(self, batch, topic: str, partition: int, members: list[int], futures: list) -> None:
        if not members:
            return
        batch.close()
        future = await self.producer.send_batch(batch, topic, partition=partition)
        self.in_flight += len(members) - 1  # _track counts one
        self._track(future, len(members))
        for i in members:
            futures[i] = future

    async def to_dlq(self, message, error: str) -> asyncio.Future:
        """Copy a refused record to the DLQ: original key and bytes, source coordinates, error."""
        log.warning("DLQ %s[%d]@%d: %s", message.topic, message.partition, message.offset, error)
        future = await self.producer.send(
            self.dlq_topic, message.value, key=message.key, headers=dlq_headers(message, error))
        self._track(future)
        return future

    def _track(self, future: asyncio.Future, records: int = 1) -> None:
        self.in_flight += 1
        future.add_done_callback(lambda f: self._done(f, records))

    def _done(self, future: asyncio.Future, records: int) -> None:
        self.in_flight -= records
        if future.cancelled() or future.exception() is not None:
            self.failed += records
            log.error("publish failed: %s", "cancelled" if future.cancelled() else future.exception())
        else:
            self.published += records

    async def flush(self) -> None:
        await self.producer.flush()
