"""genpipe on a 3-broker cluster (`genpipe broker up --brokers 3`): brokers die and
restart under load, and no request is lost, duplicated after the client, or stalled."""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import pytest

from tests.process_helpers import uninterrupted_texts
from workers.broker.cluster import cluster_down, cluster_up, node_down, node_up
from workers.broker.topics import create_topics
from workers.client import GenpipeClient, Restart, make_request
from workers.kafka.clients import make_admin
from workers.kafka.settings import TOPIC_ROLES, KafkaSettings

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
PORT = int(os.environ.get("GENPIPE_TEST_CLUSTER_PORT", "19800"))  # PORT..PORT+5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from workers.broker.local import BrokerError

    data_dir = tmp_path_factory.mktemp("cluster")
    try:
        cluster = cluster_up(3, PORT, data_dir, timeout=180, quiet=True)
    except BrokerError as exc:
        pytest.fail(f"the test cluster did not start: {exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster_down(3, PORT, data_dir)


def test_the_throughput_bench_counts_every_broker_of_a_local_cluster(cluster):
    """ops/bench/throughput.py's broker CPU is the whole cluster's, whichever broker the
    bootstrap list names: replication's cost is in it (BENCHMARKS.md, "The brokers' CPU
    with replication"). It used to read only the first bootstrap port's process."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops" / "bench"))
    from proc_cpu import broker_pids  # (ops/bench/throughput.py's)

    pids = sorted(node.pid() for node in cluster.nodes)
    assert len(set(pids)) == 3 and None not in pids
    last_only = KafkaSettings(bootstrap_servers=f"127.0.0.1:{cluster.nodes[-1].port}")
    assert broker_pids(last_only) == pids


async def _leaders(settings, topic: str) -> dict[int, int]:
    admin = make_admin(settings)
    await admin.start()
    try:
        described = await admin.describe_topics([topic])
        return {p["partition"]: p["leader"] for p in described[0]["partitions"]}
    finally:
        await admin.close()


async def _controller(settings) -> int:
    admin = make_admin(settings)
    await admin.start()
    try:
        return (await admin.describe_cluster())["controller_id"]
    finally:
        await admin.close()


async def _stream(client, request, gaps: list[float]) -> tuple[str, int]:
    """The last attempt's text and the restarts seen; the longest wait between results."""
    text, restarts, last = [], 0, time.monotonic()
    async for item in client.stream(request):
        now = time.monotonic()
        gaps.append(now - last)
        last = now
        if isinstance(item, Restart):
            restarts, text = restarts + 1, []
        else:
            text.append(item.choices[0].text)
    return "".join(text), restarts


class Pipeline:
    """A generate and a derender worker (in this process) on the cluster."""

    def __init__(self, settings, model_dir):
        from workers.derender.service import DerenderWorkerConfig, run_derender_worker
        from workers.generate.engine import Engine
        from workers.generate.service import GenerateWorkerConfig, run_generate_worker

        prefix = settings.topic_prefix
        self.stop = asyncio.Event()
        self.ready = [asyncio.Event(), asyncio.Event()]
        # Paced like a real model (20 tokens/s a request), so streams outlive a failover.
        self.tasks = [
            asyncio.ensure_future(run_generate_worker(
                settings, GenerateWorkerConfig(group_id=f"{prefix}-generate", max_batch=8, min_step_s=0.05),
                engine=Engine(str(model_dir), max_batch=8), stop=self.stop, on_ready=self.ready[0].set)),
            asyncio.ensure_future(run_derender_worker(
                settings, DerenderWorkerConfig(tokenizer=str(model_dir), group_id=f"{prefix}-derender"),
                stop=self.stop, on_ready=self.ready[1].set))]

    async def started(self) -> None:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in self.ready)), 120)

    def alive(self) -> bool:
        return not any(t.done() for t in self.tasks)

    async def close(self) -> list:
        self.stop.set()
        return await asyncio.wait_for(asyncio.gather(*self.tasks, return_exceptions=True), 120)


