"""The derender worker on the real broker: chunks in, results out, restarts lose nothing."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
from aiokafka import TopicPartition
from aiokafka.partitioner import DefaultPartitioner

from schemas import JSON, Cancel, ChatCompletionChunk, ErrorResponse, OutputOptions, encode, headers_for
from schemas.openai import OpenAIResult
from tests.derender_support import encode_ids, make_chunks, position
from tests.kafka_helpers import committed_offsets, read_to_end, read_topic, set_topic_config
from workers.cli import main
from workers.client import decode_result
from workers.derender.service import DerenderWorkerConfig, run_derender_worker
from workers.derender.state import Derenderer, Result
from workers.derender.worker import parse_published
from workers.kafka.clients import make_producer
from schemas.headers import HEADER_ATTEMPT, HEADER_FINAL, HEADER_SEQ
from schemas import decode_record

pytestmark = pytest.mark.kafka
PARTITIONS = 3


def synthetic_requests(tokenizer_dir, n: int, seed: int = 7):
    """n requests of random ids (byte pieces included), mixed kinds, streaming and logprobs."""
    rng = random.Random(seed)
    vocab = Derenderer(str(tokenizer_dir)).tables.size
    requests = {}
    for i in range(n):
        ids = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 12))]
        sizes, left = [], len(ids)
        while left:
            sizes.append(min(left, rng.randrange(1, 4)))
            left -= sizes[-1]
        with_lp = i % 3 == 0
        output = OutputOptions(kind="chat" if i % 2 else "completion", stream=i % 4 != 1,
                               top_logprobs=2 if with_lp else 0, include_usage=True, model="tiny")
        positions = [position(t, [t, (t + 1) % vocab, (t + 2) % vocab], 3) for t in ids] if with_lp else None
        requests[f"req-{i}"] = make_chunks(f"req-{i}", ids, sizes, output=output, positions=positions,
                                           prompt_tail=[1, 5, 6])
    return requests


def expected_results(tokenizer_dir, requests) -> dict[str, list]:
    derenderer = Derenderer(str(tokenizer_dir), model_name="genpipe-tiny")
    expected = {}
    for request_id, chunks in requests.items():
        expected[request_id] = [out.value for chunk in chunks for out in derenderer.process(chunk)
                                if isinstance(out, Result)]
    return expected


def interleave(requests, rng: random.Random):
    """Every request's chunks in order, requests interleaved at random."""
    queues = {rid: list(chunks) for rid, chunks in requests.items()}
    order = []
    while queues:
        rid = rng.choice(sorted(queues))
        order.append(queues[rid].pop(0))
        if not queues[rid]:
            del queues[rid]
    return order


async def produce_chunks(settings, chunks, partition_of):
    producer = make_producer(settings)
    await producer.start()
    try:
        for chunk in chunks:
            await producer.send(settings.topic("chunks"), encode(chunk), key=chunk.request_id.encode(),
                                headers=headers_for(chunk), partition=partition_of[chunk.request_id])
        await producer.flush()
    finally:
        await producer.stop()


def results_by_request(records):
    got: dict[str, list] = {}
    keys: dict[str, list] = {}
    for record in records:
        headers = dict(record.headers)
        assert headers["content-type"] == JSON.encode()
        value = decode_record(record.value, record.headers, OpenAIResult)
        rid = record.key.decode()
        got.setdefault(rid, []).append(value)
        keys.setdefault(rid, []).append((headers[HEADER_ATTEMPT], int(headers[HEADER_SEQ]), HEADER_FINAL in headers))
    return got, keys


def all_final(request_ids):
    return lambda records: request_ids <= {r.key.decode() for r in records if HEADER_FINAL in dict(r.headers)}


def decoded_by_request(records):
    """Each request's results (errors included) and their (attempt, seq, final) headers."""
    got: dict[str, list] = {}
    keys: dict[str, list] = {}
    for record in records:
        headers = dict(record.headers)
        rid = record.key.decode()
        got.setdefault(rid, []).append(decode_result(record.value, record.headers))
        keys.setdefault(rid, []).append((headers[HEADER_ATTEMPT].decode(), int(headers[HEADER_SEQ]),
                                         HEADER_FINAL in headers))
    return got, keys


