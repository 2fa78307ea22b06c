"""A waiting request's inbox: the records the client's one reader hands to it, in order.

The path every result record takes to the code waiting for it, so it is kept cheap: a
deque and one future, not an `asyncio.Queue` (whose put and get do bookkeeping for
`join()` nobody calls here), and one timer per request instead of a timeout around every
get. `asyncio.timeout` cancels and re-arms a timer for each record, and with the gateway's
second timeout (keep-alive) that was a quarter of its CPU per streamed token (py-spy,
`ops/bench/gateway.py --parts streams`). Here a record costs a clock read; the timer
fires only after a quiet spell and then decides:

* nothing arrived for `timeout_s` since the previous record (or since `start()`):
  `TIMED_OUT` is put in the inbox (after whatever came before it);
* with `keepalive_s`, nothing arrived (and no `KEEPALIVE` was put) for that long:
  `KEEPALIVE` is put, so a reader that relays a stream can say it is still alive.

With `max_items`, an inbox is bounded: a reader that falls that far behind (an HTTP client
that stopped reading while its request still produces) does not make the process grow
without end. What it had not read is dropped at once and `OVERFLOW` is all it gets next:
the request has failed, and its reader says so. Behind means behind for a while: the
oldest record it has not taken came `STALLED_AFTER_S` ago or more. A reader that reads
on is never given up on a burst: the client's reader hands over a whole poll's records
(thousands, after any lag of its own) before the request's reader runs once, and every
long stream of a gateway ended at such a moment.
"""

from __future__ import annotations

import asyncio
from collections import deque


class _Marker:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


TIMED_OUT = _Marker("TIMED_OUT")
KEEPALIVE = _Marker("KEEPALIVE")
OVERFLOW = _Marker("OVERFLOW")
# The loop may run a timer up to its clock resolution early; an early wake-up re-arms.
_EARLY_S = 1e-3
# How long the oldest unread record waits before a full inbox counts as its reader's stall.
STALLED_AFTER_S = 5.0


class Mailbox:
    """One request's inbox (single reader). `put` never blocks: the reader of the reply
    topic must not wait for one slow request. Without `max_items` what bounds an inbox is
    the request itself (its records are as many as its chunks)."""

    __slots__ = ("_items", "_waiter", "_loop", "_timer", "_last", "_quiet", "timeout_s", "keepalive_s",
                 "max_items", "stalled_after_s", "overflowed", "received_at", "on_overflow", "started", "answered")

    def __init__(self, timeout_s: float, keepalive_s: float | None = None, max_items: int | None = None,
                 on_overflow=None, stalled_after_s: float | None = None):
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._last = self._quiet = self._loop.time()
        self.timeout_s = float(timeout_s)
        self.keepalive_s = float(keepalive_s) if keepalive_s else None
        self.max_items = max_items
        self.stalled_after_s = STALLED_AFTER_S if stalled_after_s is None else stalled_after_s
        self.started = False  # `start` was called: the request is sent
        self.answered = False  # its reader took the final record (the request needs no cancel)
        self.overflowed = 0  # items dropped: unread when the bound was reached, and after
        self.received_at = 0.0  # when the item `get` returned last was put (the loop's clock)
        # Called once, when the bound is reached: the reader may be parked for good (an HTTP
        # client that stopped reading), so whatever must happen now cannot wait for its get.
        self.on_overflow = on_overflow

    def put(self, item) -> None:
        now = self._last = self._loop.time()
        if self.overflowed:
            self.overflowed += 1
            return
        items = self._items
        if self.max_items is not None and len(items) >= self.max_items and now - items[0][1] >= self.stalled_after_s:
            self.close()  # the request has failed: no timeout or keep-alive after this
            self.overflowed = len(self._items) + 1
            self._items.clear()
            item = OVERFLOW
            if self.on_overflow is not None:
                self.on_overflow()
        self._items.append((item, now))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self):
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item, self.received_at = self._items.popleft()
        return item

    def start(self) -> None:
        """Start the clocks (call it once the request is sent)."""
        self.started = True
        self._last = self._quiet = self._loop.time()
        self._arm()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self) -> None:
        due = self._last + self.timeout_s
        if self.keepalive_s is not None:
            due = min(due, max(self._last, self._quiet) + self.keepalive_s)
        self._timer = self._loop.call_at(due, self._fire)

    def _fire(self) -> None:
        now = self._loop.time()
        if now - self._last >= self.timeout_s - _EARLY_S:
            self._timer = None
            self.put(TIMED_OUT)
            return
        if self.keepalive_s is not None and now - max(self._last, self._quiet) >= self.keepalive_s - _EARLY_S:
            last = self._last
            self.put(KEEPALIVE)
            self._last, self._quiet = last, now  # a keep-alive is not a record: the timeout runs on
        self._arm()