def _requests(tag: str, n: int, max_tokens: int):
    return [make_request([1, 100 + 7 * i, 200 + i], kind="completion", request_id=f"{tag}-{i}", max_tokens=max_tokens,
                         temperature=0, ignore_eos=True, stream=True) for i in range(n)]


async def test_killing_partition_leaders_and_the_controller_loses_no_request(cluster, tiny_model_dir):
    settings = KafkaSettings(bootstrap_servers=cluster.bootstrap_servers, topic_prefix=f"cl-{uuid.uuid4().hex[:6]}")
    await create_topics(settings, partitions=2)
    pipeline = Pipeline(settings, tiny_model_dir)
    requests = _requests("kill", 8, 300)  # ~15 s each at 20 tokens/s: both kills land mid-stream
    gaps: list[float] = []
    killed = []
    try:
        await pipeline.started()
        async with GenpipeClient(settings=settings, timeout_s=180) as client:
            tasks = [asyncio.ensure_future(_stream(client, r, gaps)) for r in requests]
            await _wait(lambda: len(gaps) >= 8, 60, "first results")
            # kill -9 the leader of the chunk partition 0 (it leads some result partitions too)
            victim = (await _leaders(settings, settings.topic("chunks")))[0]
            await asyncio.to_thread(node_down, cluster, victim, kill=True)
            killed.append(victim)
            # Results keep coming after the kill (how many depends on how tokens were
            # chunked, which a lagging producer changes: count progress, not chunks).
            seen = len(gaps)
            await _wait(lambda: len(gaps) >= seen + 16, 120, "streams going on after the kill")
            await asyncio.to_thread(node_up, cluster, victim)
            # then the active controller
            controller = await _controller(settings)
            await asyncio.to_thread(node_down, cluster, controller, kill=True)
            killed.append(controller)
            done = await asyncio.wait_for(asyncio.gather(*tasks), 240)
            await asyncio.to_thread(node_up, cluster, controller)
        assert pipeline.alive(), "a worker stopped"
    finally:
        results = await pipeline.close()
    assert results == [0, 0]
    _assert_uninterrupted(tiny_model_dir, requests, done)
    print(f"\ncluster kill test: {len(requests)} requests, 0 lost, brokers killed {killed}; "
          f"worst pause between two results of a request {max(gaps):.2f} s; "
          f"restarts seen {sum(r for _, r in done)}")


async def test_a_rolling_restart_of_every_broker_under_load_loses_no_request(cluster, tiny_model_dir):
    settings = KafkaSettings(bootstrap_servers=cluster.bootstrap_servers, topic_prefix=f"cl-{uuid.uuid4().hex[:6]}")
    await create_topics(settings, partitions=2)
    pipeline = Pipeline(settings, tiny_model_dir)
    gaps: list[float] = []
    sent, done = [], []
    try:
        await pipeline.started()
        async with GenpipeClient(settings=settings, timeout_s=180) as client:
            async def load() -> None:  # a request every 0.5 s, each ~1 s long, until told to stop
                i = 0
                while not rolling_done.is_set():
                    request = _requests(f"roll{i}", 1, 20)[0]
                    sent.append(request)
                    done.append(asyncio.ensure_future(_stream(client, request, gaps)))
                    i += 1
                    try:
                        await asyncio.wait_for(rolling_done.wait(), 0.5)
                    except asyncio.TimeoutError:
                        pass

            rolling_done = asyncio.Event()
            loader = asyncio.ensure_future(load())
            for node in cluster.nodes:  # SIGTERM (controlled shutdown), then start it again
                await asyncio.to_thread(node_down, cluster, node.node_id)
                await asyncio.to_thread(node_up, cluster, node.node_id)
            rolling_done.set()
            await loader
            outcomes = await asyncio.wait_for(asyncio.gather(*done), 240)
        assert pipeline.alive(), "a worker stopped"
    finally:
        results = await pipeline.close()
    assert results == [0, 0]
    expected = uninterrupted_texts(tiny_model_dir, sent)
    assert [text for text, _ in outcomes] == [expected[r.request_id] for r in sent]
    print(f"\ncluster rolling restart: {len(sent)} requests, 0 lost; worst pause between two results "
          f"of a request {max(gaps):.2f} s")


