"""LogDigest: a line per event until they flood, then a count (workers/log_digest.py)."""

from __future__ import annotations

import logging

from tests.kafka_helpers import wait_for
from workers.log_digest import LogDigest

log = logging.getLogger("tests.log_digest")


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == log.name]


def test_a_flood_logs_the_first_events_in_full_and_then_how_many_more_and_the_last(caplog):
    caplog.set_level(logging.WARNING, logger=log.name)
    clock = Clock()
    digest = LogDigest(log, logging.WARNING, "records copied", burst=3, window_s=10.0, clock=clock)
    for i in range(50):
        digest.log("record %d: %s", i, "bad")
        clock.now += 0.01
    assert lines(caplog) == ["record 0: bad", "record 1: bad", "record 2: bad"]

    digest.flush()  # (shutdown)
    assert lines(caplog)[3:] == ["47 more records copied in the last 0.5 s (not logged one by one); "
                                 "the last: record 49: bad"]
    digest.flush()
    assert len(lines(caplog)) == 4  # nothing held: nothing more to say


def test_each_window_logs_its_first_events_in_full_again_and_sums_up_the_last_one(caplog):
    caplog.set_level(logging.WARNING, logger=log.name)
    clock = Clock()
    digest = LogDigest(log, logging.WARNING, "records copied", burst=2, window_s=10.0, clock=clock)
    for i in range(5):
        digest.log("first window %d", i)
    clock.now += 10.0
    digest.log("second window %d", 0)
    assert lines(caplog) == ["first window 0", "first window 1",
                             "3 more records copied in the last 10.0 s (not logged one by one); "
                             "the last: first window 4",
                             "second window 0"]


def test_a_quiet_stream_logs_every_event(caplog):
    caplog.set_level(logging.WARNING, logger=log.name)
    clock = Clock()
    digest = LogDigest(log, logging.WARNING, "records copied", burst=2, window_s=10.0, clock=clock)
    for i in range(6):
        digest.log("event %d", i)
        clock.now += 6.0  # two a window at most
    digest.flush()
    assert lines(caplog) == [f"event {i}" for i in range(6)]


async def test_a_flood_that_stops_is_summed_up_when_its_window_ends(caplog):
    """Without another event or a shutdown, the count still reaches the log."""
    caplog.set_level(logging.WARNING, logger=log.name)
    digest = LogDigest(log, logging.WARNING, "records copied", burst=1, window_s=0.2)
    for i in range(4):
        digest.log("event %d", i)
    assert lines(caplog) == ["event 0"]
    await wait_for(lambda: len(lines(caplog)) == 2, timeout=5, what="the window's count logged")
    assert lines(caplog)[1].startswith("3 more records copied in the last 0.")
    assert lines(caplog)[1].endswith("the last: event 3")