async def replay_to_file(settings, tokenizer_dir, out_file, *options: str) -> list[dict]:
    """`genpipe replay --from 0 --out FILE OPTIONS...` of the test's chunk topic; its lines."""
    rc = await asyncio.to_thread(main, ["replay", "--bootstrap-servers", settings.bootstrap_servers,
                                        "--topic-prefix", settings.topic_prefix, "--from", "0",
                                        "--tokenizer", str(tokenizer_dir), *options, "--out", str(out_file)])
    assert rc == 0
    return [json.loads(line) for line in out_file.read_bytes().splitlines()]


async def start_worker(settings, tokenizer_dir, **config):
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.ensure_future(run_derender_worker(
        settings, DerenderWorkerConfig(tokenizer=str(tokenizer_dir), group_id=f"{settings.topic_prefix}-der",
                                       **config),
        stop=stop, on_ready=ready.set))
    await asyncio.wait_for(ready.wait(), 60)
    return stop, task


async def test_interleaved_requests_over_partitions_get_their_results_in_order(kafka_settings, make_topics,
                                                                             tiny_model_dir):
    await make_topics(kafka_settings, partitions=PARTITIONS)
    requests = synthetic_requests(tiny_model_dir, 30)
    expected = expected_results(tiny_model_dir, requests)
    partition_of = {rid: i % PARTITIONS for i, rid in enumerate(requests)}
    stop, task = await start_worker(kafka_settings, tiny_model_dir)
    try:
        await produce_chunks(kafka_settings, interleave(requests, random.Random(1)), partition_of)
        records = await read_topic(kafka_settings, kafka_settings.topic("results"), until=all_final(set(requests)))
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0
    got, keys = results_by_request(records)
    assert got == expected
    for record in records:  # results stay on their request's partition number
        assert record.partition == partition_of[record.key.decode()]
    for rid, entries in keys.items():
        assert [seq for _, seq, _ in entries] == sorted(seq for _, seq, _ in entries)
        assert [final for _, _, final in entries] == [False] * (len(entries) - 1) + [True]


async def test_restart_mid_stream_completes_every_request_without_republishing(kafka_settings, make_topics,
                                                                               tiny_model_dir):
    await make_topics(kafka_settings, partitions=PARTITIONS)
    requests = synthetic_requests(tiny_model_dir, 24, seed=11)
    expected = expected_results(tiny_model_dir, requests)
    partition_of = {rid: i % PARTITIONS for i, rid in enumerate(requests)}
    order = interleave(requests, random.Random(2))
    half = len(order) // 2
    first_half_finals = {c.request_id for c in order[:half] if c.finish_reason}

    stop, task = await start_worker(kafka_settings, tiny_model_dir)
    await produce_chunks(kafka_settings, order[:half], partition_of)
    await read_topic(kafka_settings, kafka_settings.topic("results"), until=all_final(first_half_finals))
    stop.set()  # SIGTERM-like: flush and commit with the published watermark
    assert await asyncio.wait_for(task, 60) == 0

    group = f"{kafka_settings.topic_prefix}-der"
    tps = [TopicPartition(kafka_settings.topic("chunks"), p) for p in range(PARTITIONS)]
    committed = await committed_offsets(kafka_settings, group, tps)
    open_requests = set(requests) - first_half_finals
    # unfinished requests pin the commit, and the metadata says how far results went out
    assert any(committed[tp].offset < parse_published(committed[tp].metadata) for tp in tps) or not open_requests
    before = await read_topic(kafka_settings, kafka_settings.topic("results"), until=all_final(first_half_finals))

    stop, task = await start_worker(kafka_settings, tiny_model_dir)
    try:
        await produce_chunks(kafka_settings, order[half:], partition_of)
        records = await read_topic(kafka_settings, kafka_settings.topic("results"), until=all_final(set(requests)))
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0
    got, keys = results_by_request(records)
    for rid, entries in keys.items():
        assert len(entries) == len(set(entries)), f"{rid}: a result was published twice"
    assert got == expected
    assert len(records) >= len(before)