async def test_a_partition_without_a_leader_past_the_request_timeout_loses_no_request(cluster, tiny_model_dir):
    """Topics with one replica (a deployment's choice for a high-volume chunk topic): the
    broker holding chunks[0] dies and stays away longer than the producers' request timeout
    (30 s), while the other two answer. aiokafka then fails the records it queued for the
    partition (no leader past their time to live) instead of waiting for it."""
    settings = KafkaSettings(bootstrap_servers=cluster.bootstrap_servers, topic_prefix=f"cl-{uuid.uuid4().hex[:6]}")
    await create_topics(settings, partitions=2, replication_factor=1)
    pipeline = Pipeline(settings, tiny_model_dir)
    requests = _requests("leaderless", 8, 400)  # ~20 s each at 20 tokens/s: the outage lands mid-stream
    gaps: list[float] = []
    try:
        await pipeline.started()
        async with GenpipeClient(settings=settings, timeout_s=120) as client:
            tasks = [asyncio.ensure_future(_stream(client, r, gaps)) for r in requests]
            await _wait(lambda: len(gaps) >= 8, 60, "first results")
            victim = (await _leaders(settings, settings.topic("chunks")))[0]
            await asyncio.to_thread(node_down, cluster, victim, kill=True)
            away_until = time.monotonic() + AWAY_S
            await _wait(lambda: time.monotonic() > away_until or not pipeline.alive(), AWAY_S + 5, "the outage")
            await asyncio.to_thread(node_up, cluster, victim)
            done = await asyncio.wait_for(asyncio.gather(*tasks), 240)
        assert pipeline.alive(), "a worker stopped"
    finally:
        results = await pipeline.close()
    assert results == [0, 0]
    _assert_uninterrupted(tiny_model_dir, requests, done)
    print(f"\ncluster leaderless partition: {len(requests)} requests, 0 lost, broker {victim} away {AWAY_S} s; "
          f"restarts seen {sum(r for _, r in done)}")


async def test_a_partition_without_a_leader_holds_only_its_own_requests(cluster, tiny_model_dir):
    """chunks[0] alone on the broker that dies (topics with one replica). A publish step
    handed its partitions' batches over in turn, and one for a partition whose queue the
    producer could not empty waited until the broker came back: every partition's
    requests waited with it, and the engine (a request on partition 1, sent while the
    broker was away, did not finish until it was back). Now that partition's batches
    wait in a lane of their own (workers/kafka/lanes.py) and partition 1 goes on."""
    settings = KafkaSettings(bootstrap_servers=cluster.bootstrap_servers, topic_prefix=f"cl-{uuid.uuid4().hex[:6]}")
    victim = 3
    await _create_placed_topics(settings, victim)
    pipeline = Pipeline(settings, tiny_model_dir)
    held, free = _on_partition("held", 0, 300), _on_partition("free", 1, 20)  # ~15 s and ~1 s at 20 tokens/s
    gaps: list[float] = []
    down = False
    try:
        await pipeline.started()
        async with GenpipeClient(settings=settings, timeout_s=180) as client:
            held_task = asyncio.ensure_future(_stream(client, held, gaps))
            await _wait(lambda: len(gaps) >= 3, 60, "the first results of the request on partition 0")
            await asyncio.to_thread(node_down, cluster, victim, kill=True)
            down, down_at = True, time.monotonic()
            try:
                free_done = await asyncio.wait_for(_stream(client, free, []), FREE_WITHIN_S)
            except asyncio.TimeoutError:
                raise AssertionError(f"the request on partition 1 did not finish within {FREE_WITHIN_S} s of "
                                     f"chunks[0]'s broker going away: it waited for that partition") from None
            took = time.monotonic() - down_at
            await asyncio.to_thread(node_up, cluster, victim)
            down = False
            held_done = await asyncio.wait_for(held_task, 240)
        assert pipeline.alive(), "a worker stopped"
    finally:
        if down:
            await asyncio.to_thread(node_up, cluster, victim)
        results = await pipeline.close()
    assert results == [0, 0]
    _assert_uninterrupted(tiny_model_dir, [held, free], [held_done, free_done])
    print(f"\ncluster leaderless chunks[0]: the request on partition 1 finished {took:.1f} s after its broker "
          f"went away; the one on partition 0 after it came back")


