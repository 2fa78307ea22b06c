"""Knowing when the engine is stuck (docs/design.md §7).

A worker whose engine stops stepping (a hung GPU call, a thread that died without a word)
still heartbeats and still holds its partitions: its running requests would wait for
good, and so would the partitions' commits. So the worker watches the engine: requests
in it, and no step from it for `stall_s`, while nothing of the worker's holds it back,
means it is stuck; the worker then stops, its requests uncommitted, and the partitions'
next owner redoes them. "Held back" is any publish step under way: with the broker away
or slow the engine waits on backpressure and makes no step, rightly, and that is not a
stall. An idle engine (no requests) makes no step either.
"""

from __future__ import annotations

import time

# No step for this long with requests in the engine and nothing held back. Far above any
# one step (a prefill chunk, a CUDA graph's first capture: well under a second on a GPU;
# seconds for a large model run on a CPU), so only an engine that makes no progress at all
# trips it.
ENGINE_STALL_S = 120.0


class StallWatch:
    """The engine's last step, and since when it has had work to do and nothing in its way."""

    def __init__(self, stall_s: float = ENGINE_STALL_S, clock=time.monotonic):
        self.stall_s = stall_s  # 0: never stuck (off)
        self._clock = clock
        self._last_step = clock()
        self._free_since = self._last_step  # requests in the engine and no publish under way, since
        self._last_look = self._last_step

    def stepped(self) -> None:
        """A step (or held tokens) came from the engine."""
        self._last_step = self._clock()

    def stuck(self, running: int, publishing: bool) -> str | None:
        """Why the engine is stuck, or None. Called every turn of the worker's loop with the
        requests in the engine and whether a publish step is under way. A look that comes
        long after the last one (a quarter of the limit: the loop was held elsewhere, in a
        rebalance say) starts the clock again, as if the engine had been held back: what
        held it meanwhile was not seen (a false alarm stopped a worker of the fleet tests
        after a 3 s rebalance, with a limit of 2 s)."""
        now = self._clock()
        unseen, self._last_look = now - self._last_look > self.stall_s / 4, now
        if not self.stall_s or not running or publishing or unseen:
            self._free_since = now
            return None
        quiet = now - max(self._last_step, self._free_since)
        if quiet < self.stall_s:
            return None
        return (f"the engine made no step for {quiet:.0f} s with {running} request{'s' * (running != 1)} in it "
                f"and nothing waiting "
                f"to be published (--engine-stall-s {self.stall_s:g}): it is stuck; stopping, so that the "
                f"partitions' next owner redoes its requests")
