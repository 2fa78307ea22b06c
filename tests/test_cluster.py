"""genpipe on a 3-broker cluster (`genpipe broker up --brokers 3`): brokers die and
restart under load, and no request is lost, duplicated after the client, or stalled."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import NewTopic

from schemas import Cancel
from tests.cluster_helpers import (Pipeline, assert_uninterrupted, controller_id, create_placed_topics, on_partition,
                                   partition_leaders, requests_for, stream, wait_for_leaders)
from tests.kafka_helpers import read_topic, wait_for
from tests.process_helpers import uninterrupted_texts
from workers.broker.cluster import cluster_up, node_down, node_up
from workers.broker.topics import create_topics
from workers.client import GenpipeClient
from workers.kafka.clients import make_admin, make_producer
from workers.kafka.publisher import Publisher
from workers.kafka.records import Outgoing, decode_message
from workers.kafka.settings import KafkaSettings

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
        # A plain `broker down` (no --brokers) stops every node of the cluster's data dir: it
        # looked for a single broker and said there was none (with --brokers 1 it stopped
        # node 1 alone), and the JVMs ran on
        down = subprocess.run([sys.executable, "-m", "workers.cli", "broker", "down", "--port", str(PORT),
                               "--data-dir", str(data_dir)], capture_output=True, text=True, timeout=180,
                              cwd=Path(__file__).resolve().parents[1])
    assert down.returncode == 0 and "stopped nodes [1, 2, 3]" in down.stdout, (down.stdout, down.stderr)
    assert [node.node_id for node in cluster.nodes if node.pid() is not None] == []


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


async def test_killing_partition_leaders_and_the_controller_loses_no_request(cluster, tiny_model_dir):
    settings = KafkaSettings(bootstrap_servers=cluster.bootstrap_servers, topic_prefix=f"cl-{uuid.uuid4().hex[:6]}")
    await create_topics(settings, partitions=2)
    pipeline = Pipeline(settings, tiny_model_dir)
    requests = requests_for("kill", 8, 300)  # ~15 s each at 20 tokens/s: both kills land mid-stream
    gaps: list[float] = []
    killed = []
    try:
        await pipeline.started()
        async with GenpipeClient(settings=settings, timeout_s=180) as client:
            tasks = [asyncio.ensure_future(stream(client, r, gaps)) for r in requests]
            await wait_for(lambda: len(gaps) >= 8, 60, "first results")
            # kill -9 the leader of the chunk partition 0 (it leads some result partitions too)
            victim = (await partition_leaders(settings, settings.topic("chunks")))[0]
            await asyncio.to_thread(node_down, cluster, victim, kill=True)
            killed.append(victim)
            # Results keep coming after the kill (how many depends on how tokens were
            # chunked, which a lagging producer changes: count progress, not chunks).
            seen = len(gaps)
            await wait_for(lambda: len(gaps) >= seen + 16, 120, "streams going on after the kill")
            await asyncio.to_thread(node_up, cluster, victim)
            # then the active controller
            controller = await controller_id(settings)
            await asyncio.to_thread(node_down, cluster, controller, kill=True)
            killed.append(controller)
            done = await asyncio.wait_for(asyncio.gather(*tasks), 240)
            await asyncio.to_thread(node_up, cluster, controller)
        assert pipeline.alive(), "a worker stopped"
    finally:
        results = await pipeline.close()
    assert results == [0, 0]
    assert_uninterrupted(tiny_model_dir, requests, done)
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
                    request = requests_for(f"roll{i}", 1, 20)[0]
                    sent.append(request)
                    done.append(asyncio.ensure_future(stream(client, request, gaps)))
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
    requests = requests_for("leaderless", 8, 400)  # ~20 s each at 20 tokens/s: the outage lands mid-stream
    gaps: list[float] = []
    try:
        await pipeline.started()
        async with GenpipeClient(settings=settings, timeout_s=120) as client:
            tasks = [asyncio.ensure_future(stream(client, r, gaps)) for r in requests]
            await wait_for(lambda: len(gaps) >= 8, 60, "first results")
            victim = (await partition_leaders(settings, settings.topic("chunks")))[0]
            await asyncio.to_thread(node_down, cluster, victim, kill=True)
            away_until = time.monotonic() + AWAY_S
            await wait_for(lambda: time.monotonic() > away_until or not pipeline.alive(), AWAY_S + 5, "the outage")
            await asyncio.to_thread(node_up, cluster, victim)
            done = await asyncio.wait_for(asyncio.gather(*tasks), 240)
        assert pipeline.alive(), "a worker stopped"
    finally:
        results = await pipeline.close()
    assert results == [0, 0]
    assert_uninterrupted(tiny_model_dir, requests, done)
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
    await create_placed_topics(settings, victim)
    pipeline = Pipeline(settings, tiny_model_dir)
    held, free = on_partition("held", 0, 300), on_partition("free", 1, 20)  # ~15 s and ~1 s at 20 tokens/s
    gaps: list[float] = []
    down = False
    try:
        await pipeline.started()
        async with GenpipeClient(settings=settings, timeout_s=180) as client:
            held_task = asyncio.ensure_future(stream(client, held, gaps))
            await wait_for(lambda: len(gaps) >= 3, 60, "the first results of the request on partition 0")
            await asyncio.to_thread(node_down, cluster, victim, kill=True)
            down, down_at = True, time.monotonic()
            try:
                free_done = await asyncio.wait_for(stream(client, free, []), FREE_WITHIN_S)
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
    assert_uninterrupted(tiny_model_dir, [held, free], [held_done, free_done])
    print(f"\ncluster leaderless chunks[0]: the request on partition 1 finished {took:.1f} s after its broker "
          f"went away; the one on partition 0 after it came back")


FREE_WITHIN_S = 20  # a 20-token request takes ~1 s; a lane opens after 1 s of a stuck partition


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
    requests = requests_for(f"joins-{worker}", 8, 400)
    gaps: list[float] = []
    joined, stop_second = asyncio.Event(), asyncio.Event()
    second = None
    try:
        await pipeline.started()
        async with GenpipeClient(settings=settings, timeout_s=180) as client:
            tasks = [asyncio.ensure_future(stream(client, r, gaps)) for r in requests]
            await wait_for(lambda: len(gaps) >= 8, 60, "first results")
            victim = (await partition_leaders(settings, settings.topic(topic)))[0]
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
            await wait_for(lambda: joined.is_set() or time.monotonic() > back_at or second.done(), REBALANCE_AWAY_S + 5,
                        "the second worker or the broker")
            joined_before_the_broker = joined.is_set() and time.monotonic() < back_at
            await wait_for(lambda: time.monotonic() > back_at, REBALANCE_AWAY_S + 5, "the outage")
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
    assert_uninterrupted(tiny_model_dir, requests, done)
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
    victim = (await partition_leaders(settings, settings.topic("results")))[0]
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


async def test_a_publish_step_hands_over_partitions_with_room_first_and_waits_for_the_others_together(
        cluster, monkeypatch):
    """Three partitions on a broker that dies (one replica each), a fourth elsewhere, all
    in one publish step whose batches fill the dead partitions' queues. The step waited
    STUCK_AFTER_S (1 s) for each dead partition in turn, in partition order, before the
    next: every partition's tokens, and the engine behind them, stalled 1 s for each
    partition the broker led. Now the live partition's batch is handed over at once and
    the dead ones wait together, once, then go to their lanes (workers/kafka/lanes.py).
    Nothing is lost or reordered once the broker is back."""
    stuck_after = 4.0  # (1 s by default: longer here, so that the step's waits are told apart)
    monkeypatch.setattr("workers.kafka.publisher.STUCK_AFTER_S", stuck_after)
    settings = KafkaSettings(bootstrap_servers=cluster.bootstrap_servers, topic_prefix=f"cl-{uuid.uuid4().hex[:6]}")
    topic, victim, live = settings.topic("chunks"), 3, 3  # partition 3 on broker 1
    admin = make_admin(settings)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, -1, -1, replica_assignments={0: [victim], 1: [victim], 2: [victim],
                                                                                 3: [1]})])
    finally:
        await admin.close()
    await wait_for_leaders(lambda leaders: all(leaders.get(p, -1) >= 0 for p in range(4)), settings, topic,
                           "the topic's leaders")
    producer = make_producer(settings)
    await producer.start()
    down = False
    try:
        publisher = Publisher(producer, settings.topic("dlq"))
        assert await publisher.partition_count(topic) == 4
        await asyncio.to_thread(node_down, cluster, victim, kill=True)
        down = True
        # Until the cluster fences the broker (3 s), its partitions still name it leader.
        await wait_for_leaders(lambda leaders: all(leaders[p] < 0 for p in range(3)), settings, topic,
                               "the dead broker's partitions to lose their leader")
        await producer.client.force_metadata_update()
        assert all(producer.client.cluster.leader_for_partition(TopicPartition(topic, p)) in (None, -1)
                   for p in range(3))

        # Per dead partition: two ~100 KB records fill a batch (256 KB), the third starts one
        # that finds the partition's queue full.
        records = [Outgoing(topic, f"p{p}", Cancel(request_id=f"p{p}-{i}", reason="x" * 100_000), partition=p)
                   for p in range(3) for i in range(3)]
        records.append(Outgoing(topic, "live", Cancel(request_id="live-0"), partition=live))
        started = time.monotonic()
        step = asyncio.ensure_future(publisher.publish_batch(records))
        await wait_for(lambda: publisher.published >= 1 or step.done(), 60, "the live partition's record or the step")
        assert not step.done(), "the live partition's record was handed over only after the dead ones were waited for"
        try:
            futures = await asyncio.wait_for(step, 2 * stuck_after)
        except asyncio.TimeoutError:
            raise AssertionError("the step waited for its dead partitions one after another") from None
        took = time.monotonic() - started
        assert all(TopicPartition(topic, p) in publisher.lanes for p in range(3))
        assert futures[-1].done() and futures[-1].exception() is None

        await asyncio.to_thread(node_up, cluster, victim)
        down = False
        await asyncio.wait_for(asyncio.gather(*futures), 120)
    finally:
        if down:
            await asyncio.to_thread(node_up, cluster, victim)
        await producer.stop()
    read = await read_topic(settings, topic, until=lambda r: len(r) >= len(records))
    by_partition: dict[int, list[str]] = {}
    for record in read:
        by_partition.setdefault(record.partition, []).append(decode_message(record, Cancel).request_id)
    assert by_partition == {**{p: [f"p{p}-{i}" for i in range(3)] for p in range(3)}, live: ["live-0"]}
    print(f"\ncluster publish step with 3 partitions away: {took:.1f} s (STUCK_AFTER_S {stuck_after:.0f} s); "
          f"the live partition's record acknowledged before it ended")




async def test_a_dlq_copy_or_a_lone_record_for_a_partition_without_a_leader_waits_in_a_lane(cluster):
    """DLQ copies and records sent alone (an error in place of a refused record, a reply
    topic's first result) went through aiokafka's send(): once their partition's batch
    was full and the partition had no leader, the send waited the producer's request
    timeout (30 s), was tried again, and so on until the broker came back, and the
    worker's loop with it. Now they go as a publish step's records do: after
    STUCK_AFTER_S into a lane, and the caller goes on. Nothing is lost or reordered once
    the broker is back."""
    from aiokafka.structs import ConsumerRecord

    from workers.kafka.topic_metadata import key_partition

    settings = KafkaSettings(bootstrap_servers=cluster.bootstrap_servers, topic_prefix=f"cl-{uuid.uuid4().hex[:6]}")
    dlq, victim = settings.topic("dlq"), 3
    admin = make_admin(settings)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(dlq, -1, -1, replica_assignments={0: [victim], 1: [1]})])
    finally:
        await admin.close()
    await wait_for_leaders(lambda leaders: all(leaders.get(p, -1) >= 0 for p in range(2)), settings, dlq,
                           "the topic's leaders")
    dead_key = next(k for k in (f"k{i}" for i in range(100)) if key_partition(k, 2) == 0)
    live_key = next(k for k in (f"k{i}" for i in range(100)) if key_partition(k, 2) == 1)

    def refused(offset: int, key: str) -> ConsumerRecord:  # ~100 KB: two fill a producer batch (256 KB)
        return ConsumerRecord(settings.topic("requests"), 0, offset, 0, 0, key.encode(), b"x" * 100_000, None,
                              len(key), 100_000, [])

    producer = make_producer(settings)
    await producer.start()
    down = False
    try:
        publisher = Publisher(producer, dlq)
        assert await publisher.partition_count(dlq) == 2
        await asyncio.to_thread(node_down, cluster, victim, kill=True)
        down = True
        await wait_for_leaders(lambda leaders: leaders[0] < 0, settings, dlq, "partition 0 to lose its leader")
        await producer.client.force_metadata_update()

        futures, took = [], []
        for offset in range(4):  # the third found the partition's queue full and waited for good
            started = time.monotonic()
            try:
                futures.append(await asyncio.wait_for(publisher.to_dlq(refused(offset, dead_key), "bad"), 15))
            except asyncio.TimeoutError:
                raise AssertionError(f"DLQ copy {offset} held its caller while its partition had no leader") from None
            took.append(time.monotonic() - started)
        assert TopicPartition(dlq, 0) in publisher.lanes
        alone = await asyncio.wait_for(publisher.publish(Outgoing(dlq, dead_key, Cancel(request_id="alone"))), 15)
        live = await asyncio.wait_for(publisher.to_dlq(refused(4, live_key), "bad"), 15)
        await asyncio.wait_for(live, 30)  # acknowledged while the other partition has no leader
        assert not any(f.done() for f in futures + [alone])

        await asyncio.to_thread(node_up, cluster, victim)
        down = False
        await asyncio.wait_for(asyncio.gather(*futures, alone), 120)
    finally:
        if down:
            await asyncio.to_thread(node_up, cluster, victim)
        await producer.stop()
    read = await read_topic(settings, dlq, until=lambda r: len(r) >= 6)
    by_partition: dict[int, list] = {}
    for record in read:
        by_partition.setdefault(record.partition, []).append(
            dict(record.headers).get("genpipe-dlq-source-offset", b"alone").decode())
    assert by_partition == {0: ["0", "1", "2", "3", "alone"], 1: ["4"]}
    print(f"\nDLQ copies for a partition without a leader: each handed over in {max(took):.1f} s at most")


async def test_a_reply_topic_without_a_leader_holds_only_its_own_results(cluster, tiny_model_dir):
    """A client's reply topic with one replica, on a broker that dies, while the derender
    has ~450 KB of results for it. It sent a reply topic's results one by one: once the
    partition's producer batch was full, a send waited the producer's request timeout and
    was tried again, for good, and the derender's loop with it. Every other client's
    results waited until that broker came back. Now they go in the derender's producer
    batches, and the partition's wait in a lane of their own (workers/kafka/lanes.py):
    a request for the results topic, sent after them, is answered while the broker is away;
    the reply topic's results all arrive once it is back."""
    from prometheus_client import REGISTRY

    from schemas import OutputOptions
    from tests.derender_support import make_chunks, position
    from tests.test_derender_worker import all_final, produce_chunks, start_worker
    from workers.kafka.settings import TOPIC_ROLES

    settings = KafkaSettings(bootstrap_servers=cluster.bootstrap_servers, topic_prefix=f"cl-{uuid.uuid4().hex[:6]}")
    victim, reply = 3, f"{settings.topic_prefix}.reply.away"
    admin = make_admin(settings)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(settings.topic(role), -1, -1, replica_assignments={0: [1]})
                                   for role in TOPIC_ROLES] + [NewTopic(reply, -1, -1, replica_assignments={0: [victim]})])
    finally:
        await admin.close()
    for topic in (settings.topic("chunks"), settings.topic("results"), reply):
        await wait_for_leaders(lambda leaders: leaders.get(0, -1) >= 0, settings, topic, f"{topic}'s leader")
    ids = [100 + (7 * i) % 900 for i in range(120)]
    logprobs = [position(t, [t, t + 1, t + 2, t + 3, t + 4], 5) for t in ids]
    # ~9 KB of JSON a result (k = 5): 50 fill the reply topic's producer batch (256 KB) about twice
    away = [make_chunks(f"away-{i}", ids, [120], positions=logprobs, prompt_tail=[1, 5], reply_topic=reply,
                        output=OutputOptions(kind="completion", stream=False, top_logprobs=5))[0] for i in range(50)]
    here = make_chunks("here", ids[:3], [1, 2], prompt_tail=[1, 5])
    stop, task = await start_worker(settings, tiny_model_dir)
    down = False
    try:
        await asyncio.to_thread(node_down, cluster, victim, kill=True)
        down = True
        await wait_for_leaders(lambda leaders: leaders[0] < 0, settings, reply, "the reply topic to lose its leader")
        results_made = REGISTRY.get_sample_value("genpipe_results_total", {"worker": "derender"}) or 0.0
        await produce_chunks(settings, away, {c.request_id: 0 for c in away})
        await wait_for(lambda: (REGISTRY.get_sample_value("genpipe_results_total", {"worker": "derender"}) or 0.0)
                       >= results_made + len(away), 60,
                       "the reply topic's results made (a derender stuck publishing some makes no more)")
        await produce_chunks(settings, here, {"here": 0})
        try:
            await read_topic(settings, settings.topic("results"), until=all_final({"here"}), timeout=30)
        except AssertionError:
            raise AssertionError("the results topic's request waited for the reply topic's broker") from None
        assert not task.done(), "the derender worker stopped"
        await asyncio.to_thread(node_up, cluster, victim)
        down = False
        replies = await read_topic(settings, reply, until=all_final({c.request_id for c in away}), timeout=120)
    finally:
        if down:
            await asyncio.to_thread(node_up, cluster, victim)
        stop.set()
    assert await asyncio.wait_for(task, 60) == 0
    assert sorted(r.key.decode() for r in replies) == sorted(c.request_id for c in away)  # once each, no error
