"""Requests whose chunks stopped coming (docs/design.md §5.5).

The derender commits a partition no further than the first chunk of its oldest open
request, so a request whose final chunk never comes (generate's error chunk refused too,
a seq 0 written by another producer, chunks lost with a broker) pinned that commit for
good: every restart replayed the partition from there, and its state stayed. Here such a
request is found so the worker can end it with an error result and a cancel.

Time is the partition's *log time*: the newest record timestamp read on it, not the
worker's clock. A broker away for an hour, a worker stopped, or a backlog read back
after a restart moves no request closer to its end; only other requests' chunks going
on past it do. `genpipe replay` reads the same timestamps, so it ends the same requests
where the worker did. A request is stalled once its partition's log time is more than
`timeout_ms` past the log time when its own last chunk was read (its own timestamp or a
newer one read before it: a generate host whose clock runs behind does not age its
requests).
"""

from __future__ import annotations

from typing import Hashable, Sequence

DEFAULT_STALLED_REQUEST_S = 1800.0
_NEVER = float("inf")
_NONE: tuple[str, ...] = ()


class StalledRequests:
    """Per partition: the log time, and each open request's log time at its last chunk,
    oldest first (a dict keeps insertion order; a request's chunk moves it to the end)."""

    __slots__ = ("timeout_ms", "_clocks")

    def __init__(self, timeout_s: float = DEFAULT_STALLED_REQUEST_S):
        self.timeout_ms = timeout_s * 1000.0
        # partition -> [log time ms, {request id: log time ms at its last chunk}, when the oldest is due]
        self._clocks: dict[Hashable, list] = {}

    def chunk(self, partition: Hashable, request_id: str, timestamp_ms: int, open_: bool) -> Sequence[str]:
        """A chunk of `request_id` was read on `partition` (its record's timestamp, ms; -1
        for none) and processed; `open_`: the request is still running. The ids of the
        partition's other requests that are stalled now (they are forgotten here: end
        them). Called for every chunk: a few dict operations when nothing is stalled."""
        clock = self._clocks.get(partition)
        if clock is None:
            clock = self._clocks[partition] = [timestamp_ms, {}, _NEVER]
        elif timestamp_ms > clock[0]:
            clock[0] = timestamp_ms
        now, marks, due = clock
        marks.pop(request_id, None)
        if open_:
            marks[request_id] = now
            if due == _NEVER:
                clock[2] = now + self.timeout_ms
        # `due` (the oldest mark + the timeout, when it was the oldest) may be early, never
        # late: the oldest request's chunk moves it behind marks at least as new.
        return _NONE if now <= due else self._stalled(clock)

    def _stalled(self, clock: list) -> list[str]:
        now, marks, _ = clock
        stalled, due = [], _NEVER
        for rid, mark in marks.items():
            if now - mark <= self.timeout_ms:
                due = mark + self.timeout_ms
                break
            stalled.append(rid)
        for rid in stalled:
            del marks[rid]
        clock[2] = due
        return stalled

    def forget(self, partition: Hashable) -> None:
        """The partition was revoked: its next owner replays its open requests."""
        self._clocks.pop(partition, None)

    def open_requests(self, partition: Hashable) -> int:
        clock = self._clocks.get(partition)
        return len(clock[1]) if clock is not None else 0