async def test_results_over_the_record_size_limit_become_error_results_and_nothing_is_held(
        kafka_settings, make_topics, tiny_model_dir, tmp_path):
    # 4,000 bytes: a non-streamed answer of 120 tokens with 5 logprobs each (8.6 kB of JSON)
    # does not fit, nor does a streamed chat result for a chunk of 40 such tokens (11 kB),
    # while one for a single token does (0.5 kB). Kafka's
    # default limit is 1 MiB: a long non-streamed answer with top_logprobs=20 exceeds it.
    await make_topics(kafka_settings, partitions=1)
    vocab = Derenderer(str(tiny_model_dir)).tables.size
    ids = [100 + (7 * i) % 900 for i in range(120)]
    logprobs = [position(t, [t, t + 1, t + 2, t + 3, t + 4], 5) for t in ids]
    assert max(ids) + 4 < vocab
    whole = make_chunks("whole", ids, [4] * 30, positions=logprobs, prompt_tail=[1, 5],
                        output=OutputOptions(kind="completion", stream=False, top_logprobs=5))
    streamed = make_chunks("streamed", ids[:43], [1, 40, 1, 1], positions=logprobs[:43], prompt_tail=[1, 5],
                           output=OutputOptions(kind="chat", stream=True, top_logprobs=5))
    first = make_chunks("first", ids[:42], [40, 1, 1], positions=logprobs[:42], prompt_tail=[1, 5],
                        output=OutputOptions(kind="chat", stream=True, top_logprobs=5))
    small = make_chunks("small", ids[:3], [1, 2], prompt_tail=[1, 5], output=OutputOptions(kind="completion"))
    chunks = whole + streamed + first + small
    expected_small = expected_results(tiny_model_dir, {"small": small})["small"]

    stop, task = await start_worker(kafka_settings, tiny_model_dir, max_record_bytes=4000)
    try:
        await produce_chunks(kafka_settings, chunks, {"whole": 0, "streamed": 0, "first": 0, "small": 0})
        records = await read_topic(kafka_settings, kafka_settings.topic("results"),
                                   until=all_final({"whole", "streamed", "first", "small"}))
        cancels = await read_topic(kafka_settings, kafka_settings.topic("cancel"), until=lambda r: len(r) >= 2)
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0
    assert all(len(r.value) <= 4000 for r in records)
    got, keys = decoded_by_request(records)
    (error,) = got["whole"]  # in place of the final answer, with its headers
    assert isinstance(error, ErrorResponse) and error.error.type == "invalid_request_error"
    assert error.error.message.startswith("derender: result too large: ")
    assert "over the record size limit of 4000 bytes" in error.error.message
    assert keys["whole"] == [("a1", 29, True)]
    # streamed: the first chunk's result went out; the second's is an error that ends the
    # request, generate is asked to stop, and the chunks after it are ignored
    assert [seq for _, seq, _ in keys["streamed"]] == [0, 1] and keys["streamed"][-1][2]
    assert isinstance(got["streamed"][0], ChatCompletionChunk)
    assert got["streamed"][1].error.message.startswith("derender: result too large: ")
    # the same when the very first result is too large: one error result, nothing after it
    assert keys["first"] == [("a1", 0, True)] and isinstance(got["first"][0], ErrorResponse)
    assert [(c.key, decode_record(c.value, c.headers, Cancel).request_id) for c in cancels] == [
        (b"streamed", "streamed"), (b"first", "first")]
    assert got["small"] == expected_small
    # nothing held: the group committed past every chunk
    tp = TopicPartition(kafka_settings.topic("chunks"), 0)
    committed = await committed_offsets(kafka_settings, f"{kafka_settings.topic_prefix}-der", [tp])
    assert committed[tp].offset == len(chunks)

    # a replay with the workers' limit reproduces those records, the errors included
    replayed = await replay_to_file(kafka_settings, tiny_model_dir, tmp_path / "replayed.jsonl",
                                    "--max-record-bytes", "4000")
    assert [(r["key"], r["value"]) for r in replayed] == [(r.key.decode(), json.loads(r.value)) for r in records]


