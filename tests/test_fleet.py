"""A fleet of generate workers on the real broker (docs/design.md §4 "Scheduling", §7):
priority and deadline order under a backlog, the bulk topic, out-of-order commits that a
new owner honours, and scale events that restart only the work that moved.

Synthetic-engine workers (`--engine synthetic`, in a thread) keep these fast and
independent of the CPU: what is asserted is who ran what, in which order, and how often.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import pytest
from aiokafka import TopicPartition

from schemas import GenerateChunk, GenerateRequest, SamplingParams, encode
from schemas.codec import headers_for
from tests.kafka_helpers import chunks_finished, committed_offsets, read_to_end, read_topic, wait_for
from tests.test_generate_worker import start_worker
from workers.kafka.clients import make_consumer, make_producer
from workers.kafka.offsets import FINISHED_PREFIX
from workers.kafka.records import decode_message
from workers.metrics import REBALANCES, series

pytestmark = pytest.mark.kafka


def req(rid: str, max_tokens: int, priority: int = 0, deadline_ms: int | None = None) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=[1, 2, 3], priority=priority, deadline_ms=deadline_ms,
                           sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def send(settings, requests, *, role: str = "requests", partition=lambda i, r: 0) -> None:
    producer = make_producer(settings)
    await producer.start()
    try:
        for i, r in enumerate(requests):
            await producer.send(settings.topic(role), encode(r), key=r.request_id.encode(),
                                headers=headers_for(r), partition=partition(i, r))
        await producer.flush()
    finally:
        await producer.stop()


def finals_in_order(records) -> list[GenerateChunk]:
    return [c for c in (decode_message(r, GenerateChunk) for r in records) if c.finish_reason is not None]


def attempts(records) -> dict[str, set[str]]:
    """request_id -> the attempts that published a chunk for it (2+: it was restarted)."""
    out = defaultdict(set)
    for record in records:
        chunk = decode_message(record, GenerateChunk)
        out[chunk.request_id].add(chunk.attempt)
    return out


async def first_chunk_of(settings, request_ids, timeout=60):
    wanted = set(request_ids)
    await read_topic(settings, settings.topic("chunks"), timeout=timeout,
                     until=lambda records: wanted <= {decode_message(r, GenerateChunk).request_id for r in records})


async def stop_worker(stop, task, timeout=60):
    stop.set()
    assert await asyncio.wait_for(task, timeout) == 0


async def test_interactive_requests_overtake_a_bulk_backlog_by_priority(kafka_settings, make_topics):
    await make_topics(kafka_settings, partitions=1)
    bulk = [req(f"bulk-{i}", 8, priority=10) for i in range(30)]
    stop, task = await start_worker(kafka_settings, None, engine="synthetic", engine_in="thread",
                                    synthetic_step_s=0.01, max_batch=2)
    try:
        await send(kafka_settings, bulk)
        await first_chunk_of(kafka_settings, ["bulk-0"])
        interactive = [req(f"chat-{i}", 4, priority=0) for i in range(3)]
        await send(kafka_settings, interactive)  # behind the whole backlog in the partition
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"), timeout=120,
                                   until=chunks_finished([r.request_id for r in bulk + interactive]))
    finally:
        await stop_worker(stop, task)
    order = [c.request_id for c in finals_in_order(records)]
    last_chat = max(order.index(r.request_id) for r in interactive)
    # Only the bulk requests already in the engine (2 running + 1 slot of headroom, and those
    # that finished before the chat requests arrived) may finish first.
    assert last_chat < 10, order
    assert all(c.finish_reason == "length" for c in finals_in_order(records))


async def test_bulk_topic_is_read_only_while_no_interactive_request_waits(kafka_settings, make_topics):
    """Same priority everywhere: the bulk topic alone keeps interactive requests in front."""
    await make_topics(kafka_settings, partitions=1)
    bulk = [req(f"bulk-{i}", 8) for i in range(40)]
    stop, task = await start_worker(kafka_settings, None, engine="synthetic", engine_in="thread",
                                    synthetic_step_s=0.01, max_batch=2)
    try:
        await send(kafka_settings, bulk, role="requests.bulk")
        await first_chunk_of(kafka_settings, ["bulk-0"])
        interactive = [req(f"chat-{i}", 4) for i in range(3)]
        await send(kafka_settings, interactive)
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"), timeout=120,
                                   until=chunks_finished([r.request_id for r in bulk + interactive]))
    finally:
        await stop_worker(stop, task)
    order = [c.request_id for c in finals_in_order(records)]
    assert max(order.index(r.request_id) for r in interactive) < 12, order
    assert len(order) == 43  # every bulk request ran too, once


@pytest.mark.parametrize("bulk_priority", [0, -5])
async def test_rows_kept_free_of_bulk_work_let_an_interactive_request_start_at_once(kafka_settings, make_topics,
                                                                                     bulk_priority):
    """The engine does not preempt; a batch full of long bulk requests would make an
    interactive one wait for the first of them to end. 1/16 of the rows stay free of bulk,
    and the interactive request takes one at once even behind bulk requests of a better
    priority, which wait at the head of the queue for bulk's rows (-5: admission stopped at
    that head, the free rows stayed idle, and the interactive request waited for every
    better bulk one)."""
    await make_topics(kafka_settings, partitions=1)
    bulk = [req(f"bulk-{i}", 300, priority=bulk_priority) for i in range(40)]  # ~3 s each; far more than a batch
    stop, task = await start_worker(kafka_settings, None, engine="synthetic", engine_in="thread",
                                    synthetic_step_s=0.01, max_batch=16)
    try:
        await send(kafka_settings, bulk, role="requests.bulk")
        await first_chunk_of(kafka_settings, ["bulk-0"])
        await send(kafka_settings, [req("chat", 2)])
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"), timeout=60,
                                   until=chunks_finished(["chat"]))
    finally:
        await stop_worker(stop, task, timeout=120)
    finals = [c.request_id for c in finals_in_order(records)]
    assert finals[0] == "chat", f"a bulk request ended first: {finals[:3]}"


async def test_a_bulk_request_handed_to_the_engine_first_waits_for_an_interactive_one_handed_after_it(
        kafka_settings, make_topics):
    """The worker hands the engine up to a quarter of a batch beyond its rows, best first
    as it reads them; a bulk request it handed while no interactive one waited sits in the
    engine's queue, and an interactive request handed after it must still take the next
    free row (the worker hands each request's tier with it)."""
    from prometheus_client import REGISTRY

    def in_flight() -> float:
        return REGISTRY.get_sample_value("genpipe_in_flight_requests", {"worker": "generate"}) or 0

    await make_topics(kafka_settings, partitions=1)
    # 8 rows, 2 more handed beyond them; the running requests end one by one, the first
    # after ~4 s at 10 ms steps, well after both others are handed
    running = [req(f"long-{i}", 400 + 40 * i) for i in range(8)]
    stop, task = await start_worker(kafka_settings, None, engine="synthetic", engine_in="thread",
                                    synthetic_step_s=0.01, max_batch=8)
    try:
        await send(kafka_settings, running)
        await first_chunk_of(kafka_settings, [r.request_id for r in running])
        await send(kafka_settings, [req("bulk", 2)], role="requests.bulk")
        await wait_for(lambda: in_flight() == 9, timeout=30, what="the bulk request handed to the engine")
        await send(kafka_settings, [req("chat", 2)])
        await wait_for(lambda: in_flight() == 10, timeout=30, what="the chat request handed to the engine")
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"), timeout=60,
                                   until=chunks_finished(["bulk", "chat"]))
    finally:
        await stop_worker(stop, task, timeout=120)
    finals = [c.request_id for c in finals_in_order(records)]
    assert finals[0] == "long-0", f"a row freed before both were handed: {finals}"
    assert finals.index("chat") < finals.index("bulk"), finals


