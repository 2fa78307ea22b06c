"""Create genpipe's six topics (docs/design.md §2), idempotently.

requests, requests.bulk, chunks and results must share one partition count so a
request's records stay on one partition number end to end; cancel and dlq simply use the same count.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Sequence

from workers.kafka.settings import TOPIC_ROLES, KafkaSettings


class TopicsError(RuntimeError):
    """Topic creation failed for a reason other than "already exists"."""


@dataclass
class TopicsReport:
    created: list[str] = field(default_factory=list)
    existed: list[str] = field(default_factory=list)
    grown: dict[str, tuple[int, int]] = field(default_factory=dict)  # topic -> (before, after)
    partitions: dict[str, int] = field(default_factory=dict)  # topic -> partition count
    # topic -> its configs that differ from CHUNKS_TOPIC_CONFIGS (an existing chunks topic)
    unlike: dict[str, dict[str, str]] = field(default_factory=dict)

    def mismatched(self, settings: KafkaSettings) -> list[str]:
        """requests/chunks/results whose partition counts differ (pre-existing topics)."""
        names = [settings.topic(r) for r in ("requests", "requests.bulk", "chunks", "results")]
        counts = {self.partitions.get(n) for n in names}
        return names if len(counts) > 1 else []


DEFAULT_PARTITIONS = 32  # a fleet can use at most this many generate workers (README, "Running a fleet")

# The chunk log's timestamps are the broker's: they rise with the log, whatever the clocks
# of the generate hosts (or of a producer that sets its own) say. The derender's
# stalled-request check reads time from them (workers/derender/stalls.py): with the
# producers' times one record dated far ahead held it off on its partition until the
# clocks got there, and out-of-order times could move where a replay ends a request.
CHUNKS_TOPIC_CONFIGS = {"message.timestamp.type": "LogAppendTime"}

# Growing an existing deployment: results (and reply topics) first, then chunks, then the
# request topics. A request that lands on a new partition number p then always finds
# chunks[p] and results[p]; requests already running stay on their partition numbers.
_GROW_ORDER = ("results", "chunks", "requests.bulk", "requests", "cancel", "dlq")


async def create_topics(settings: KafkaSettings, partitions: int = DEFAULT_PARTITIONS,
                        replication_factor: int | None = None, timeout: float = 30,
                        extra: Sequence[str] = (), grow: bool = False) -> TopicsReport:
    """Create the missing topics among ``settings.topic(role)`` for every role, and the
    `extra` ones (a tenant's reply topic, a replay target) with the same settings.

    Existing topics are left alone (their partition count is reported, not changed)
    unless `grow`: then those with fewer than `partitions` get more, results and reply
    topics first, request topics last (see _GROW_ORDER; Kafka never shrinks a topic).
    `replication_factor` None: min(3, brokers in the cluster); with 3 or more replicas the
    topics get min.insync.replicas=2, so an acknowledged record survives a lost broker.
    Waits up to `timeout` for a broker to answer. Returns once every topic has a leader
    for every partition, so callers can produce immediately.
    """
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import KafkaConnectionError, KafkaError

    if partitions < 1 or (replication_factor is not None and replication_factor < 1):
        raise ValueError("partitions and replication_factor must be >= 1")
    names = [settings.topic(role) for role in TOPIC_ROLES]
    names = list(dict.fromkeys([*names, *extra]))  # (a name given twice failed the whole creation)
    report = TopicsReport()
    deadline = time.monotonic() + timeout
    while True:  # a broker that is still starting answers a moment later
        admin = AIOKafkaAdminClient(**settings.with_client_id(f"{settings.client_id}-admin")
                                    .client_kwargs(), request_timeout_ms=int(timeout * 1000))
        try:
            await admin.start()
            break
        except KafkaConnectionError:
            await admin.close()
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
    try:
        report.created, report.existed = await _create_missing(admin, names, partitions, replication_factor, timeout,
                                                               {settings.topic("chunks"): CHUNKS_TOPIC_CONFIGS})
        if grow and report.existed:
            await _grow(admin, settings, [n for n in names if n in report.existed], partitions, timeout, report)
        chunks = settings.topic("chunks")
        if chunks in report.existed:
            try:
                report.unlike = await _configs_unlike(admin, {chunks: CHUNKS_TOPIC_CONFIGS})
            except KafkaError:  # (not allowed to describe it: nothing known to differ)
                pass
        report.partitions = await _wait_for_leaders(admin, names, timeout)
    finally:
        await admin.close()
    report.existed.sort(key=names.index)
    report.created.sort(key=names.index)
    return report


async def ensure_topic(settings: KafkaSettings, name: str, like: str, timeout: float = 30) -> None:
    """Create `name` if missing, with the partition count of the topic `like` (a reply
    topic shares the results topic's count, so results keep their partition number)
    and the replication `create_topics` would choose."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**settings.with_client_id(f"{settings.client_id}-admin").client_kwargs(),
                                request_timeout_ms=int(timeout * 1000))
    await admin.start()
    try:
        described = await admin.describe_topics([like])
        partitions = len(described[0]["partitions"]) if described and described[0]["partitions"] else 1
        await _create_missing(admin, [name], partitions, None, timeout)
        await _wait_for_leaders(admin, [name], timeout)
    finally:
        await admin.close()


async def _create_missing(admin, names: list[str], partitions: int, replication_factor: int | None,
                          timeout: float, configs_of: dict[str, dict[str, str]] | None = None
                          ) -> tuple[list[str], list[str]]:
    """Create those of `names` that do not exist: (created, existed). Replication None:
    min(3, brokers), and min.insync.replicas=2 from three replicas; `configs_of`: more
    configs of some of them."""
    from aiokafka.admin import NewTopic
    from aiokafka.errors import TopicAlreadyExistsError, for_code

    existing = set(await admin.list_topics())
    missing = [n for n in names if n not in existing]
    created, existed = [], [n for n in names if n in existing]
    if not missing:
        return created, existed
    replicas = replication_factor or min(3, len((await admin.describe_cluster())["brokers"]) or 1)
    configs = {"min.insync.replicas": "2"} if replicas >= 3 else {}
    response = await admin.create_topics(
        [NewTopic(n, partitions, replicas, topic_configs={**configs, **(configs_of or {}).get(n, {})})
         for n in missing], timeout_ms=int(timeout * 1000))
    failures = []
    for topic, code, *rest in response.topic_errors:
        error = for_code(code) if code else None
        if error is None:
            created.append(topic)
        elif error is TopicAlreadyExistsError:
            existed.append(topic)  # someone else created it meanwhile
        else:
            failures.append(f"{topic}: {error.__name__}" + (f" ({rest[0]})" if rest and rest[0] else ""))
    if failures:
        raise TopicsError("could not create topics: " + "; ".join(failures))
    return created, existed


async def _configs_unlike(admin, wanted: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """Of `wanted` (topic -> configs), the configs each existing topic has otherwise: what
    it has, by name. A topic the broker does not describe is left out (not known to differ)."""
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    resources = [ConfigResource(ConfigResourceType.TOPIC, topic, configs=dict.fromkeys(configs))
                 for topic, configs in wanted.items()]
    responses = await admin.describe_configs(resources)
    unlike: dict[str, dict[str, str]] = {}
    for response in responses:
        for resource in response.to_object()["resources"]:
            topic = resource["resource_name"]
            if resource["error_code"] or topic not in wanted:
                continue
            for entry in resource["config_entries"]:
                name, value = entry["config_names"], entry["config_value"]
                if name in wanted[topic] and value != wanted[topic][name]:
                    unlike.setdefault(topic, {})[name] = value
    return unlike


async def _grow(admin, settings: KafkaSettings, existing: list[str], partitions: int, timeout: float,
                report: TopicsReport) -> None:
    from aiokafka.admin import NewPartitions

    counts = {t["topic"]: len(t["partitions"]) for t in await admin.describe_topics(existing)}
    role_of = {settings.topic(role): role for role in _GROW_ORDER}
    # Unknown names (reply topics, replay targets) go with the results: first.
    ordered = sorted(existing, key=lambda n: _GROW_ORDER.index(role_of[n]) if n in role_of else 0)
    for name in ordered:
        before = counts.get(name, 0)
        if 0 < before < partitions:
            response = await admin.create_partitions({name: NewPartitions(total_count=partitions)},
                                                     timeout_ms=int(timeout * 1000))
            for topic, code, message in response.topic_errors:
                if code:
                    raise TopicsError(f"could not grow {topic} to {partitions} partitions: {message or code}")
            await _wait_for_leaders(admin, [name], timeout)  # in order: the next one only after this one
            report.grown[name] = (before, partitions)


async def _wait_for_leaders(admin, names: list[str], timeout: float) -> dict[str, int]:
    """Poll metadata until each topic is known and every partition has a leader.

    KRaft acknowledges CreateTopics once the controller committed it; the broker side
    may take a moment more, and a producer sending before then fails its first send.
    """
    deadline = time.monotonic() + timeout
    while True:
        topics = await admin.describe_topics(names)
        ready = {t["topic"]: len(t["partitions"]) for t in topics
                 if t["error_code"] == 0 and t["partitions"]
                 and all(p["leader"] >= 0 for p in t["partitions"])}
        if len(ready) == len(names):
            return ready
        if time.monotonic() > deadline:
            waiting = sorted(set(names) - set(ready))
            raise TopicsError(f"topics without leaders after {timeout:.0f} s: {waiting}")
        await asyncio.sleep(0.1)


# What a record batch adds to the records' own bytes (key, value, headers: what
# `--max-record-bytes` counts): the batch header (61 bytes) and each record's lengths,
# offsets and timestamps as varints. Generous: a limit exactly at the edge is not the point.
BATCH_OVERHEAD_BYTES = 512


def describe_limits_request(topics: Sequence[str]):
    """A DescribeConfigs request for `topics`' `max.message.bytes`, for a client that is not
    an admin (a worker's producer: workers/kafka/topic_metadata.py)."""
    from aiokafka.admin.config_resource import ConfigResourceType
    from aiokafka.protocol.admin import DescribeConfigsRequest

    return DescribeConfigsRequest([(ConfigResourceType.TOPIC, topic, ["max.message.bytes"]) for topic in topics])


def limits_described(responses) -> dict[str, int]:
    """`max.message.bytes` by topic from DescribeConfigs responses; topics with an error
    (not described: missing, or not allowed) are left out."""
    limits = {}
    for response in responses:
        for resource in response.to_object()["resources"]:
            if resource["error_code"]:
                continue
            for entry in resource["config_entries"]:
                if entry["config_names"] == "max.message.bytes" and str(entry["config_value"]).isdigit():
                    limits[resource["resource_name"]] = int(entry["config_value"])
    return limits


def record_limit_problems(limits: dict[str, int], max_record_bytes: int, batch_bytes: int) -> list[str]:
    """The topics (of `limits`) that refuse records or batches a worker writes: one as
    large as `max_record_bytes`, or a batch of smaller ones up to `batch_bytes`. The broker
    refuses those for good; found at start, it is a clear error instead of requests that
    end with an error later (or, before that was handled, a partition that stopped)."""
    need = max(max_record_bytes, batch_bytes) + BATCH_OVERHEAD_BYTES
    return [f"topic {topic!r} takes record batches of at most {limit} bytes (its max.message.bytes), below the "
            f"{need} this worker may write there (--max-record-bytes {max_record_bytes}, batches of up to "
            f"{batch_bytes} bytes): raise its max.message.bytes to {need} or more"
            + (f", or lower --max-record-bytes to {limit - BATCH_OVERHEAD_BYTES}"
               if limit - BATCH_OVERHEAD_BYTES >= batch_bytes else "")
            for topic, limit in limits.items() if limit < need]