FREE_WITHIN_S = 20  # a 20-token request takes ~1 s; a lane opens after 1 s of a stuck partition


async def _create_placed_topics(settings, victim: int) -> None:
    """genpipe's topics, 2 partitions, 1 replica each: chunks[0] on broker `victim`, every
    other partition on the other brokers (1-3)."""
    from aiokafka.admin import NewTopic

    others = [b for b in (1, 2, 3) if b != victim]
    admin = make_admin(settings)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(
            settings.topic(role), -1, -1,
            replica_assignments={0: [victim if role == "chunks" else others[0]], 1: [others[1]]},
            topic_configs={"min.insync.replicas": "1"}) for role in TOPIC_ROLES])
    finally:
        await admin.close()
    await create_topics(settings, partitions=2, replication_factor=1)  # (they exist: waits for their leaders)
    leaders = await _leaders(settings, settings.topic("chunks"))
    assert leaders == {0: victim, 1: others[1]}, leaders


def _on_partition(tag: str, partition: int, max_tokens: int):
    """A request whose id the client's producer sends to `partition` of 2 (murmur2, as
    aiokafka's default partitioner): it stays on that partition number end to end."""
    from aiokafka.partitioner import murmur2

    i = next(i for i in range(1000) if (murmur2(f"{tag}-{i}".encode()) & 0x7FFFFFFF) % 2 == partition)
    return make_request([1, 100 + 7 * i, 200 + i], kind="completion", request_id=f"{tag}-{i}", max_tokens=max_tokens,
                        temperature=0, ignore_eos=True, stream=True)


AWAY_S = 45  # past the producers' request timeout (30 s: workers/kafka/clients.py)
REBALANCE_AWAY_S = 25  # under the consumers' session timeout (30 s): the group does not drop the waiting worker