async def test_a_request_stopped_and_read_again_at_once_runs_again_whole(kafka_settings, make_topics):
    """With the round-robin assignor every rebalance stops the running requests and reads
    their partitions again from the commit; a partition that comes back to the same worker
    runs its request again, as a new attempt, at once. The stopped copy's last tokens and
    its abort come back from the engine under the same request_id: they ended the new
    attempt (finish_reason abort, a stale token), and the new copy ran on in the engine for
    nobody. The new attempt now waits for the old one's end, and streams whole. (Steps of
    2 s, as a long prefill makes one: the record is read again ~40 ms after the stop, well
    inside the step; with 20 ms steps the old end was back first and this passed anyway.)"""
    await make_topics(kafka_settings, partitions=1)
    group = f"{kafka_settings.topic_prefix}-gen"
    stop, task = await start_worker(kafka_settings, None, engine="synthetic", engine_in="thread",
                                    synthetic_step_s=2.0, max_batch=4, assignor="roundrobin", group_id=group)
    # A member of the same group on another topic only: the rebalance it causes hands the
    # requests partition back to the worker (round-robin: stopped, read again).
    other = make_consumer(kafka_settings, group_id=group, heartbeat_interval_ms=100)
    try:
        await send(kafka_settings, [req("long", 12)])  # ~24 s: the rebalance comes in the middle
        await first_chunk_of(kafka_settings, ["long"])
        await other.start()
        other.subscribe([kafka_settings.topic("requests.bulk")])
        deadline = time.monotonic() + 60
        while not other.assignment():
            assert time.monotonic() < deadline, "the other member was never assigned"
            await other.getmany(timeout_ms=100)
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"), timeout=60,
                                   until=chunks_finished(["long"]))
        assert not task.done(), task.exception()
    finally:
        await other.stop()
        await stop_worker(stop, task)
    chunks = [decode_message(r, GenerateChunk) for r in records]
    assert len(attempts(records)["long"]) == 2, "the rebalance did not restart the request"
    last = [c for c in chunks if c.attempt == chunks[-1].attempt]
    assert [c.seq for c in last] == list(range(len(last)))
    assert [c.token_offset for c in last] == [sum(len(c.token_ids) for c in last[:i]) for i in range(len(last))]
    assert last[-1].finish_reason == "length" and sum(len(c.token_ids) for c in last) == 12


