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


# --- finished beyond the committed offset (commit metadata) ---------------------------------

from workers.kafka.offsets import FINISHED_PREFIX, decode_finished, encode_finished  # noqa: E402


def _tracker(read_upto, unfinished):
    tracker = OffsetTracker()
    for offset in range(100, read_upto):
        tracker.seen(offset)
    for offset in unfinished:
        tracker.hold(offset)
    return tracker


def test_finished_requests_beyond_the_commit_are_named_in_its_metadata():
    tracker = _tracker(200, [105, 150, 151, 199])
    committed = tracker.committable()
    assert committed == 105
    ahead = decode_finished(committed, encode_finished(tracker))
    skipped = [o for o in range(100, 210) if ahead.finished(o)]
    assert skipped == [o for o in range(106, 200) if o not in (150, 151, 199)]
    assert len(ahead) == len(skipped)


def test_nothing_beyond_the_commit_means_empty_metadata():
    assert encode_finished(_tracker(200, [])) == ""
    assert encode_finished(OffsetTracker()) == ""
    assert encode_finished(_tracker(200, [199])) == f"{FINISHED_PREFIX}1:0"  # just the held one


def test_a_list_too_long_for_kafka_is_cut_so_the_next_owner_redoes_more_never_less():
    unfinished = list(range(1000, 50_000, 7))  # ~7,000 unfinished among 49,000 read
    tracker = _tracker(50_000, unfinished)
    text = encode_finished(tracker, limit=3000)
    assert len(text) <= 3000
    ahead = decode_finished(tracker.committable(), text)
    held = set(unfinished)
    assert not any(ahead.finished(o) for o in held)  # never skips unfinished work
    assert ahead.finished(1001) and not ahead.finished(49_999)  # a prefix is reported, the rest redone
    assert 0 < ahead.end < 50_000


def test_unreadable_metadata_means_nothing_is_skipped():
    for text in ["", None, "published=5", f"{FINISHED_PREFIX}zz!:1", f"{FINISHED_PREFIX}-5:", "gp-done:"]:
        assert len(decode_finished(100, text)) == 0
        assert not decode_finished(100, text).finished(101)
    assert not decode_finished(None, f"{FINISHED_PREFIX}5:0").finished(1)


# --- the DLQ copy of a refused record (workers/kafka/records.py) ------------------------------


class _Refused:
    topic, partition, offset = "p.requests", 3, 17

    def __init__(self, key, value, headers):
        self.key, self.value, self.headers = key, value, headers


def _size(key, value, headers) -> int:
    return len(key or b"") + len(value or b"") + sum(len(n) + len(v) for n, v in headers)


def test_a_dlq_copy_that_fits_keeps_the_record_whole():
    from workers.kafka.records import dlq_copy

    key, value, headers = dlq_copy(_Refused(b"k", b"\xc1" * 100, [("x", b"1")]), "not msgpack", 10_000)
    assert key == b"k" and value == b"\xc1" * 100 and headers[0] == ("x", b"1")
    assert dict(headers)["genpipe-dlq-source-offset"] == b"17" and "genpipe-dlq-cut" not in dict(headers)


def test_a_dlq_copy_over_the_limit_is_cut_to_fit_and_says_what_the_original_held():
    from workers.kafka.records import dlq_copy

    # the value goes first; small original headers stay
    key, value, headers = dlq_copy(_Refused(b"k", b"v" * 5000, [("x", b"1")]), "bad", 2000)
    assert _size(key, value, headers) <= 2000 and key == b"k" and b"v" * 5000 != value and value.startswith(b"vvv")
    assert dict(headers)["x"] == b"1"
    assert dict(headers)["genpipe-dlq-cut"].decode().startswith(
        "key 1 bytes, value 5000 bytes, 1 headers (2 bytes): cut to fit the record limit of 2000 bytes")
    # hostile headers and key do not crowd the value out: headers dropped, key cut to a quarter
    key, value, headers = dlq_copy(_Refused(b"k" * 5000, b"v" * 5000, [("x", b"h" * 5000)]), "bad", 2000)
    assert _size(key, value, headers) <= 2000 and "x" not in dict(headers)
    assert 0 < len(key) < len(value) and dict(headers)["genpipe-dlq-source-topic"] == b"p.requests"
    # no key, no value: still a copy with its coordinates
    key, value, headers = dlq_copy(_Refused(None, None, [("x", b"h" * 5000)]), "bad", 2000)
    assert key is None and value is None and _size(key, value, headers) <= 2000


# --- the record being handled, holds after a revoke, and the heap under a stuck hold ------

from aiokafka import TopicPartition  # noqa: E402

from workers.kafka.offsets import PartitionOffsets  # noqa: E402


def test_the_record_being_handled_is_not_committed_past():
    """A handler that waits (a reply topic's lookup) before it holds its record: a commit
    in between (the periodic one, a revoke's) must not pass the record."""
    t = OffsetTracker()
    for offset in range(5):
        t.seen(offset)
    t.hold(1)
    t.handling = 4
    assert t.committable() == 1  # a lower hold still decides
    t.release(1)
    assert t.committable() == 4
    t.handling = None
    assert t.committable() == 5
    fresh = OffsetTracker()
    fresh.seen(0)
    fresh.handling = 0
    assert fresh.committable() == 0


class _Message:
    def __init__(self, partition, offset, topic="t"):
        self.topic, self.partition, self.offset = topic, partition, offset


def test_a_hold_on_a_partition_no_longer_owned_makes_no_tracker():
    """Revoked while its handler waited: a tracker made by the hold would be committed with
    the owned partitions, and the broker refuses a whole commit that names one not
    assigned (every later commit of the worker failed)."""
    offsets = PartitionOffsets()
    tp = TopicPartition("t", 0)
    offsets.tracker(tp).seen(7)
    release = offsets.hold(_Message(0, 7))
    assert offsets.get(tp).committable() == 7
    offsets.drop(tp)  # revoked
    late = offsets.hold(_Message(0, 8))
    assert offsets.get(tp) is None and offsets.partitions() == []
    late()
    release()  # (a release after the revoke touches nothing either)
    assert offsets.partitions() == []


def test_released_offsets_do_not_pile_up_under_one_hold_that_stays():
    t = OffsetTracker()
    t.seen(0)
    t.hold(0)  # stays (a result waiting for its partition's leader)
    for offset in range(1, 100_001):
        t.seen(offset)
        t.hold(offset)
        t.release(offset)
    assert len(t._heap) <= 2 * t.held + 1024
    assert t.committable() == 0
    t.hold(50)
    t.hold(99_999)
    t.release(0)
    assert t.committable() == 50
    t.release(50)
    assert t.committable() == 99_999
    t.release(99_999)
    assert t.committable() == 100_001


def test_the_record_being_handled_is_not_reported_finished_in_the_commit_metadata():
    """A handler that waits before its hold: the metadata of a commit made meanwhile must
    not tell the next owner the record was finished (it would skip it)."""
    t = _tracker(120, [115])
    t.handling = 112
    committed = t.committable()
    assert committed == 112
    ahead = decode_finished(committed, encode_finished(t))
    assert not ahead.finished(112) and not ahead.finished(115) and ahead.finished(113)
