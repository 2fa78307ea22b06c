"""A sticky partition assignor: a rebalance moves only the partitions it must (docs/design.md §7).

aiokafka rebalances eagerly: every member gives up every partition, then takes what the
group leader assigns. With the default round-robin assignor almost every partition
changes hands on every join or leave; with this one a member keeps what it had, up to
its fair share, and only the surplus (or a departed member's partitions) moves. The
consumer loop then keeps the work of partitions that came back (workers/kafka/loop.py).

Why our own and not aiokafka's `StickyPartitionAssignor`: that one keeps its state
(member assignment, generation) in class attributes, so two consumers in one process
(tests, a gateway beside a worker) overwrite each other's, and its generation handling
has open issues upstream. Here each consumer gets its own instance; a member reports
what it owns, and at which generation, in its join metadata (`user_data`), and the
leader's `sticky_assignment` is a pure function of those reports.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping

from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment, ConsumerProtocolMemberMetadata
from aiokafka.structs import TopicPartition

log = logging.getLogger(__name__)


def sticky_assignment(partitions: Iterable[TopicPartition],
                      members: Mapping[str, tuple[set[str], list[TopicPartition], int]]) -> dict[str, list[TopicPartition]]:
    """members: member_id -> (subscribed topics, partitions it owned, generation it owned
    them at). Every partition goes to one subscribed member. Each topic is spread on its
    own (a worker must not end up with all of `requests` and another with all of
    `requests.bulk`): per topic, counts differ by at most one between its subscribers,
    and a topic's odd partitions go to whoever has the fewest so far. A member keeps as
    many of its own as its share allows, the newest claim winning when two members claim
    one partition."""
    ids = sorted(members)
    result: dict[str, list[TopicPartition]] = {m: [] for m in ids}
    by_topic: dict[str, list[TopicPartition]] = {}
    for tp in sorted(set(partitions)):
        by_topic.setdefault(tp.topic, []).append(tp)
    for topic, tps in by_topic.items():
        subscribers = [m for m in ids if topic in members[m][0]]
        if not subscribers:
            continue
        owned = {m: [tp for tp in sorted(members[m][1]) if tp.topic == topic] for m in subscribers}
        share, extra = divmod(len(tps), len(subscribers))
        # The `extra` larger shares: to members that owned more of this topic (fewer
        # moves), then to those with the fewest partitions so far (balance across topics).
        ranked = sorted(subscribers, key=lambda m: (-min(len(owned[m]), share + 1), len(result[m]), m))
        quota = {m: share + (1 if i < extra else 0) for i, m in enumerate(ranked)}
        mine: dict[str, list[TopicPartition]] = {m: [] for m in subscribers}
        existing, taken = set(tps), set()
        for m in sorted(subscribers, key=lambda m: (-members[m][2], m)):  # 1. keep yours, newest claim first
            for tp in owned[m]:
                if len(mine[m]) >= quota[m]:
                    break
                if tp in existing and tp not in taken:
                    mine[m].append(tp)
                    taken.add(tp)
        for tp in tps:  # 2. the rest to whoever is furthest below its share
            if tp not in taken:
                m = min(subscribers, key=lambda m: (len(mine[m]) - quota[m], len(result[m]) + len(mine[m]), m))
                mine[m].append(tp)
                taken.add(tp)
        for m in subscribers:
            result[m].extend(mine[m])
    return {m: sorted(tps) for m, tps in result.items()}


def encode_owned(partitions: Iterable[TopicPartition], generation: int) -> bytes:
    owned: dict[str, list[int]] = {}
    for tp in sorted(partitions):
        owned.setdefault(tp.topic, []).append(tp.partition)
    return json.dumps({"generation": generation, "owned": owned}, separators=(",", ":")).encode()


def decode_owned(user_data: bytes) -> tuple[list[TopicPartition], int]:
    """A member's report; anything unreadable (another client's, an old version) counts
    as owning nothing, which only costs stickiness."""
    try:
        data = json.loads(user_data or b"{}")
        owned = [TopicPartition(str(topic), int(p)) for topic, ps in data.get("owned", {}).items() for p in ps]
        return owned, int(data.get("generation", -1))
    except (ValueError, TypeError, AttributeError):
        return [], -1


class StickyAssignor:
    """One per consumer (pass an instance in `partition_assignment_strategy`)."""

    name = "genpipe-sticky"
    version = 0

    def __init__(self):
        self._owned: list[TopicPartition] = []
        self._generation = -1
        self.coordinator = None  # set by the consumer loop: where the current generation is read

    def metadata(self, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:
        return ConsumerProtocolMemberMetadata(self.version, sorted(topics),
                                              encode_owned(self._owned, self._generation))

    def assign(self, cluster, members: Mapping[str, ConsumerProtocolMemberMetadata]) -> dict[str, ConsumerProtocolMemberAssignment]:
        reports = {}
        all_partitions = []
        for member_id, metadata in members.items():
            owned, generation = decode_owned(metadata.user_data)
            reports[member_id] = (set(metadata.subscription), owned, generation)
        for topic in sorted({t for m in members.values() for t in m.subscription}):
            ids = cluster.partitions_for_topic(topic)
            if ids is None:
                log.warning("no partition metadata for topic %s", topic)
                continue
            all_partitions += [TopicPartition(topic, p) for p in ids]
        assignment = sticky_assignment(all_partitions, reports)
        out = {}
        for member_id, tps in assignment.items():
            by_topic: dict[str, list[int]] = {}
            for tp in tps:
                by_topic.setdefault(tp.topic, []).append(tp.partition)
            out[member_id] = ConsumerProtocolMemberAssignment(self.version, sorted(by_topic.items()), b"")
        return out

    def on_assignment(self, assignment: ConsumerProtocolMemberAssignment) -> None:
        self._owned = list(assignment.partitions())
        self._generation = self.coordinator.generation if self.coordinator is not None else -1
