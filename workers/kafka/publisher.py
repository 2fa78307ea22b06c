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


class Publisher:
    def __init__(self, producer: AIOKafkaProducer, dlq_topic: str):
        self.producer = producer
        self.dlq_topic = dlq_topic
        self.in_flight = 0
        self.published = 0
        self.failed = 0
        self._partitions: dict[str, int] = {}

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

    async def to_dlq(self, message, error: str) -> asyncio.Future:
        """Copy a refused record to the DLQ: original key and bytes, source coordinates, error."""
        log.warning("DLQ %s[%d]@%d: %s", message.topic, message.partition, message.offset, error)
        future = await self.producer.send(
            self.dlq_topic, message.value, key=message.key, headers=dlq_headers(message, error))
        self._track(future)
        return future

    def _track(self, future: asyncio.Future) -> None:
        self.in_flight += 1
        future.add_done_callback(self._done)

    def _done(self, future: asyncio.Future) -> None:
        self.in_flight -= 1
        if future.cancelled() or future.exception() is not None:
            self.failed += 1
            log.error("publish failed: %s", "cancelled" if future.cancelled() else future.exception())
        else:
            self.published += 1

    async def flush(self) -> None:
        await self.producer.flush()
