"""The sticky assignor's rule (workers/kafka/assignor.py): pure, no broker."""

from aiokafka.structs import TopicPartition

from workers.kafka.assignor import decode_owned, encode_owned, sticky_assignment

T = "g.requests"
ALL = [TopicPartition(T, p) for p in range(8)]


def member(owned=(), generation=1, topics=(T,)):
    return (set(topics), [TopicPartition(T, p) for p in owned], generation)


def moved(before, after):
    """Partitions taken from a member that is still in the group."""
    owner_before = {tp: m for m, tps in before.items() for tp in tps if m in after}
    return sum(1 for m, tps in after.items() for tp in tps if owner_before.get(tp) not in (None, m))


def test_a_joining_member_takes_only_its_share_from_the_others():
    before = {"a": [TopicPartition(T, p) for p in range(4)], "b": [TopicPartition(T, p) for p in range(4, 8)]}
    after = sticky_assignment(ALL, {"a": member(range(4)), "b": member(range(4, 8)), "c": member()})
    assert sorted(len(v) for v in after.values()) == [2, 3, 3]
    assert moved(before, after) == 2  # exactly c's share; round-robin moves 5 of 8 here
    assert set().union(*map(set, after.values())) == set(ALL)


def test_a_leaving_member_s_partitions_go_to_the_rest_and_nothing_else_moves():
    before = {"a": ALL[0:3], "b": ALL[3:6], "c": ALL[6:8]}
    after = sticky_assignment(ALL, {"a": member(range(0, 3)), "b": member(range(3, 6))})
    assert moved(before, after) == 0
    assert set(ALL[0:3]) <= set(after["a"]) and set(ALL[3:6]) <= set(after["b"])
    assert sorted(len(v) for v in after.values()) == [4, 4]


def test_a_partition_claimed_twice_goes_to_the_newest_claim():
    after = sticky_assignment(ALL[:2], {"old": member([0, 1], generation=3), "new": member([0], generation=5)})
    assert after["new"] == [ALL[0]] and after["old"] == [ALL[1]]


def test_only_subscribed_members_get_a_topic_and_gone_partitions_are_dropped():
    bulk = [TopicPartition("g.requests.bulk", p) for p in range(2)]
    after = sticky_assignment(ALL[:2] + bulk, {"both": member([0, 7], topics=(T, "g.requests.bulk")),
                                               "one": member([], topics=(T,))})
    assert set(bulk) <= set(after["both"])  # "one" does not read the bulk topic
    assert TopicPartition(T, 7) not in after["both"]  # no longer exists
    assert sorted(after["both"] + after["one"]) == sorted(ALL[:2] + bulk)  # each exactly once


def test_reports_round_trip_and_garbage_counts_as_nothing():
    assert decode_owned(encode_owned(ALL[:3], 7)) == (ALL[:3], 7)
    assert decode_owned(b"\xff not json") == ([], -1)
    assert decode_owned(b'{"owned": {"t": ["x"]}}') == ([], -1)
    assert decode_owned(b"") == ([], -1)


def test_each_topic_is_spread_on_its_own():
    """A worker that owned everything keeps half of *each* topic, not all of one topic
    (all interactive traffic on one worker and all bulk traffic on the other)."""
    bulk = [TopicPartition("g.requests.bulk", p) for p in range(4)]
    both = (T, "g.requests.bulk")
    after = sticky_assignment(ALL[:4] + bulk, {"a": (set(both), ALL[:4] + bulk, 1), "b": (set(both), [], -1)})
    for m in ("a", "b"):
        assert sorted(tp.topic for tp in after[m]) == [T, T, "g.requests.bulk", "g.requests.bulk"]


def test_odd_partitions_of_several_topics_do_not_pile_up_on_one_member():
    topics = [f"t{i}" for i in range(4)]
    parts = [TopicPartition(t, p) for t in topics for p in range(3)]
    after = sticky_assignment(parts, {m: (set(topics), [], -1) for m in ("a", "b")})
    assert sorted(len(v) for v in after.values()) == [6, 6]