async def test_cancels_for_stop_strings_reach_their_keys_partitions_once_each(kafka_settings, make_topics,
                                                                              tiny_model_dir):
    # A stop string ends each request early: its final result says so, and generate is
    # asked (on the cancel topic) to stop it. The cancels of a loop turn go in the
    # producer's batches with the results, so each names its partition: it must be the one
    # the default partitioner picks for its key (as the gateway's cancels, sent without one),
    # not the chunk's.
    await make_topics(kafka_settings, partitions=PARTITIONS)
    tables = Derenderer(str(tiny_model_dir)).tables
    ids = encode_ids(tables, "one two three stop four five six seven")
    output = OutputOptions(kind="completion", stream=True, stop=["stop"])
    requests = {f"stop-{i}": make_chunks(f"stop-{i}", ids, output=output, prompt_tail=[1, 5]) for i in range(24)}
    partition_of = {rid: i % PARTITIONS for i, rid in enumerate(requests)}
    stop, task = await start_worker(kafka_settings, tiny_model_dir)
    try:
        await produce_chunks(kafka_settings, interleave(requests, random.Random(3)), partition_of)
        records = await read_topic(kafka_settings, kafka_settings.topic("results"), until=all_final(set(requests)))
        cancels = await read_topic(kafka_settings, kafka_settings.topic("cancel"),
                                   until=lambda r: len(r) >= len(requests))
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0
    got, _ = results_by_request(records)
    for rid in requests:
        assert got[rid][-1].choices[0].finish_reason == "stop"
        assert "".join(r.choices[0].text for r in got[rid]) == " one two three "
    partitioner = DefaultPartitioner()
    where = {c.key.decode(): c.partition for c in cancels}
    assert len(cancels) == len(requests) and set(where) == set(requests)  # one each
    assert all(decode_record(c.value, c.headers, Cancel).request_id == c.key.decode() for c in cancels)
    assert where == {rid: partitioner(rid.encode(), list(range(PARTITIONS)), None) for rid in requests}
    assert any(where[rid] != partition_of[rid] for rid in requests)  # (so the chunk's would not do)
    tps = [TopicPartition(kafka_settings.topic("chunks"), p) for p in range(PARTITIONS)]
    committed = await committed_offsets(kafka_settings, f"{kafka_settings.topic_prefix}-der", tps)
    assert sum(committed[tp].offset for tp in tps) == sum(len(chunks) for chunks in requests.values())


async def _handler_with_producer(settings, tokenizer_dir, **options):
    """The derender's handler on a real producer, as `serve` builds it; the test hands it
    records as the consumer loop does."""
    from workers.derender.worker import DerenderHandler
    from workers.kafka.offsets import PartitionOffsets
    from workers.kafka.publisher import Publisher

    producer = make_producer(settings)
    await producer.start()
    handler = DerenderHandler(settings, Publisher(producer, settings.topic("dlq")), PartitionOffsets(),
                              Derenderer(str(tokenizer_dir)), **options)
    return producer, handler


async def _hand_over(handler, tp: TopicPartition, offset: int, chunk) -> None:
    """The chunk at `offset` to the handler, as the consumer loop hands a record over."""
    from aiokafka.structs import ConsumerRecord

    handler.offsets.tracker(tp).seen(offset)
    await handler.handle(ConsumerRecord(tp.topic, 0, offset, 0, 0, chunk.request_id.encode(), encode(chunk),
                                        None, 0, 0, list(headers_for(chunk))))


async def test_a_request_answered_by_one_chunk_is_not_committed_past_before_its_result_is_acknowledged(
        kafka_settings, make_topics, tiny_model_dir):
    """A request that starts and ends in one chunk (an error, max_tokens 1) took no hold:
    once its chunk was handled the loop could commit past it, while its result still
    waited to be published and acknowledged; a worker that died then never answered it.
    Now the chunk stays held until the result is acknowledged."""
    from aiokafka.structs import ConsumerRecord

    from tests.kafka_helpers import wait_for

    await make_topics(kafka_settings, partitions=1)
    producer, handler = await _handler_with_producer(kafka_settings, tiny_model_dir)
    tp = TopicPartition(kafka_settings.topic("chunks"), 0)
    try:
        (one,) = make_chunks("one", [5])
        tracker = handler.offsets.tracker(tp)
        await handler.on_assigned([tp], {})
        tracker.seen(7)  # as the loop does before it hands the record over
        await handler.handle(ConsumerRecord(tp.topic, 0, 7, 0, 0, b"one", encode(one), None, 0, 0,
                                            list(headers_for(one))))
        assert tracker.committable() == 7  # its result is not even handed over yet
        await handler.tick()  # the turn's results go out
        await wait_for(lambda: handler.publisher.published == 1, what="the result acknowledged")
        assert tracker.committable() == 8 and handler.request_start == {}
        assert handler.commit_metadata(tp) == "published=8"
    finally:
        await producer.stop()


