"""Which waiting request runs next (docs/design.md §4, "Scheduling").

The generate worker reads ahead of the engine into this queue and admits from it by
vLLM's rule: lower `priority` first; within a priority, interactive before bulk (the
`tier`: 0 for `<prefix>.requests`, 1 for `<prefix>.requests.bulk`), then the earlier
`deadline_ms` (a request without one comes after those with one), then arrival order.
A request whose deadline passes while it waits leaves the queue without taking an
engine slot.

The queue is bounded by requests and by prompt tokens (what a waiting request costs in
memory), so a backlog of any size costs a fixed amount here: the consumer loop pauses
the request partitions while `full()`. Plain data, no Kafka, no engine: unit tested
in tests/test_admission.py.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from typing import Generic, Protocol, TypeVar


class _HasRequest(Protocol):
    request: object


T = TypeVar("T", bound=_HasRequest)


def admission_key(priority: int, tier: int, deadline_ms: int | None, arrival: int) -> tuple:
    return (priority, tier, deadline_ms if deadline_ms is not None else math.inf, arrival)


def queue_by_priority(queue, item) -> None:
    """Put `item` (it has `.request` and `.tier`) into an engine's small waiting queue (a
    list or deque) after every item that ranks before or with it: the engines run the few
    requests the worker hands them beyond a batch by the worker's rule too, interactive
    before bulk within a priority, arrival order among equals (docs/design.md §4,
    "Scheduling"). Without the tier a bulk request handed before an interactive one of the
    same priority took the next free row first."""
    bisect.insort_right(queue, item, key=lambda x: (x.request.priority, x.tier, _deadline(x.request)))


def _deadline(request) -> float:
    return request.deadline_ms if request.deadline_ms is not None else math.inf


class WaitingQueue(Generic[T]):
    """Waiting requests by (priority, deadline, arrival). Items carry `.request` (a
    GenerateRequest); removal is lazy (a removed id's heap entries are skipped)."""

    def __init__(self, max_requests: int = 1024, max_tokens: int = 1_000_000):
        if max_requests < 1 or max_tokens < 1:
            raise ValueError("max_requests and max_tokens must be >= 1")
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.tokens = 0  # prompt tokens of the waiting requests
        self._items: dict[str, tuple[int, T, int]] = {}  # request_id -> (arrival, item, tier)
        self.by_tier = [0, 0]  # waiting requests per tier
        # A heap per tier of (key, request_id, arrival): the best of either tier runs next,
        # but an interactive request must be reachable behind a better bulk one that may
        # not run (its tier's rows are full: `pop(tier=0)`).
        self._order: tuple[list[tuple], list[tuple]] = ([], [])
        self._deadlines: list[tuple] = []  # (deadline_ms, arrival, request_id)
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._items

    def full(self) -> bool:
        return len(self._items) >= self.max_requests or self.tokens >= self.max_tokens

    def push(self, item: T, tier: int = 0) -> None:
        """Always accepted (records already fetched when the queue filled still land here;
        the caller pauses intake on `full()`, which bounds the overshoot to one fetch).
        `tier`: 0 interactive, 1 bulk."""
        request = item.request
        if request.request_id in self._items:
            raise KeyError(f"request {request.request_id!r} is already waiting")
        arrival = next(self._arrivals)
        self._items[request.request_id] = (arrival, item, tier)
        self.by_tier[tier] += 1
        self.tokens += len(request.prompt_token_ids)
        heapq.heappush(self._order[tier], (admission_key(request.priority, tier, request.deadline_ms, arrival),
                                           request.request_id, arrival))
        if request.deadline_ms is not None:
            heapq.heappush(self._deadlines, (request.deadline_ms, arrival, request.request_id))

    def pop(self, tier: int | None = None) -> T | None:
        """The request to run next (of `tier` only, if given), or None when none waits."""
        if tier is None:
            tier = self.peek_tier()
            if tier is None:
                return None
        if self._head(tier) is None:
            return None
        _, request_id, arrival = heapq.heappop(self._order[tier])
        return self._take(request_id, arrival)

    def peek_tier(self) -> int | None:
        """The tier of the request `pop` would return (None when nothing waits)."""
        interactive, bulk = self._head(0), self._head(1)
        if interactive is None:
            return None if bulk is None else 1
        return 1 if bulk is not None and bulk[0] < interactive[0] else 0

    def _head(self, tier: int) -> tuple | None:
        """The best live entry of `tier`'s heap (stale ones on top are dropped), or None."""
        heap = self._order[tier]
        while heap:
            _, request_id, arrival = heap[0]
            entry = self._items.get(request_id)
            if entry is not None and entry[0] == arrival:
                return heap[0]
            heapq.heappop(heap)  # stale
        return None

    def remove(self, request_id: str) -> T | None:
        entry = self._items.get(request_id)
        return self._take(request_id, entry[0]) if entry is not None else None

    def expired(self, now_ms: float) -> list[T]:
        """Take out every request whose deadline_ms is at or before `now_ms`."""
        out = []
        while self._deadlines and self._deadlines[0][0] <= now_ms:
            _, arrival, request_id = heapq.heappop(self._deadlines)
            item = self._take(request_id, arrival)
            if item is not None:
                out.append(item)
        return out

    def take_all(self, keep=lambda item: False) -> list[T]:
        """Take out every waiting request for which `keep(item)` is false (a revoked
        partition's, or all of them at shutdown)."""
        out = [item for _, item, _ in list(self._items.values()) if not keep(item)]
        for item in out:
            self.remove(item.request.request_id)
        return out

    def _take(self, request_id: str, arrival: int) -> T | None:
        entry = self._items.get(request_id)
        if entry is None or entry[0] != arrival:
            return None  # already taken (a stale heap entry)
        del self._items[request_id]
        item = entry[1]
        self.by_tier[entry[2]] -= 1
        self.tokens -= len(item.request.prompt_token_ids)
        # Too many stale entries: rebuild. A request taken by `pop` leaves its deadline's
        # entry (one far ahead stayed for good: every such request, ~450 bytes, for the
        # worker's life), one taken by `remove` its order's too.
        limit = 2 * len(self._items) + 64
        if len(self._order[0]) + len(self._order[1]) > limit or len(self._deadlines) > limit:
            self._order = tuple([e for e in heap if self._items.get(e[1], (None,))[0] == e[2]] for heap in self._order)
            self._deadlines = [e for e in self._deadlines if self._items.get(e[2], (None,))[0] == e[1]]
            for heap in (*self._order, self._deadlines):
                heapq.heapify(heap)
        return item
