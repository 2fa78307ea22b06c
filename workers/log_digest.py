"""A log line per event, until events come in a flood: then a count (docs/design.md §2).

A worker copies every record it cannot read to the DLQ and logs it. A producer that
writes garbage at 10k records/s made that 10k WARNING lines a second per worker, a third
of the worker's CPU (BENCHMARKS.md, "The DLQ under a flood"), and buried every other line.
The records themselves are in the DLQ with their coordinates and error (headers), and
`genpipe_dlq_records_total` counts them; the log only has to say that it happens, show
a few, and say how many more. The generate worker's logs of unreadable cancels and of
dropped copies of a running request, which a client's records can flood as well, go
through it too (§4).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable


class LogDigest:
    """The first `burst` events of each `window_s` are logged in full; the rest are
    counted, and one line says how many, and the last of them, when the window ends
    (timed on the running event loop, so a flood that stops is still summed up)."""

    def __init__(self, logger: logging.Logger, level: int, what: str, burst: int = 10, window_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.logger, self.level, self.what = logger, level, what
        self.burst, self.window_s, self.clock = burst, window_s, clock
        self._window_end = float("-inf")
        self._logged = 0  # events logged in full in this window
        self._held = 0  # events of this window only counted
        self._last: tuple[str, tuple] | None = None  # the last counted event's message and args
        self._timer: asyncio.TimerHandle | None = None

    def log(self, msg: str, *args, exc_info: bool = False) -> None:
        """`exc_info`: the lines logged in full carry the exception being handled."""
        now = self.clock()
        if now >= self._window_end:
            self.flush()
            self._window_end = now + self.window_s
            self._logged = 0
        if self._logged < self.burst:
            self._logged += 1
            self.logger.log(self.level, msg, *args, exc_info=exc_info)
            return
        self._held += 1
        self._last = (msg, args)
        if self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop: the next event or `flush` sums up
                return
            self._timer = loop.call_at(loop.time() + max(0.0, self._window_end - now), self._window_over)

    def _window_over(self) -> None:
        self._timer = None
        self.flush()

    def flush(self) -> None:
        """Log the count of the events held back, if any (also at shutdown)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._held:
            return
        msg, args = self._last
        span = min(self.window_s, self.clock() - (self._window_end - self.window_s))
        self.logger.log(self.level, "%d more %s in the last %.1f s (not logged one by one); the last: " + msg,
                        self._held, self.what, span, *args)
        self._held = 0
        self._last = None