async def test_a_request_finished_but_not_acknowledged_at_a_revoke_is_answered_again_if_its_partition_comes_back(
        kafka_settings, make_topics, tiny_model_dir):
    """A revoke while a finished request's answer waits for the broker (its reply topic's
    leader away, say), and the partition assigned back to the same worker: it replays
    from the commit, which stayed below the request. It used to remember the request as
    finished and drop it there, and the new commits passed it while its only answer was
    still unacknowledged: lost for good if that answer then was (a lane dropped at
    shutdown). Now it answers it again, and the commit waits for that answer. The
    answers are the real producer's; those to the reply topic reach the handler once
    the test lets them (a broker of one cannot hold an acknowledgement back)."""
    from aiokafka.structs import OffsetAndMetadata

    from tests.kafka_helpers import create_topic, wait_for

    await make_topics(kafka_settings, partitions=1)
    slow = f"{kafka_settings.topic_prefix}.reply.slow"
    await create_topic(kafka_settings, slow)
    producer, handler = await _handler_with_producer(kafka_settings, tiny_model_dir)
    gate, held = asyncio.Event(), {}
    real_publish_batch = handler.publisher.publish_batch

    async def answers_to_slow_held(records, **kw):
        futures = await real_publish_batch(records, **kw)
        return [held.setdefault(f, asyncio.ensure_future(_when(gate, f))) if r.topic == slow else f
                for r, f in zip(records, futures)]
    handler.publisher.publish_batch = answers_to_slow_held
    tp = TopicPartition(kafka_settings.topic("chunks"), 0)
    log = [*make_chunks("open", [5, 6], output=OutputOptions(kind="completion")),
           *make_chunks("done", [7], output=OutputOptions(kind="completion"), reply_topic=slow)]
    log = [log[0], log[2], log[1]]  # "open" starts, "done" starts and ends, "open" ends

    async def read(offset: int) -> None:
        await _hand_over(handler, tp, offset, log[offset])
    try:
        await handler.on_assigned([tp], {})
        await read(0)
        await read(1)
        await handler.tick()  # "done"'s answer goes to the producer
        # the rebalance, as the loop runs it: revoke, commit, then the partition comes back
        await handler.on_revoked([tp])
        committed = OffsetAndMetadata(handler.offsets.tracker(tp).committable(), handler.commit_metadata(tp))
        assert committed == OffsetAndMetadata(0, "published=1")
        await handler.on_lost([tp])
        handler.offsets.drop(tp)
        await handler.on_assigned([tp], {tp: committed})
        for offset in range(3):
            await read(offset)
        await handler.tick()
        await wait_for(lambda: handler.publisher.published >= 2 and handler.publisher.in_flight == 0,
                       what="the broker's answers")
        assert handler.offsets.tracker(tp).committable() == 1  # held by "done", answered again
        gate.set()
        await wait_for(lambda: handler.offsets.tracker(tp).committable() == 3, what="the commit past 'done'")
    finally:
        gate.set()
        await producer.stop()
    answers = await read_to_end(kafka_settings, slow)
    assert [r.key for r in answers] == [b"done", b"done"]  # the client library drops the second:
    assert answers[0].headers == answers[1].headers  # the same attempt and seq


async def test_a_revoke_while_the_producer_takes_no_results_gives_the_partitions_up_within_its_bound(
        kafka_settings, make_topics, tiny_model_dir, monkeypatch, caplog):
    """A revoke hands the results waiting in the worker to the producer before the loop
    commits. With no room for them (the lanes full: a partition without a leader, 32 MiB
    waiting) that hand-over had no end, and the group's rebalance, every member's, waited
    with it. Now the revoke waits REBALANCE_WAIT_S (0.5 s here) and goes on; the commit
    stays below the result, which goes out later, before the results handled after it.
    The hand-over is the real producer's, held until the test lets it."""
    from aiokafka.structs import OffsetAndMetadata

    from tests.kafka_helpers import wait_for

    monkeypatch.setattr("workers.derender.worker.REBALANCE_WAIT_S", 0.5)
    await make_topics(kafka_settings, partitions=1)
    producer, handler = await _handler_with_producer(kafka_settings, tiny_model_dir)
    gate = asyncio.Event()
    real_publish_batch = handler.publisher.publish_batch

    async def no_room_yet(records, **kw):
        await gate.wait()
        return await real_publish_batch(records, **kw)
    handler.publisher.publish_batch = no_room_yet
    tp = TopicPartition(kafka_settings.topic("chunks"), 0)
    log = [*make_chunks("first", [5], output=OutputOptions(kind="completion")),
           *make_chunks("second", [6], output=OutputOptions(kind="completion"))]

    async def read(offset: int) -> None:
        await _hand_over(handler, tp, offset, log[offset])
    try:
        await handler.on_assigned([tp], {})
        await read(0)
        await asyncio.wait_for(handler.on_revoked([tp]), 10)  # (without the bound: until the gate opens)
        assert "results not handed to the producer within 0.5 s of a rebalance" in caplog.text
        # what the loop commits now: nothing past the result that waits
        assert handler.offsets.tracker(tp).committable() == 0 and handler.commit_metadata(tp) == "published=0"
        committed = OffsetAndMetadata(0, handler.commit_metadata(tp))
        await handler.on_lost([tp])  # the rest of the rebalance, as the loop runs it; the partition comes back
        handler.offsets.drop(tp)
        await handler.on_assigned([tp], {tp: committed})
        await read(0)
        await read(1)
        gate.set()
        await handler.tick()
        await wait_for(lambda: handler.offsets.tracker(tp).committable() == 2, what="the results acknowledged")
    finally:
        gate.set()
        await producer.stop()
    results = await read_to_end(kafka_settings, kafka_settings.topic("results"))
    # the first answer, late, and again from the replay (the client drops the copy by its
    # attempt and seq), before what was handled after it
    assert [r.key for r in results] == [b"first", b"first", b"second"]
    assert results[0].headers == results[1].headers


