"""Partitions the producer cannot send to, queued on their own (docs/design.md §6).

aiokafka keeps one queued batch per partition: a send to a partition whose batch its
sender has not taken yet waits for it, up to the producer's request timeout, and the
publisher tries again for as long as it takes (workers/kafka/publisher.py `_enqueue`). A
generate worker's publish step hands its partitions' batches over in turn, so one
partition without a leader held the step, every later step, every partition's requests
and the engine with them, until its broker came back (tests/test_cluster.py). Now a
batch waits at most `STUCK_AFTER_S` for its partition's queue; past that the partition
gets a lane: its batches wait here, in order, and the lane's own task hands them to the
producer as the partition takes them, while the other partitions go on. What follows
for that partition joins the lane until the lane is empty. Lanes hold at most
`max_bytes` in all (32 MiB, as Java's producer buffers): past that a send waits, as every
send did before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Awaitable, Callable

from aiokafka import TopicPartition

log = logging.getLogger(__name__)

STUCK_AFTER_S = 1.0  # a produce round trip is milliseconds; a partition this slow has no leader, or a broker away
MAX_LANE_BYTES = 32 << 20  # in all lanes (Java's producer: buffer.memory); then sends wait, as before lanes
_WARN_EVERY_S = 60.0

Send = Callable[[TopicPartition, object], Awaitable[asyncio.Future]]


class Lanes:
    def __init__(self, send: Send, max_bytes: int = MAX_LANE_BYTES):
        self._send = send  # hands a closed batch to the producer: the producer's future for it
        self.max_bytes = max_bytes
        self.bytes = 0  # waiting in lanes
        self._lanes: dict[TopicPartition, deque] = {}
        self._tasks: dict[TopicPartition, asyncio.Task] = {}
        self._room = asyncio.Event()
        self._room.set()
        self._warned: dict[TopicPartition, float] = {}

    def __contains__(self, tp: TopicPartition) -> bool:
        return tp in self._lanes

    def __bool__(self) -> bool:
        return bool(self._lanes)

    def tasks(self) -> list[asyncio.Task]:
        return list(self._tasks.values())

    async def add(self, tp: TopicPartition, batch, size: int) -> asyncio.Future:
        """Queue `batch` (closed, `size` bytes) behind what waits for `tp`; a future that
        ends as the producer's future for it will (cancelled if shutdown drops it)."""
        while self.bytes >= self.max_bytes:
            self._room.clear()
            await self._room.wait()
        future = asyncio.get_running_loop().create_future()
        lane = self._lanes.get(tp)
        if lane is None:
            lane = self._lanes[tp] = deque()
            now = time.monotonic()
            task = self._tasks[tp] = asyncio.ensure_future(self._run(tp, lane, now))
            task.add_done_callback(lambda t, tp=tp, lane=lane: self._closed(tp, lane, t))
            if now - self._warned.get(tp, -_WARN_EVERY_S) >= _WARN_EVERY_S:
                self._warned[tp] = now
                log.warning("%s[%d]: the producer has not taken a batch for %.0f s (no leader? a broker away?): "
                            "its records wait in order on their own, the other partitions go on",
                            tp.topic, tp.partition, STUCK_AFTER_S)
        lane.append((batch, size, future))
        self.bytes += size
        return future

    async def _run(self, tp: TopicPartition, lane: deque, opened: float) -> None:
        while lane:
            batch, size, future = lane[0]
            try:
                sent = await self._send(tp, batch)
            except Exception as exc:  # (the topic is gone: what waits behind it fails alike)
                for _, size, waiting in lane:
                    if not waiting.done():
                        waiting.set_exception(exc)
                    self._taken(size)
                lane.clear()
                break
            lane.popleft()
            self._taken(size)
            _follow(sent, future)
        del self._lanes[tp], self._tasks[tp]  # (at once: a record added later opens a new lane)
        log.info("%s[%d]: the producer takes its records again (%.1f s on their own)", tp.topic, tp.partition,
                 time.monotonic() - opened)

    def _closed(self, tp: TopicPartition, lane: deque, task: asyncio.Task) -> None:
        """A lane's task ended: cancelled (shutdown), perhaps before it ran, what it had not
        handed over is cancelled too."""
        if self._tasks.get(tp) is not task:
            return  # it closed itself, empty
        for _, size, waiting in lane:
            waiting.cancel()
            self._taken(size)
        lane.clear()
        del self._lanes[tp], self._tasks[tp]

    def _taken(self, size: int) -> None:
        self.bytes -= size
        if self.bytes < self.max_bytes:
            self._room.set()


def _follow(source: asyncio.Future, target: asyncio.Future) -> None:
    """`target` ends as `source` does."""
    def done(f: asyncio.Future) -> None:
        if target.done():
            return
        if f.cancelled():
            target.cancel()
        elif f.exception() is not None:
            target.set_exception(f.exception())
        else:
            target.set_result(f.result())
    source.add_done_callback(done)
