"""When the generate worker calls its engine stuck (workers/generate/stall.py): only with
requests in it, no step from it for the limit, and nothing of the worker's holding it
back. A false alarm stops a healthy worker; a missed one leaves requests waiting for good."""

from __future__ import annotations

from workers.generate.stall import StallWatch


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watch(stall_s: float = 60.0) -> tuple[StallWatch, Clock]:
    clock = Clock()
    return StallWatch(stall_s, clock=clock), clock


def looks(w: StallWatch, clock: Clock, seconds: float, **state) -> str | None:
    """The worker's loop looking every second for `seconds`; the last look's answer."""
    why = None
    for _ in range(int(seconds)):
        clock.now += 1
        why = w.stuck(**state)
    return why


def test_an_engine_with_requests_and_no_step_for_the_limit_is_stuck_and_the_reason_says_so():
    w, clock = watch()
    assert w.stuck(running=3, publishing=False) is None
    assert looks(w, clock, 59, running=3, publishing=False) is None
    why = looks(w, clock, 2, running=3, publishing=False)
    assert why is not None
    assert "no step for 61 s" in why and "3 requests" in why and "--engine-stall-s 60" in why


def test_an_engine_that_steps_is_never_stuck():
    w, clock = watch()
    for _ in range(100):
        assert looks(w, clock, 30, running=5, publishing=False) is None
        w.stepped()


def test_an_idle_engine_is_never_stuck_and_its_clock_starts_with_its_first_request():
    w, clock = watch()
    assert looks(w, clock, 3600, running=0, publishing=False) is None  # an hour with nothing to do
    assert looks(w, clock, 59, running=1, publishing=False) is None  # a request came: the clock runs from here
    assert looks(w, clock, 2, running=1, publishing=False) is not None


def test_an_engine_held_back_by_publishing_is_not_stuck_and_its_clock_starts_when_that_ends():
    w, clock = watch()
    # the broker away for ten minutes: publish steps wait, and the engine with them
    assert looks(w, clock, 600, running=8, publishing=True) is None
    assert looks(w, clock, 59, running=8, publishing=False) is None
    assert looks(w, clock, 2, running=8, publishing=False) is not None


def test_time_the_worker_did_not_look_starts_the_clock_again():
    """The worker's loop held elsewhere (a rebalance) for longer than a quarter of the limit:
    whatever held the engine back then was not seen, so that time does not count."""
    w, clock = watch()
    assert looks(w, clock, 10, running=4, publishing=False) is None
    clock.now += 50  # no look for 50 s: with the 10 s before, past the limit
    assert w.stuck(running=4, publishing=False) is None
    assert looks(w, clock, 59, running=4, publishing=False) is None
    assert looks(w, clock, 1, running=4, publishing=False) is not None


def test_a_limit_of_zero_turns_the_watch_off():
    w, clock = watch(stall_s=0)
    assert looks(w, clock, 10**4, running=8, publishing=False) is None