async def test_an_undecodable_chunk_is_not_published_past_in_the_commit_until_its_dlq_copy_is_answered(
        kafka_settings, make_topics, tiny_model_dir):
    """The commit's metadata (`published=N`) said "published" past an undecodable chunk
    whose DLQ copy was still on its way (the loop's hold kept only the offset): the
    partition's next owner replayed the chunk quietly, below that mark, and sent no copy,
    so a copy lost at shutdown was lost for good. The copy here is the real producer's,
    handed to the handler once the test lets it."""
    from aiokafka.structs import ConsumerRecord

    from tests.kafka_helpers import wait_for

    await make_topics(kafka_settings, partitions=1)
    producer, handler = await _handler_with_producer(kafka_settings, tiny_model_dir)
    gate = asyncio.Event()
    real_to_dlq = handler.publisher.to_dlq

    async def copy_held(message, error):
        return asyncio.ensure_future(_when(gate, await real_to_dlq(message, error)))
    handler.publisher.to_dlq = copy_held
    tp = TopicPartition(kafka_settings.topic("chunks"), 0)
    try:
        await handler.on_assigned([tp], {})
        handler.offsets.tracker(tp).seen(0)
        await handler.handle(ConsumerRecord(tp.topic, 0, 0, 0, 0, b"k", b"\xc1 not a chunk", None, 0, 0, []))
        assert handler.commit_metadata(tp) == "published=0" and handler.offsets.tracker(tp).committable() == 0
        gate.set()
        await wait_for(lambda: handler.commit_metadata(tp) == "published=1", what="the copy answered")
        assert handler.offsets.tracker(tp).committable() == 1
    finally:
        gate.set()
        await producer.stop()
    (copy,) = await read_to_end(kafka_settings, kafka_settings.topic("dlq"))
    assert copy.value == b"\xc1 not a chunk"


async def _when(gate: asyncio.Event, future: asyncio.Future):
    await gate.wait()
    return await future


async def test_a_chunk_whose_partition_is_revoked_while_its_reply_topic_is_looked_up_leaves_nothing_behind(
        kafka_settings, make_topics, tiny_model_dir):
    """A seq-0 chunk naming a reply topic not known yet waits for its lookup (a metadata
    round trip; up to 5 s for a missing topic). A revoke then: the partition's next owner
    reads the chunk again, so this worker publishes nothing of it and forgets the request
    it started (it kept its state and a hold for a partition it no longer owned). The
    lookup is the publisher's real one, held until the revoke has run."""
    from aiokafka.structs import ConsumerRecord

    from tests.kafka_helpers import create_topic

    await make_topics(kafka_settings, partitions=1)
    late = f"{kafka_settings.topic_prefix}.reply.late"
    await create_topic(kafka_settings, late)
    producer, handler = await _handler_with_producer(kafka_settings, tiny_model_dir)
    tp = TopicPartition(kafka_settings.topic("chunks"), 0)
    real_lookup, asked, revoked = handler.publisher.partition_count, asyncio.Event(), asyncio.Event()

    async def lookup_across_the_revoke(topic: str) -> int:
        asked.set()
        await revoked.wait()
        return await real_lookup(topic)
    handler.publisher.partition_count = lookup_across_the_revoke
    try:
        first = make_chunks("mid", [5, 6], output=OutputOptions(stream=True), reply_topic=late)[0]
        message = ConsumerRecord(tp.topic, 0, 0, 0, 0, b"mid", encode(first), None, 0, 0, list(headers_for(first)))
        handler.offsets.tracker(tp).seen(0)  # as the loop does before it hands a record over
        await handler.on_assigned([tp], {})
        handling = asyncio.ensure_future(handler.handle(message))
        await asyncio.wait_for(asked.wait(), 30)
        assert handler.derenderer.is_active("mid")  # rendered; its reply topic being looked up
        # the revoke, as the loop runs it for a derender (nothing kept)
        await handler.on_revoked([tp])
        await handler.on_lost([tp])
        handler.offsets.drop(tp)
        revoked.set()
        await asyncio.wait_for(handling, 30)
        assert not handler.derenderer.is_active("mid") and "mid" not in handler.request_start
        assert handler.offsets.partitions() == [] and handler._pending == []
    finally:
        await producer.stop()


