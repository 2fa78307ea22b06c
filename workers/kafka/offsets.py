"""Which offset of a partition is safe to commit.

A worker holds the offsets of work it has not finished (a request whose final chunk is
not acknowledged; a request whose results are not all published). The committable
offset is the lowest held one, or the next unread offset when nothing is held: a new
owner of the partition re-reads everything that was not finished, and nothing is lost.
"""

from __future__ import annotations

import asyncio
import heapq
from typing import Callable

from aiokafka import TopicPartition

Release = Callable[[], None]


class OffsetTracker:
    __slots__ = ("next_offset", "handling", "_held", "_heap")

    def __init__(self, next_offset: int | None = None):
        self.next_offset = next_offset  # one past the last record read; None: nothing read yet
        # The record the handler is on: not committable while its handling waits (a
        # metadata lookup, a publish) before it holds what it must; a commit in between
        # (the periodic one, a revoke's) passed it, and its work was lost.
        self.handling: int | None = None
        self._held: dict[int, int] = {}  # offset -> hold count
        self._heap: list[int] = []  # lazy min-heap over held offsets

    def seen(self, offset: int) -> None:
        if self.next_offset is None or offset + 1 > self.next_offset:
            self.next_offset = offset + 1

    def hold(self, offset: int) -> None:
        count = self._held.get(offset, 0)
        self._held[offset] = count + 1
        if count == 0:
            heap = self._heap
            heapq.heappush(heap, offset)
            if len(heap) > 2 * len(self._held) + 1024:
                # Released offsets leave the heap only from its top: under one hold that
                # stays (a result waiting for its partition's leader), every later offset
                # stayed too (1M records: 1M entries, ~40 MB). Rebuilt, it holds the held.
                self._heap = sorted(self._held)

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
        low = self._heap[0] if self._heap else self.next_offset
        handling = self.handling
        if handling is not None and (low is None or handling < low):
            return handling
        return low


class PartitionOffsets:
    """The trackers of the partitions a worker owns. Handlers see only `hold(message)`,
    which returns the one call that releases that hold; the consumer loop creates and
    drops trackers as partitions come and go. A release that comes after its partition
    was revoked (and maybe assigned again) is a no-op: it never touches the new tracker."""

    def __init__(self):
        self._trackers: dict[TopicPartition, OffsetTracker] = {}

    def hold(self, message) -> Release:
        tp = TopicPartition(message.topic, message.partition)
        tracker = self._trackers.get(tp)
        if tracker is None:
            # Revoked while its handler waited: a tracker made here would be committed with
            # the partitions this worker owns, and the broker refuses the whole commit for
            # one it does not (every commit of the worker failed from then on). Its new
            # owner does the work again.
            return _no_release
        offset = message.offset
        tracker.hold(offset)

        def release() -> None:
            if self._trackers.get(tp) is tracker:
                tracker.release(offset)
        return release

    # --- the consumer loop's side ---------------------------------------------------------

    def tracker(self, tp: TopicPartition) -> OffsetTracker:
        tracker = self._trackers.get(tp)
        if tracker is None:
            tracker = self._trackers[tp] = OffsetTracker()
        return tracker

    def get(self, tp: TopicPartition) -> OffsetTracker | None:
        return self._trackers.get(tp)

    def reset(self, tp: TopicPartition) -> None:
        self._trackers[tp] = OffsetTracker()

    def drop(self, tp: TopicPartition) -> None:
        self._trackers.pop(tp, None)

    def partitions(self) -> list[TopicPartition]:
        return list(self._trackers)

    def items(self):
        return self._trackers.items()


def _no_release() -> None:
    pass


def release_when_settled(future: asyncio.Future, release: Release) -> None:
    """Release once the broker answered, acknowledged or refused for good: for a DLQ copy,
    whose refusal is logged (`Publisher.to_dlq`), or an error chunk sent in place of refused
    ones: neither may hold the partition's commits for good. Not when cancelled (shutdown):
    the partition's next owner does it again."""
    def done(f: asyncio.Future) -> None:
        if not f.cancelled():
            release()
    future.add_done_callback(done)


# --- work finished beyond the committed offset ---------------------------------------------
#
# A worker that finishes requests out of order (the generate worker admits by priority)
# can commit only up to its lowest unfinished offset; everything it finished beyond that
# would run again on the partition's next owner. So the commit carries, in its metadata,
# how far the worker had read and which offsets in between were still unfinished, as the
# parallel consumers do; the next owner skips the rest. Kafka keeps at most
# `offset.metadata.max.bytes` (4096 by default) per commit, so the list is cut to fit:
# a cut list only makes the next owner redo more, never skip what did not finish.

FINISHED_PREFIX = "gp-done:"
MAX_METADATA_CHARS = 3000


def encode_finished(tracker: OffsetTracker, limit: int = MAX_METADATA_CHARS) -> str:
    """`gp-done:<span>:<unfinished, delta-coded base36>` relative to the committable offset:
    every offset in [committable, committable+span) not listed finished. "" when there is
    nothing beyond the committable offset."""
    start = tracker.committable()
    if start is None or tracker.next_offset is None or tracker.next_offset <= start:
        return ""
    held = sorted({o for o in tracker._held if o >= start} |
                  ({tracker.handling} if tracker.handling is not None and tracker.handling >= start else set()))
    end = tracker.next_offset
    parts, previous, length = [], start, len(FINISHED_PREFIX) + 12
    for i, offset in enumerate(held):
        piece = _b36(offset - previous)
        if length + len(piece) + 1 > limit:
            end = offset  # what lies beyond this one is simply not reported
            break
        parts.append(piece)
        length += len(piece) + 1
        previous = offset
    if end <= start:
        return ""
    return f"{FINISHED_PREFIX}{_b36(end - start)}:{','.join(parts)}"


class FinishedAhead:
    """The reading side: which offsets of [start, end) the previous owner finished."""

    __slots__ = ("start", "end", "unfinished")

    def __init__(self, start: int = 0, end: int = 0, unfinished: frozenset[int] = frozenset()):
        self.start, self.end, self.unfinished = start, end, unfinished

    def __len__(self) -> int:
        return max(0, self.end - self.start - len(self.unfinished))

    def finished(self, offset: int) -> bool:
        return self.start <= offset < self.end and offset not in self.unfinished


def decode_finished(committed: int | None, metadata: str | None) -> FinishedAhead:
    """Anything unreadable (another worker kind's metadata, a damaged string) means
    nothing is known to be finished: the next owner redoes it, loses nothing."""
    if committed is None or not metadata or not metadata.startswith(FINISHED_PREFIX):
        return FinishedAhead()
    try:
        span_text, _, listed = metadata[len(FINISHED_PREFIX):].partition(":")
        span = int(span_text, 36)
        unfinished, offset = set(), committed
        for piece in filter(None, listed.split(",")):
            offset += int(piece, 36)
            unfinished.add(offset)
    except ValueError:
        return FinishedAhead()
    if span < 0 or any(o < committed for o in unfinished):
        return FinishedAhead()
    return FinishedAhead(committed, committed + span, frozenset(unfinished))


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out