@pytest.mark.parametrize("worker, topic", [("generate", "chunks"), ("derender", "results")])
async def test_a_worker_joins_while_a_partition_has_no_leader_and_the_group_does_not_wait_for_it(
        cluster, tiny_model_dir, monkeypatch, worker, topic):
    """A rebalance while the broker of a one-replica partition the worker publishes to is
    away. The generate worker giving partitions up waited for its records to that
    partition to be acknowledged, with no end, and the whole group's rebalance with it
    (until the broker came back, or the group dropped the worker after its session
    timeout, 30 s, while it still ran its requests). Now it waits at most
    REBALANCE_WAIT_S (workers/kafka/publisher.py; 3 s here, so that the broker, away 25 s,
    is still away with margin on a slow machine), and the new worker gets its partitions
    while the broker is away. Nothing is lost."""
    monkeypatch.setattr("workers.generate.worker.REBALANCE_WAIT_S", 3.0)
    from workers.derender.service import DerenderWorkerConfig, run_derender_worker
    from workers.generate.engine import Engine
    from workers.generate.service import GenerateWorkerConfig, run_generate_worker

    settings = KafkaSettings(bootstrap_servers=cluster.bootstrap_servers, topic_prefix=f"cl-{uuid.uuid4().hex[:6]}")
    await create_topics(settings, partitions=2, replication_factor=1)
    pipeline = Pipeline(settings, tiny_model_dir)
    requests = _requests(f"joins-{worker}", 8, 400)
    gaps: list[float] = []
    joined, stop_second = asyncio.Event(), asyncio.Event()
    second = None
    try:
        await pipeline.started()
        async with GenpipeClient(settings=settings, timeout_s=180) as client:
            tasks = [asyncio.ensure_future(_stream(client, r, gaps)) for r in requests]
            await _wait(lambda: len(gaps) >= 8, 60, "first results")
            victim = (await _leaders(settings, settings.topic(topic)))[0]
            await asyncio.to_thread(node_down, cluster, victim, kill=True)
            back_at = time.monotonic() + REBALANCE_AWAY_S
            if worker == "generate":
                second = asyncio.ensure_future(run_generate_worker(
                    settings, GenerateWorkerConfig(group_id=f"{settings.topic_prefix}-generate", max_batch=8,
                                                   min_step_s=0.05),
                    engine=Engine(str(tiny_model_dir), max_batch=8), stop=stop_second, on_ready=joined.set))
            else:
                second = asyncio.ensure_future(run_derender_worker(
                    settings, DerenderWorkerConfig(tokenizer=str(tiny_model_dir),
                                                   group_id=f"{settings.topic_prefix}-derender"),
                    stop=stop_second, on_ready=joined.set))
            await _wait(lambda: joined.is_set() or time.monotonic() > back_at or second.done(), REBALANCE_AWAY_S + 5,
                        "the second worker or the broker")
            joined_before_the_broker = joined.is_set() and time.monotonic() < back_at
            await _wait(lambda: time.monotonic() > back_at, REBALANCE_AWAY_S + 5, "the outage")
            await asyncio.to_thread(node_up, cluster, victim)
            done = await asyncio.wait_for(asyncio.gather(*tasks), 240)
        assert pipeline.alive() and not second.done(), "a worker stopped"
    finally:
        stop_second.set()
        results = await pipeline.close()
        if second is not None:
            results.append(await asyncio.wait_for(second, 120))
    assert joined_before_the_broker, "the group's rebalance waited for the broker that was away"
    assert results == [0, 0, 0]
    _assert_uninterrupted(tiny_model_dir, requests, done)
    print(f"\ncluster rebalance without a leader ({worker}): {len(requests)} requests, 0 lost; "
          f"restarts seen {sum(r for _, r in done)}")


async def test_a_client_started_while_a_partition_of_its_reply_topic_has_no_leader_says_why(cluster):
    """A client needs every partition of its reply topic to find where to read from. With
    one without a leader (one replica, its broker away) it failed after the consumer's
    request timeout with aiokafka's bare "KafkaTimeoutError: Failed to get offsets by
    times in 40000 ms"; it now raises GenpipeUnavailable, which says what to check (the
    gateway answers 503 with it, a caller catches it with the other unavailable cases)."""
    from workers.results import GenpipeUnavailable

    settings = KafkaSettings(bootstrap_servers=cluster.bootstrap_servers, topic_prefix=f"cl-{uuid.uuid4().hex[:6]}")
    await create_topics(settings, partitions=2, replication_factor=1)
    victim = (await _leaders(settings, settings.topic("results")))[0]
    await asyncio.to_thread(node_down, cluster, victim, kill=True)
    try:
        with pytest.raises(GenpipeUnavailable) as raised:
            async with GenpipeClient(settings=settings):
                pass
    finally:
        await asyncio.to_thread(node_up, cluster, victim)
    message = str(raised.value)
    assert message.startswith(f"genpipe client: could not find where to read {settings.topic('results')} from (")
    assert "does every partition of it have a leader?" in message


def _assert_uninterrupted(model_dir, requests, done: list[tuple[str, int]]) -> None:
    """Each request's last attempt reads as the same request run without any failure."""
    expected = uninterrupted_texts(model_dir, requests)
    for request, (text, _) in zip(requests, done):
        assert text == expected[request.request_id], request.request_id


async def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)
