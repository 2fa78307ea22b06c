"""Which offset of a partition is safe to commit.

A worker holds the offsets of work it has not finished (a request whose final chunk is
not acknowledged; a request whose results are not all published). The committable
offset is the lowest held one, or the next unread offset when nothing is held: a new
owner of the partition re-reads everything that was not finished, and nothing is lost.
"""

from __future__ import annotations

import heapq


class OffsetTracker:
    __slots__ = ("next_offset", "_held", "_heap")

    def __init__(self, next_offset: int | None = None):
        self.next_offset = next_offset  # one past the last record read; None: nothing read yet
        self._held: dict[int, int] = {}  # offset -> hold count
        self._heap: list[int] = []  # lazy min-heap over held offsets

    def seen(self, offset: int) -> None:
        if self.next_offset is None or offset + 1 > self.next_offset:
            self.next_offset = offset + 1

    def hold(self, offset: int) -> None:
        count = self._held.get(offset, 0)
        self._held[offset] = count + 1
        if count == 0:
            heapq.heappush(self._heap, offset)

    def release(self, offset: int) -> None:
        count = self._held.get(offset, 0)
        if count <= 1:
            self._held.pop(offset, None)
        else:
            self._held[offset] = count - 1

    def is_held(self, offset: int) -> bool:
        return offset in self._held

    @property
    def held(self) -> int:
        return len(self._held)

    def committable(self) -> int | None:
        """The offset to commit (the next record a new owner should read), or None."""
        while self._heap and self._heap[0] not in self._held:
            heapq.heappop(self._heap)  # drop released offsets lazily
        if self._heap:
            return self._heap[0]
        return self.next_offset