async def test_a_deadline_that_passes_while_queued_aborts_before_taking_a_slot(kafka_settings, make_topics):
    await make_topics(kafka_settings, partitions=1)
    stop, task = await start_worker(kafka_settings, None, engine="synthetic", engine_in="thread",
                                    synthetic_step_s=0.02, max_batch=1)
    try:
        long = [req(f"long-{i}", 100) for i in range(2)]  # 2 slots (1 + headroom), ~2 s each
        await send(kafka_settings, long)
        await first_chunk_of(kafka_settings, ["long-0"])
        late = req("late", 5, deadline_ms=int(time.time() * 1000) + 400)
        await send(kafka_settings, [late, req("after", 3)])
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"), timeout=60,
                                   until=chunks_finished(["long-0", "long-1", "late", "after"]))
    finally:
        await stop_worker(stop, task)
    chunks = [decode_message(r, GenerateChunk) for r in records]
    late_chunks = [c for c in chunks if c.request_id == "late"]
    assert len(late_chunks) == 1, "it never started: one final chunk, no tokens"
    (final,) = late_chunks
    assert final.finish_reason == "abort" and final.token_ids == []
    assert final.error is not None and final.error.type == "timeout"
    assert "deadline_ms" in final.error.message and "before the request started" in final.error.message
    order = [c.request_id for c in finals_in_order(records)]
    assert order.index("late") < order.index("long-0"), "expired while waiting, not when its turn came"


async def test_requests_finished_out_of_order_are_not_run_again_by_the_next_owner(kafka_settings, make_topics):
    await make_topics(kafka_settings, partitions=1)
    group = f"{kafka_settings.topic_prefix}-gen"
    tp = TopicPartition(kafka_settings.topic("requests"), 0)
    stop, task = await start_worker(kafka_settings, None, engine="synthetic", engine_in="thread",
                                    synthetic_step_s=0.02, max_batch=2, grace_s=0.0, commit_interval_s=0.1)
    short = [req(f"short-{i}", 2) for i in range(5)]
    try:
        await send(kafka_settings, [req("long", 1_500)])  # offset 0: ~30 s, still running when the worker stops
        await first_chunk_of(kafka_settings, ["long"])
        await send(kafka_settings, short)  # offsets 1-5, finish beside it
        await read_topic(kafka_settings, kafka_settings.topic("chunks"), timeout=60,
                         until=chunks_finished([r.request_id for r in short]))

        async def committed():
            return (await committed_offsets(kafka_settings, group, [tp])).get(tp)
        deadline = time.monotonic() + 30
        while True:  # the commit stops at `long` and names 1-5 finished
            om = await committed()
            if om is not None and om.offset == 0 and om.metadata == f"{FINISHED_PREFIX}6:0":
                break
            assert time.monotonic() < deadline, f"commit never said what finished: {om}"
            await asyncio.sleep(0.1)
    finally:
        await stop_worker(stop, task)  # grace 0: `long` is left for the next owner
    stop, task = await start_worker(kafka_settings, None, engine="synthetic", engine_in="thread",
                                    synthetic_step_s=0.0, max_batch=1)
    try:
        await send(kafka_settings, [req("next", 2)])
        await read_topic(kafka_settings, kafka_settings.topic("chunks"), timeout=60,
                         until=chunks_finished(["next"]))
    finally:
        await stop_worker(stop, task)
    runs = attempts(await read_to_end(kafka_settings, kafka_settings.topic("chunks")))
    assert all(len(runs[r.request_id]) == 1 for r in short), runs  # skipped, not re-run
    assert len(runs["long"]) == 2  # the unfinished one re-ran


