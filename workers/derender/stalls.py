"""Requests whose chunks stopped coming (docs/design.md §5.5).

The derender commits a partition no further than the first chunk of its oldest open
request, so a request whose final chunk never comes (generate's error chunk refused too,
a seq 0 written by another producer, chunks lost with a broker) pinned that commit for
good: every restart replayed the partition from there, and its state stayed. Here such a
request is found so the worker can end it with an error result and a cancel.

Time is the partition's *busy log time*, read from its records' timestamps, not the
worker's clock: it moves when a record newer than every one before it is read, by the
difference, but by at most `max_gap_ms` (a tenth of the timeout, at most a minute) for
one record. So what ages a request is other requests' chunks going on past it: a worker
stopped or a backlog read after a restart ages nothing, and a broker away for an hour, a
generate fleet paused or a quiet partition age it by one gap. A record older than the
newest read moves nothing. A request is stalled once the partition's busy log time is
more than the timeout past where it was when the request's last chunk was read.
`genpipe replay` reads the same records, so it ends the same requests at the same chunks
as long as the timestamps rise with the log (the newest before a replay's first record is
not known to it). The chunks topic keeps the broker's append time for that
(workers/broker/topics.py `CHUNKS_TOPIC_CONFIGS`); with the producers' own, one record
dated ahead (up to the hour Kafka 4 lets through) would hold the check off on its
partition until the clocks got there.
"""

from __future__ import annotations

from typing import Hashable, Sequence

DEFAULT_STALLED_REQUEST_S = 1800.0
MAX_GAP_S = 60.0
_NEVER = float("inf")
_NONE: tuple[str, ...] = ()


class StalledRequests:
    """Per partition: the newest timestamp read, the busy log time, and each open
    request's busy log time at its last chunk. The marks are not kept in order (a chunk
    overwrites its request's in place): the partition's `due`, a lower bound of the
    oldest mark + the timeout, says when to look at them all, so every request is found
    at the first chunk that carries the time past its own limit, and a look costs one
    pass over the partition's open requests about once a timeout."""

    __slots__ = ("timeout_ms", "max_gap_ms", "_clocks")

    def __init__(self, timeout_s: float = DEFAULT_STALLED_REQUEST_S):
        self.timeout_ms = timeout_s * 1000.0
        self.max_gap_ms = min(MAX_GAP_S * 1000.0, self.timeout_ms / 10)
        # partition -> [newest timestamp ms (-1: none yet), busy log time ms,
        #               {request id: busy log time at its last chunk}, due]
        self._clocks: dict[Hashable, list] = {}

    def chunk(self, partition: Hashable, request_id: str, timestamp_ms: int, open_: bool) -> Sequence[str]:
        """A chunk of `request_id` was read on `partition` (its record's timestamp, ms; -1
        for none) and processed; `open_`: the request is still running. The ids of the
        partition's other requests that are stalled now, in the order they started (they
        are forgotten here: end them). Called for every chunk: a few dict operations when
        nothing is due."""
        clock = self._clocks.get(partition)
        if clock is None:
            clock = self._clocks[partition] = [timestamp_ms, 0.0, {}, _NEVER]
        elif timestamp_ms > clock[0]:
            if clock[0] >= 0:
                gap = timestamp_ms - clock[0]
                clock[1] += gap if gap < self.max_gap_ms else self.max_gap_ms
            clock[0] = timestamp_ms
        _, now, marks, due = clock
        if open_:
            marks[request_id] = now
            if due == _NEVER:
                clock[3] = now + self.timeout_ms
        elif marks:
            marks.pop(request_id, None)
        # `due` may be early (the oldest request had a chunk since, or finished), never
        # late: a mark only ever moves later.
        return _NONE if now <= due else self._stalled(clock)

    def _stalled(self, clock: list) -> list[str]:
        _, now, marks, _ = clock
        limit = now - self.timeout_ms
        stalled = [rid for rid, mark in marks.items() if mark < limit]
        for rid in stalled:
            del marks[rid]
        clock[3] = min(marks.values()) + self.timeout_ms if marks else _NEVER
        return stalled

    def forget(self, partition: Hashable) -> None:
        """The partition was revoked: its next owner replays its open requests."""
        self._clocks.pop(partition, None)

    def open_requests(self, partition: Hashable) -> int:
        clock = self._clocks.get(partition)
        return len(clock[2]) if clock is not None else 0