async def test_a_request_whose_chunks_stop_coming_ends_with_an_error_and_its_partition_commits_on(
        kafka_settings, make_topics, tiny_model_dir, tmp_path):
    # "stalled" sends its first chunk and then nothing for 3 s of its partition's log time
    # (the chunks' timestamps) while "other" goes on, a chunk every 0.1 s: with
    # --stalled-request-s 2 it ends with an error result and a cancel, and its first chunk
    # no longer pins the commit (before, it did until a restart, which replayed the
    # partition from there). Its late final chunk is dropped. "slow" is alone on its
    # partition: its own next chunk comes 10 s of log time later, with nothing between (a
    # gap counts 0.2 s at most), and it goes on. The chunks carry the test's times: the
    # topic is set to keep the producer's (a deployment's keeps the broker's, below).
    await make_topics(kafka_settings, partitions=2)
    await set_topic_config(kafka_settings, kafka_settings.topic("chunks"), {"message.timestamp.type": "CreateTime"})
    tables = Derenderer(str(tiny_model_dir)).tables
    ids = encode_ids(tables, "one two three four five six")
    stream = OutputOptions(kind="completion", stream=True)
    stalled = make_chunks("stalled", ids, [2, len(ids) - 2], output=stream)
    other = make_chunks("other", ids * 5, output=stream)
    slow = make_chunks("slow", ids, [3, len(ids) - 3], output=stream)
    t0 = int(time.time() * 1000)
    timed = ([(stalled[0], 0, t0), (slow[0], 1, t0)] + [(c, 0, t0 + 100 * (i + 1)) for i, c in enumerate(other)]
             + [(stalled[1], 0, t0 + 100 * (len(other) + 1)), (slow[1], 1, t0 + 10_000)])
    assert len(other) * 100 > 2000
    expected_other = expected_results(tiny_model_dir, {"other": other})["other"]
    expected_slow = expected_results(tiny_model_dir, {"slow": slow})["slow"]
    group = f"{kafka_settings.topic_prefix}-der"
    tps = [TopicPartition(kafka_settings.topic("chunks"), p) for p in (0, 1)]
    ends = {tps[0]: 2 + len(other), tps[1]: 2}

    stop, task = await start_worker(kafka_settings, tiny_model_dir, stalled_request_s=2.0)
    try:
        producer = make_producer(kafka_settings)
        await producer.start()
        try:
            for chunk, partition, timestamp in timed:
                await producer.send(kafka_settings.topic("chunks"), encode(chunk), key=chunk.request_id.encode(),
                                    headers=headers_for(chunk), partition=partition, timestamp_ms=timestamp)
            await producer.flush()
        finally:
            await producer.stop()
        deadline = time.monotonic() + 60
        while {tp: c.offset for tp, c in (await committed_offsets(kafka_settings, group, tps)).items()} != ends:
            assert time.monotonic() < deadline, "the group did not commit past every chunk"
            await asyncio.sleep(0.1)
        records = await read_topic(kafka_settings, kafka_settings.topic("results"),
                                   until=all_final({"stalled", "other", "slow"}))
        cancels = await read_topic(kafka_settings, kafka_settings.topic("cancel"), until=lambda r: len(r) >= 1)
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0
    records = await read_to_end(kafka_settings, kafka_settings.topic("results"))  # the late chunk's handled too
    got, keys = decoded_by_request(records)
    assert got["other"] == expected_other and got["slow"] == expected_slow
    assert keys["stalled"] == [("a1", 0, False), ("a1", 1, True)]  # one final: the error
    error = got["stalled"][1]
    assert isinstance(error, ErrorResponse)
    assert "no output for request 'stalled' for 2 s of its partition's log" in error.error.message
    assert [(c.key, decode_record(c.value, c.headers, Cancel).request_id) for c in cancels] == [
        (b"stalled", "stalled")]

    # a replay with the workers' setting ends the same request at the same chunk
    replayed: dict[str, list] = {}
    for entry in await replay_to_file(kafka_settings, tiny_model_dir, tmp_path / "replayed.jsonl",
                                      "--stalled-request-s", "2"):
        replayed.setdefault(entry["key"], []).append((entry["value"], entry["headers"]))
    worker: dict[str, list] = {}
    for r in records:
        worker.setdefault(r.key.decode(), []).append((json.loads(r.value), {k: v.decode() for k, v in r.headers}))
    assert replayed == worker


