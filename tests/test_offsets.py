from workers.kafka.offsets import OffsetTracker


def test_nothing_read_commits_nothing():
    assert OffsetTracker().committable() is None


def test_commits_past_everything_read_when_nothing_is_held():
    t = OffsetTracker()
    for offset in (0, 1, 2):
        t.seen(offset)
    assert t.committable() == 3


def test_commit_stops_at_the_lowest_unfinished_offset():
    t = OffsetTracker()
    for offset in range(6):
        t.seen(offset)
    t.hold(1)
    t.hold(4)
    assert t.committable() == 1  # a new owner must re-read request 1
    t.release(4)
    assert t.committable() == 1
    t.release(1)
    assert t.committable() == 6


def test_holds_are_counted():
    t = OffsetTracker()
    t.seen(0)
    t.hold(0)
    t.hold(0)
    t.release(0)
    assert t.committable() == 0 and t.is_held(0)
    t.release(0)
    assert t.committable() == 1 and not t.is_held(0)


def test_releasing_out_of_order_keeps_the_minimum():
    t = OffsetTracker()
    for offset in range(10):
        t.seen(offset)
        t.hold(offset)
    for offset in (5, 7, 0, 2, 1):
        t.release(offset)
    assert t.committable() == 3
    assert t.held == 5