def moved_partitions(records, partition_of) -> set[int]:
    """The request partitions whose requests ran more than once."""
    return {partition_of[rid] for rid, runs in attempts(records).items() if len(runs) > 1}


async def test_a_worker_joining_restarts_only_the_requests_of_partitions_that_moved(kafka_settings, make_topics):
    await make_topics(kafka_settings, partitions=4)
    requests = [req(f"r{i}", 150) for i in range(8)]  # 2 per partition, ~3 s each
    partition_of = {r.request_id: i % 4 for i, r in enumerate(requests)}
    common = dict(engine="synthetic", engine_in="thread", synthetic_step_s=0.02, max_batch=8)
    a_stop, a_task = await start_worker(kafka_settings, None, **common)
    b_stop = b_task = None
    try:
        await send(kafka_settings, requests, partition=lambda i, r: partition_of[r.request_id])
        await first_chunk_of(kafka_settings, partition_of)
        before = series(REBALANCES, "generate")._value.get()
        b_stop, b_task = await start_worker(kafka_settings, None, **common)  # scale out 1 -> 2
        await wait_for(lambda: series(REBALANCES, "generate")._value.get() >= before + 2, 30,
                       "both workers' new assignments")
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"), timeout=120,
                                   until=chunks_finished(partition_of))
    finally:
        for stop, task in ((a_stop, a_task), (b_stop, b_task)):
            if task is not None:
                await stop_worker(stop, task)
    moved = moved_partitions(records, partition_of)
    assert len(moved) <= 2, f"partitions restarted: {moved} (the joining worker's share is 2 of 4)"
    kept = set(range(4)) - moved
    assert all(len(attempts(records)[rid]) == 1 for rid, p in partition_of.items() if p in kept)


async def test_a_graceful_scale_in_restarts_nothing(kafka_settings, make_topics):
    """SIGTERM on one of two workers: its running requests finish within the grace period,
    its waiting ones are handed back unstarted, and the other worker takes them over."""
    await make_topics(kafka_settings, partitions=2)
    requests = [req(f"r{i}", 20) for i in range(16)]  # 0.4 s each, 2 (+1) at a time per worker
    partition_of = {r.request_id: i % 2 for i, r in enumerate(requests)}
    common = dict(engine="synthetic", engine_in="thread", synthetic_step_s=0.02, max_batch=2, grace_s=20.0)
    a_stop, a_task = await start_worker(kafka_settings, None, **common)
    b_stop, b_task = await start_worker(kafka_settings, None, **common)
    try:
        await send(kafka_settings, requests, partition=lambda i, r: partition_of[r.request_id])
        await first_chunk_of(kafka_settings, ["r0", "r1"])  # both workers busy
        await stop_worker(a_stop, a_task)  # scale in 2 -> 1
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"), timeout=120,
                                   until=chunks_finished(partition_of))
    finally:
        await stop_worker(b_stop, b_task)
    runs = attempts(records)
    assert {rid: len(runs[rid]) for rid in partition_of} == {rid: 1 for rid in partition_of}
    assert len(finals_in_order(records)) == len(requests)


async def test_a_static_member_restarting_quickly_causes_no_rebalance(kafka_settings, make_topics):
    await make_topics(kafka_settings, partitions=2)
    common = dict(engine="synthetic", engine_in="thread", synthetic_step_s=0.02, max_batch=2)
    b_stop, b_task = await start_worker(kafka_settings, None, group_instance_id="gen-b", **common)
    a_stop, a_task = await start_worker(kafka_settings, None, group_instance_id="gen-a", **common)
    try:
        before = series(REBALANCES, "generate")._value.get()
        await stop_worker(a_stop, a_task)  # a pod restart: gone and back within the session timeout
        a_stop, a_task = await start_worker(kafka_settings, None, group_instance_id="gen-a", **common)
        await send(kafka_settings, [req(f"r{i}", 3) for i in range(4)], partition=lambda i, r: i % 2)
        await read_topic(kafka_settings, kafka_settings.topic("chunks"), timeout=60,
                         until=chunks_finished([f"r{i}" for i in range(4)]))
        # Only the restarted worker's own assignment: a rebalance would have made the other
        # member rejoin too, and the restarted one is answered only once all have.
        assert series(REBALANCES, "generate")._value.get() == before + 1
    finally:
        await stop_worker(a_stop, a_task)
        await stop_worker(b_stop, b_task)