async def test_a_stalled_request_s_error_keeps_to_the_reply_topic_rule_and_a_hold_left_behind_goes(
        kafka_settings, make_topics, tiny_model_dir):
    """Two more ends of the stall check. "foreign" is not streamed and names the requests
    topic as its reply topic (a seq 0 from another producer: generate holds requests to the
    rule, this chunk did not come through it); it published nothing, so its reply topic
    was never checked, and its error must go to the results topic, not there. "answered"
    was ended another way (a refused result answered in its place) and no chunk of it came
    since: the hold of its first chunk must go (it pinned the commit for good)."""
    from aiokafka.structs import ConsumerRecord

    from tests.kafka_helpers import wait_for

    await make_topics(kafka_settings, partitions=1)
    producer, handler = await _handler_with_producer(kafka_settings, tiny_model_dir, stalled_request_s=1.0)
    tp = TopicPartition(kafka_settings.topic("chunks"), 0)
    ids = encode_ids(handler.derenderer.tables, "one two three")
    foreign = make_chunks("foreign", ids, output=OutputOptions(stream=False),
                          reply_topic=kafka_settings.topic("requests"))
    answered = make_chunks("answered", ids, output=OutputOptions(stream=True))
    other = make_chunks("other", ids * 10, output=OutputOptions(stream=True))
    t0 = int(time.time() * 1000)
    timed = [(foreign[0], t0), (answered[0], t0)] + [(c, t0 + 100 * (i + 1)) for i, c in enumerate(other)]
    try:
        tracker = handler.offsets.tracker(tp)
        await handler.on_assigned([tp], {})
        for offset, (chunk, timestamp) in enumerate(timed):
            if offset == 2:  # the refusal's answer, as delivery.py gives it
                handler.derenderer.fail(Result("answered", None, None,
                                               {HEADER_ATTEMPT: "a1", HEADER_SEQ: "0"}, False), "refused")
            tracker.seen(offset)
            await handler.handle(ConsumerRecord(tp.topic, 0, offset, timestamp, 0, chunk.request_id.encode(),
                                                encode(chunk), None, 0, 0, list(headers_for(chunk))))
        await handler.tick()
        await wait_for(lambda: tracker.committable() == len(timed), what="a commit past every chunk")
        assert handler.request_start == {}
    finally:
        await producer.stop()
    results = await read_topic(kafka_settings, kafka_settings.topic("results"),
                               until=lambda r: any(x.key == b"foreign" for x in r))
    [error] = [decode_result(r.value, r.headers) for r in results if r.key == b"foreign"]
    assert "no output for request 'foreign' for 1 s" in error.error.message
    assert await read_to_end(kafka_settings, kafka_settings.topic("requests")) == []


async def test_the_chunk_log_keeps_the_broker_s_time_not_a_producer_s(kafka_settings, make_topics):
    """What the stalled-request check reads its time from (workers/derender/stalls.py):
    `genpipe topics create` makes the chunks topic with LogAppendTime, so a producer whose
    clock is half an hour ahead does not move it (with the producer's time, that record
    held the check off on its partition for half an hour; Kafka 4 refuses times more than
    an hour ahead, `message.timestamp.after.max.ms`)."""
    await make_topics(kafka_settings, partitions=1)
    producer = make_producer(kafka_settings)
    await producer.start()
    now = int(time.time() * 1000)
    try:
        await producer.send_and_wait(kafka_settings.topic("chunks"), b"x", timestamp_ms=now + 1_800_000)
    finally:
        await producer.stop()
    [record] = await read_topic(kafka_settings, kafka_settings.topic("chunks"), until=lambda r: len(r) >= 1)
    assert record.timestamp_type == 1 and abs(record.timestamp - now) < 60_000
