"""The generate worker on the real broker: requests in, ordered chunks out."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest
from aiokafka import TopicPartition

from schemas import Cancel, GenerateChunk, GenerateRequest, OutputOptions, SamplingParams, encode, headers_for
from tests.kafka_helpers import (chunks_finished, committed_offsets, read_topic, set_max_message_bytes, wait_for,
                                 wait_for_commit)
from tests.process_helpers import run_alone
from workers.generate.engine import Engine
from workers.generate.service import GenerateWorkerConfig, run_generate_worker
from workers.generate.chunks import ChunkPolicy
from workers.kafka.clients import make_producer
from schemas.headers import HEADER_DLQ_OFFSET
from workers.kafka.records import decode_message

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(str(tiny_model_dir), max_batch=16, max_logprobs=20)


def chunks_by_request(records) -> dict[str, list[GenerateChunk]]:
    chunks: dict[str, list[GenerateChunk]] = {}
    for record in records:
        chunk = decode_message(record, GenerateChunk)
        assert record.key.decode() == chunk.request_id
        chunks.setdefault(chunk.request_id, []).append(chunk)
    return chunks


async def produce(settings, records: list[tuple[bytes | None, bytes, list]], partitions: int | None = None):
    producer = make_producer(settings)
    await producer.start()
    try:
        for i, (key, value, headers) in enumerate(records):
            await producer.send(settings.topic("requests"), value, key=key, headers=headers,
                                partition=None if partitions is None else i % partitions)
        await producer.flush()
    finally:
        await producer.stop()


def request_record(request: GenerateRequest):
    return request.request_id.encode(), encode(request), headers_for(request)


async def start_worker(settings, loaded_engine, **config):
    """A generate worker on `loaded_engine` (None: built from `config`, as a worker does)."""
    stop = asyncio.Event()
    ready = asyncio.Event()
    config.setdefault("group_id", f"{settings.topic_prefix}-gen")
    task = asyncio.ensure_future(run_generate_worker(
        settings, GenerateWorkerConfig(**config),
        engine=loaded_engine, stop=stop, on_ready=ready.set))
    await asyncio.wait_for(ready.wait(), 60)
    return stop, task


async def test_fifty_concurrent_requests_stream_ordered_chunks_equal_to_the_engine_alone(
        kafka_settings, make_topics, engine, tiny_model_dir):
    await make_topics(kafka_settings, partitions=4)
    requests = []
    for i in range(50):
        sampling = SamplingParams(max_tokens=4 + (i * 7) % 20, temperature=0.0 if i % 3 else 0.8,
                                  seed=1000 + i, logprobs=(i % 4) if i % 5 == 0 else None, ignore_eos=i % 2 == 0)
        requests.append(GenerateRequest(request_id=f"req-{i}", prompt_token_ids=[1] + [10 + (i * 13 + j) % 300 for j in range(3 + i % 17)],
                                        sampling=sampling, output=OutputOptions(kind="chat" if i % 2 else "completion")))
    reference = run_alone(Engine(str(tiny_model_dir), max_batch=16, max_logprobs=20), requests)

    stop, task = await start_worker(kafka_settings, engine)
    try:
        await produce(kafka_settings, [request_record(r) for r in requests], partitions=4)
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"),
                                   until=chunks_finished({r.request_id for r in requests}), timeout=180)
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0

    chunks = chunks_by_request(records)
    partition_of = {}
    for record in records:
        partition_of.setdefault(record.key.decode(), set()).add(record.partition)
    for i, request in enumerate(requests):
        got = chunks[request.request_id]
        assert [c.seq for c in got] == list(range(len(got))), "chunks in seq order, no gaps"
        assert len({c.attempt for c in got}) == 1
        assert got[-1].finish_reason in ("length", "stop") and all(c.finish_reason is None for c in got[:-1])
        if got[-1].finish_reason == "length":  # the last token ends it: it rides on the final chunk, never
            assert got[-1].token_ids, request.request_id  # a final of its own after the chunk that took it
        ids = [t for c in got for t in c.token_ids]
        assert ids == reference[request.request_id], request.request_id
        offsets = [c.token_offset for c in got]
        assert offsets == [sum(len(c.token_ids) for c in got[:j]) for j in range(len(got))]
        first = got[0]
        assert first.prompt_token_count == len(request.prompt_token_ids)
        assert first.prompt_tail_ids == request.prompt_token_ids[-8:]
        assert first.output == request.output
        assert all(c.output is None and c.prompt_tail_ids is None for c in got[1:])
        if request.sampling.logprobs is not None:
            entries = [e for c in got if c.logprobs for e in c.logprobs.content]
            assert [e.token_id for e in entries] == ids
            assert all(len(e.top_logprobs) == max(request.sampling.logprobs, 1) for e in entries)
        else:
            assert all(c.logprobs is None for c in got)
        # the request went to partition i % 4 and its chunks stay on that partition number
        assert partition_of[request.request_id] == {i % 4}


class HoldUntilFinal(ChunkPolicy):
    """Never publish early: every token piles up until the request's final chunk. That is
    where tokens pile up in a lagging worker too (steps keep coming while a publish is
    under way), but here it happens every time rather than when the machine is slow."""

    def due_at(self, pending: int, first_pending_at: float, last_chunk_at: float, lagging: bool,
               interval_s: float) -> float:
        return float("inf")

    def due(self, states, now: float, lagging: bool, interval_s: float) -> list:
        return []


async def test_the_chunk_rate_aim_never_holds_a_request_s_first_token(kafka_settings, make_topics, engine):
    """The rate aim spaces a request's chunks from its previous chunk, so its first token
    (time to first token) goes out alone, at once, even when the aim's interval is long;
    the tokens after it are still coalesced. Before, the interval ran from the first
    pending token: this request's first chunk waited 0.5 s and held ~10 tokens."""
    await make_topics(kafka_settings, partitions=1)
    request = GenerateRequest(request_id="ttft-1", prompt_token_ids=[1, 20, 30],
                              sampling=SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0))
    # one running request at 2 chunks/s: a chunk every 0.5 s; steps paced at 50 ms
    policy = ChunkPolicy(max_records_per_s=2.0, max_delay_s=10.0, max_tokens=1000)
    held = hold_histogram()
    stop, task = await start_worker(kafka_settings, engine, policy=policy, min_step_s=0.05)
    try:
        await produce(kafka_settings, [request_record(request)])
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"),
                                   until=chunks_finished({request.request_id}))
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0
    got = chunks_by_request(records)[request.request_id]
    assert len(got[0].token_ids) == 1
    assert sum(len(c.token_ids) for c in got) == 12
    assert len(got) < 12  # the rest coalesced: not a chunk per step
    # genpipe_chunk_hold_seconds shows what coalescing cost: one observation per chunk,
    # the first token's near 0, the coalesced ones' oldest token ~0.45 s
    count, within_100ms, within_200ms = [after - before for after, before in zip(hold_histogram(), held)]
    assert count == len(got)
    assert within_100ms >= 1 and count - within_200ms >= 1
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("genpipe_chunk_stretch", {"worker": "generate"}) == 1.0  # never behind


def requests_counted() -> dict[str, float]:
    """genpipe_requests_total of this process's generate workers, on the way in (compare deltas)."""
    from prometheus_client import REGISTRY

    return {outcome: REGISTRY.get_sample_value("genpipe_requests_total", {"worker": "generate", "outcome": outcome})
            or 0.0 for outcome in ("accepted", "invalid")}


def hold_histogram() -> tuple[float, float, float]:
    """genpipe_chunk_hold_seconds of the generate worker(s) of this process: the count and
    the observations of at most 0.1 and 0.2 s (a process-wide metric: compare deltas)."""
    from prometheus_client import REGISTRY

    def sample(name: str, **labels) -> float:
        return REGISTRY.get_sample_value(name, {"worker": "generate", **labels}) or 0.0

    return (sample("genpipe_chunk_hold_seconds_count"), sample("genpipe_chunk_hold_seconds_bucket", le="0.1"),
            sample("genpipe_chunk_hold_seconds_bucket", le="0.2"))


async def test_tokens_that_piled_up_leave_in_chunks_of_at_most_max_tokens(
        kafka_settings, make_topics, engine, tiny_model_dir):
    await make_topics(kafka_settings, partitions=2)
    requests = [GenerateRequest(request_id=f"pile-{i}", prompt_token_ids=[1, 20 + i, 30 + i],
                                sampling=SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0,
                                                        logprobs=2 if i % 2 else None))
                for i, n in enumerate([1, 3, 4, 17, 40])]
    reference = run_alone(Engine(str(tiny_model_dir), max_batch=16, max_logprobs=20), requests)
    stop, task = await start_worker(kafka_settings, engine, policy=HoldUntilFinal(max_tokens=3, saturated_stretch=1.0))
    try:
        await produce(kafka_settings, [request_record(r) for r in requests])
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"),
                                   until=chunks_finished({r.request_id for r in requests}))
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0
    chunks = chunks_by_request(records)
    for request in requests:
        got = chunks[request.request_id]
        n = request.sampling.max_tokens
        assert [len(c.token_ids) for c in got] == [3] * ((n - 1) // 3) + [n - 3 * ((n - 1) // 3)]
        assert [c.seq for c in got] == list(range(len(got)))
        assert [c.token_offset for c in got] == list(range(0, n, 3))
        assert [t for c in got for t in c.token_ids] == reference[request.request_id]
        assert got[-1].finish_reason == "length" and all(c.finish_reason is None for c in got[:-1])
        assert got[0].prompt_token_count == 3 and all(c.prompt_token_count is None for c in got[1:])
        if request.sampling.logprobs is not None:
            for c in got:
                assert [e.token_id for e in c.logprobs.content] == c.token_ids


async def test_chunks_over_the_record_size_limit_are_cut_or_end_their_request_with_an_error(
        kafka_settings, make_topics, engine, tiny_model_dir):
    # 2,500 bytes: a few tokens with top-20 logprobs (~770 bytes each) fit, twelve do not;
    # the logprobs of a 13-token prompt (~2.9 kB) cannot fit at all, found after the
    # prefill; those of a 200-token prompt (~45 kB) cannot either, known before it (at
    # least 184 bytes a position). Kafka's default limit is 1 MiB: a real deployment
    # meets this with long prompts and many logprobs.
    limit = 2500
    await make_topics(kafka_settings, partitions=1)
    many = GenerateRequest(request_id="many-logprobs", prompt_token_ids=[1, 40, 41],
                           sampling=SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, logprobs=20))
    prompt = GenerateRequest(request_id="prompt-logprobs", prompt_token_ids=[1] + [200 + i for i in range(13)],
                             sampling=SamplingParams(max_tokens=4, prompt_logprobs=5))
    long_prompt = GenerateRequest(request_id="long-prompt-logprobs",
                                  prompt_token_ids=[1] + [10 + i for i in range(200)],
                                  sampling=SamplingParams(max_tokens=4, prompt_logprobs=5))
    plain = GenerateRequest(request_id="plain", prompt_token_ids=[1, 40, 41],
                            sampling=SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0))
    # its prompt sent back (echo) takes ~2.7 kB: no first chunk can fit, nor can an error
    # that carries the prompt back
    echo = GenerateRequest(request_id="echo-long", prompt_token_ids=[1] + [300 + i for i in range(900)],
                           sampling=SamplingParams(max_tokens=4), output=OutputOptions(kind="completion", echo=True))
    requests = [many, prompt, long_prompt, plain, echo]
    reference = run_alone(Engine(str(tiny_model_dir), max_batch=16, max_logprobs=20), [many, plain])
    group = f"{kafka_settings.topic_prefix}-gen"
    # every token piles up until the final chunk: the cut to the size limit is certain
    stop, task = await start_worker(kafka_settings, engine, policy=HoldUntilFinal(max_tokens=16, saturated_stretch=1.0),
                                    max_record_bytes=limit)
    try:
        await produce(kafka_settings, [request_record(r) for r in requests])
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"),
                                   until=chunks_finished(r.request_id for r in requests))
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0
    for record in records:
        assert len(record.value) + len(record.key) + sum(len(k) + len(v) for k, v in record.headers) <= limit
    chunks = chunks_by_request(records)
    got = chunks["many-logprobs"]
    assert len(got) >= 4 and all(len(c.token_ids) < 12 for c in got)  # cut below max_tokens (16)
    assert [t for c in got for t in c.token_ids] == reference["many-logprobs"]
    assert [e.token_id for c in got for e in c.logprobs.content] == reference["many-logprobs"]
    assert got[-1].finish_reason == "length"
    (error,) = chunks["prompt-logprobs"]
    assert error.finish_reason == "error" and error.token_ids == [] and error.prompt_logprobs is None
    assert error.error.message.startswith("chunk too large: the prompt's logprobs encode to ")
    assert "over the record size limit of 2500 bytes" in error.error.message
    assert error.output == prompt.output and error.prompt_token_count == 14  # seq 0's fields, for derender
    (early,) = chunks["long-prompt-logprobs"]
    assert early.finish_reason == "error" and early.token_ids == [] and early.error.type == "invalid_request_error"
    assert early.error.message.startswith("sampling.prompt_logprobs: a prompt of 201 tokens with 5 candidates a "
                                          "position takes at least 36800 bytes in a chunk, over the record size "
                                          "limit of 2500 bytes")
    assert [t for c in chunks["plain"] for t in c.token_ids] == reference["plain"]
    (error,) = chunks["echo-long"]
    assert error.finish_reason == "error" and error.token_ids == [] and error.prompt_token_ids is None
    assert error.error.message.startswith("chunk too large: the prompt's token ids (sent back for echo or prompt "
                                          "logprobs) encode to ")
    assert "; send a shorter prompt (or raise" in error.error.message
    assert error.output == echo.output and error.prompt_token_count == 901  # seq 0's fields, for derender
    # nothing held: the group committed past all five requests
    tp = TopicPartition(kafka_settings.topic("requests"), 0)
    assert (await committed_offsets(kafka_settings, group, [tp]))[tp].offset == 5


async def test_a_request_whose_single_token_chunk_is_over_the_limit_ends_with_an_error_and_stops(
        kafka_settings, make_topics, engine):
    # 900 bytes: a first chunk with one token and its top-20 logprobs (~770 bytes) plus the
    # first chunk's prompt facts does not fit. Published as due (no piling up): the error
    # ends the request while the engine is still generating it.
    await make_topics(kafka_settings, partitions=1)
    big = GenerateRequest(request_id="big", prompt_token_ids=[1, 40, 41],
                          sampling=SamplingParams(max_tokens=None, ignore_eos=True, logprobs=20))
    after = GenerateRequest(request_id="after", prompt_token_ids=[1, 40, 41],
                            sampling=SamplingParams(max_tokens=5, ignore_eos=True))
    stop, task = await start_worker(kafka_settings, engine, max_record_bytes=900, min_step_s=0.01)
    try:
        await produce(kafka_settings, [request_record(big), request_record(after)])
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"),
                                   until=chunks_finished({"big", "after"}))
        # to the context length would take 20 s at this pace: the error stopped it
        await wait_for(lambda: not engine.has_work(), timeout=10, what="the engine to drop the failed request")
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0
    chunks = chunks_by_request(records)
    (error,) = chunks["big"]
    assert error.finish_reason == "error" and error.seq == 0 and error.token_ids == []
    assert error.error.message.startswith("chunk too large: one token's logprobs encode to ")
    assert sum(len(c.token_ids) for c in chunks["after"]) == 5
    tp = TopicPartition(kafka_settings.topic("requests"), 0)
    assert (await committed_offsets(kafka_settings, f"{kafka_settings.topic_prefix}-gen", [tp]))[tp].offset == 2


async def test_chunks_the_broker_refuses_for_good_end_their_requests_with_an_error_and_the_partition_moves_on(
        kafka_settings, make_topics, engine):
    """The chunks topic's limit lowered below a request's chunks while the worker runs (an
    operator's change; at start the worker refuses such a topic): the broker refuses them
    for good. Before, a refused final chunk kept its request's offset held for good (the
    group committed no further than it) and nothing told its client; a refused chunk of a
    running request left the engine generating for nobody. Now each ends with a server
    error chunk in place of its first refused one, and the partition moves on."""
    await make_topics(kafka_settings, partitions=1)
    prompt = [1] + [10 + i for i in range(200)]  # its logprobs on seq 0: ~45 kB, over the 4,000 bytes
    ended = GenerateRequest(request_id="refused-final", prompt_token_ids=prompt,
                            sampling=SamplingParams(max_tokens=1, prompt_logprobs=5))
    running = GenerateRequest(request_id="refused-running", prompt_token_ids=prompt,
                              sampling=SamplingParams(max_tokens=None, ignore_eos=True, prompt_logprobs=5))
    after = GenerateRequest(request_id="after", prompt_token_ids=[1, 5, 6],
                            sampling=SamplingParams(max_tokens=3, ignore_eos=True))  # (sampled: EOS may come first)
    group = f"{kafka_settings.topic_prefix}-gen"
    stop, task = await start_worker(kafka_settings, engine, min_step_s=0.01)
    try:
        await set_max_message_bytes(kafka_settings, kafka_settings.topic("chunks"), 4000)
        await produce(kafka_settings, [request_record(r) for r in (ended, running)])
        await read_topic(kafka_settings, kafka_settings.topic("chunks"),
                         until=chunks_finished({"refused-final", "refused-running"}))
        # to the context length would take 20 s at this pace: the refusal stopped it
        await wait_for(lambda: not engine.has_work(), timeout=10, what="the engine to drop the refused request")
        # (sent now: a request whose chunks share a producer batch with refused ones is refused with them)
        await produce(kafka_settings, [request_record(after)])
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"), until=chunks_finished({"after"}))
        await wait_for_commit(kafka_settings, group, TopicPartition(kafka_settings.topic("requests"), 0), 3,
                              what="the partition's commits stopped at the request whose final chunk was refused")
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0
    chunks = chunks_by_request(records)
    for request_id in ("refused-final", "refused-running"):
        *before, error = chunks[request_id]
        # (chunks already handed over when the refusal came go on: they follow the refused seq 0)
        assert all(c.seq > 0 for c in before) and len(before) <= 3
        assert error.seq == 0 and error.finish_reason == "error" and error.token_ids == []
        assert error.prompt_logprobs is None and error.prompt_token_count == 201  # seq 0's facts, for derender
        assert error.error.type == "server_error"
        assert error.error.message.startswith(
            f"the chunks topic {kafka_settings.topic('chunks')!r} refused this request's chunk for good "
            f"([Error 10] MessageSizeTooLargeError)")
    assert sum(len(c.token_ids) for c in chunks["after"]) == 3 and chunks["after"][-1].finish_reason == "length"


async def test_invalid_request_gets_an_error_chunk_and_the_next_one_still_runs(kafka_settings, make_topics, engine):
    await make_topics(kafka_settings, partitions=1)
    bad_rule = GenerateRequest(request_id="bad-logprobs", prompt_token_ids=[1, 2],
                               sampling=SamplingParams(logprobs=22))  # a completion may ask 20 + 1
    bad_vocab = GenerateRequest(request_id="bad-vocab", prompt_token_ids=[1, 10**6])
    good = GenerateRequest(request_id="good", prompt_token_ids=[1, 5, 6],
                           sampling=SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    mistyped = b'{"request_id": "bad-type", "prompt_token_ids": "1 2 3"}'
    before = requests_counted()
    stop, task = await start_worker(kafka_settings, engine)
    try:
        await produce(kafka_settings, [
            request_record(bad_rule), request_record(bad_vocab),
            (b"garbage", b"\xc1\xc1 not a record", [("content-type", b"application/x-msgpack")]),
            (b"bad-type", mistyped, [("content-type", b"application/json")]),
            request_record(good)])
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"),
                                   until=chunks_finished({"bad-logprobs", "bad-vocab", "bad-type", "good"}))
        dlq = await read_topic(kafka_settings, kafka_settings.topic("dlq"), until=lambda r: len(r) >= 1)
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0
    chunks = chunks_by_request(records)
    for request_id, message in [("bad-logprobs", "sampling.logprobs must be -1 or 0..21, got 22"),
                                ("bad-vocab", "prompt_token_ids[1] = 1000000 is out of range"),
                                ("bad-type", "prompt_token_ids: expected array, got str")]:
        (chunk,) = chunks[request_id]
        assert chunk.finish_reason == "error" and chunk.seq == 0 and chunk.token_ids == []
        assert message in chunk.error.message
    assert chunks["good"][-1].finish_reason == "length"
    assert sum(len(c.token_ids) for c in chunks["good"]) == 3
    # each request counted once, on its way in (an invalid one was counted accepted too)
    after = requests_counted()
    assert {o: after[o] - before[o] for o in after} == {"accepted": 1, "invalid": 3}
    assert dlq[0].value == b"\xc1\xc1 not a record" and dict(dlq[0].headers)[HEADER_DLQ_OFFSET] == b"2"


async def test_garbage_just_under_the_topics_limit_is_copied_to_the_dlq_cut_and_the_partition_moves_on(
        kafka_settings, make_topics, engine):
    """The DLQ copy of a record just under its topic's limit (Kafka's default, 1 MB) is
    bigger than the record (our headers): the broker refused it, and the worker held the
    record's offset for good, so the partition committed no further (on the old code the
    committed offset stayed at 0). The copy is now cut to fit, and says so."""
    from schemas.headers import HEADER_DLQ_CUT, HEADER_DLQ_ERROR

    await make_topics(kafka_settings, partitions=1)
    garbage = b"\xc1" * 1_048_000
    stop, task = await start_worker(kafka_settings, engine)
    try:
        await _garbage_then_a_request_and_the_partition_commits_past_both(
            kafka_settings, garbage, [("content-type", b"application/msgpack"), ("x-trace", b"t" * 300)])
        dlq = await read_topic(kafka_settings, kafka_settings.topic("dlq"), until=lambda r: len(r) >= 1)
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0
    (copy,) = dlq
    headers = dict(copy.headers)
    assert copy.key == b"garbage" and 900_000 < len(copy.value) < len(garbage) and garbage.startswith(copy.value)
    assert headers[HEADER_DLQ_OFFSET] == b"0" and b"not a valid msgpack record" in headers[HEADER_DLQ_ERROR]
    assert headers[HEADER_DLQ_CUT].decode().startswith(
        "key 7 bytes, value 1048000 bytes, 2 headers (338 bytes): cut to fit the record limit of 1000000 bytes")
    assert headers["x-trace"] == b"t" * 300  # the original headers were a small part of the room: kept


async def test_a_dlq_that_refuses_the_copy_does_not_hold_the_partition(kafka_settings, make_topics, engine, caplog):
    """A DLQ topic whose own limit is below the copy (an operator's setting, changed while
    the worker runs) refuses it whatever the worker does: the worker says where the record
    is and commits past it, rather than hold the partition's commits for good."""
    await make_topics(kafka_settings, partitions=1)
    stop, task = await start_worker(kafka_settings, engine)
    try:
        # (lowered once the worker runs: at start it would refuse a DLQ with such a limit)
        await set_max_message_bytes(kafka_settings, kafka_settings.topic("dlq"), 2000)
        await _garbage_then_a_request_and_the_partition_commits_past_both(
            kafka_settings, b"\xc1" * 5000, [("content-type", b"application/msgpack")])
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0
    assert (f"the DLQ refused the copy of {kafka_settings.topic('requests')}[0]@0 (MessageSizeTooLargeError()): "
            f"the record is only at its source offset") in caplog.text


async def test_a_dlq_that_refuses_a_flood_of_copies_logs_a_few_and_counts_the_rest(kafka_settings, make_topics,
                                                                                    engine, caplog):
    """A DLQ that refuses copies (its limit lowered, no write ACL) refuses a flood of
    garbage copy by copy: the first 10 refusals are logged, the rest counted in one line
    (at the latest when the worker stops), and no other line repeats each (there were two
    ERROR lines a copy); the partition still commits past every record."""
    import logging

    caplog.set_level(logging.WARNING, logger="workers.kafka.publisher")
    await make_topics(kafka_settings, partitions=1)
    stop, task = await start_worker(kafka_settings, engine)
    try:
        await set_max_message_bytes(kafka_settings, kafka_settings.topic("dlq"), 2000)
        good = GenerateRequest(request_id="good", prompt_token_ids=[1, 5, 6], sampling=SamplingParams(max_tokens=3))
        await produce(kafka_settings, [(b"garbage", b"\xc1" * 5000, [])] * 25 + [request_record(good)])
        await read_topic(kafka_settings, kafka_settings.topic("chunks"), until=chunks_finished({"good"}))
        await wait_for_commit(kafka_settings, f"{kafka_settings.topic_prefix}-gen",
                              TopicPartition(kafka_settings.topic("requests"), 0), 26, what="the commit past all 26")
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    requests = kafka_settings.topic("requests")
    assert [line.split(" (")[0] for line in refused[:10]] == [
        f"the DLQ refused the copy of {requests}[0]@{i}" for i in range(10)]
    assert len(refused) == 11, refused
    assert refused[10].startswith("15 more DLQ copies refused in the last ")
    assert not [r for r in caplog.records if r.getMessage().startswith("publish failed")]


async def _garbage_then_a_request_and_the_partition_commits_past_both(settings, garbage: bytes, headers) -> None:
    """Undecodable `garbage` then a valid request, on partition 0 of the requests topic:
    the request is answered, and the worker's group commits past both."""
    good = GenerateRequest(request_id="good", prompt_token_ids=[1, 5, 6], sampling=SamplingParams(max_tokens=3))
    await produce(settings, [(b"garbage", garbage, headers), request_record(good)])
    await read_topic(settings, settings.topic("chunks"), until=chunks_finished({"good"}))
    await wait_for_commit(settings, f"{settings.topic_prefix}-gen", TopicPartition(settings.topic("requests"), 0), 2,
                          what="the partition's commits stopped at the record the DLQ refused")


async def test_cancel_and_deadline_end_requests_with_abort(kafka_settings, make_topics, engine):
    await make_topics(kafka_settings, partitions=1)
    long = GenerateRequest(request_id="long", prompt_token_ids=[1, 7],
                           sampling=SamplingParams(max_tokens=None, ignore_eos=True, temperature=0))
    late = GenerateRequest(request_id="late", prompt_token_ids=[1, 7], deadline_ms=int(time.time() * 1000) - 1)
    # Paced (a full context ≈ 10 s), so the cancel lands mid-stream however fast the engine.
    stop, task = await start_worker(kafka_settings, engine, min_step_s=0.02)
    try:
        await produce(kafka_settings, [request_record(long), request_record(late)])
        # wait until "long" is streaming, then cancel it
        await read_topic(kafka_settings, kafka_settings.topic("chunks"),
                         until=lambda rs: any(decode_message(r, GenerateChunk).request_id == "long" for r in rs))
        producer = make_producer(kafka_settings)
        await producer.start()
        cancel = Cancel(request_id="long")
        await producer.send_and_wait(kafka_settings.topic("cancel"), encode(cancel), key=b"long", headers=headers_for(cancel))
        await producer.stop()
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"), until=chunks_finished({"long", "late"}))
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0
    chunks = chunks_by_request(records)
    assert chunks["long"][-1].finish_reason == "abort"
    assert chunks["late"][-1].finish_reason == "abort" and chunks["late"][-1].token_ids == []


async def test_a_flood_of_unreadable_cancels_is_counted_in_the_log_and_a_real_cancel_still_lands(
        kafka_settings, make_topics, engine, caplog):
    """Clients write the cancel topic, and every generate worker reads all of it: garbage
    there is logged, not copied to the DLQ, and a flood of it must not become a line per
    record in every worker's log; a cancel after it still ends its request."""
    import logging

    caplog.set_level(logging.WARNING, logger="workers.generate.service")
    await make_topics(kafka_settings, partitions=1)
    long = GenerateRequest(request_id="long", prompt_token_ids=[1, 7],
                           sampling=SamplingParams(max_tokens=None, ignore_eos=True, temperature=0))
    stop, task = await start_worker(kafka_settings, engine, min_step_s=0.02)  # (paced: ~10 s to a full context)
    try:
        await produce(kafka_settings, [request_record(long)])
        await read_topic(kafka_settings, kafka_settings.topic("chunks"),
                         until=lambda rs: any(decode_message(r, GenerateChunk).request_id == "long" for r in rs))
        producer = make_producer(kafka_settings)
        await producer.start()
        for i in range(30):
            await producer.send(kafka_settings.topic("cancel"), b"\xc1not a cancel %d" % i, key=b"x%d" % i)
        cancel = Cancel(request_id="long")
        await producer.send_and_wait(kafka_settings.topic("cancel"), encode(cancel), key=b"long",
                                     headers=headers_for(cancel))
        await producer.stop()
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"), until=chunks_finished({"long"}))
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0
    assert chunks_by_request(records)["long"][-1].finish_reason == "abort"
    lines = [r.getMessage() for r in caplog.records if r.name == "workers.generate.service" and "cancel" in r.getMessage()]
    assert [line.split(":")[0] for line in lines[:10]] == [
        f"unreadable cancel at {kafka_settings.topic('cancel')}[0]@{i}" for i in range(10)]
    assert len(lines) == 11, lines
    assert lines[10].startswith("20 more unreadable cancels in the last ")
    assert f"the last: unreadable cancel at {kafka_settings.topic('cancel')}[0]@29: " in lines[10]


async def test_copies_of_a_running_request_are_dropped_and_counted_in_the_log(kafka_settings, make_topics, engine,
                                                                              caplog):
    """A producer's retries (or a client's) deliver the same request again while it runs:
    the first copy answers, once; the others are dropped, the first few logged and the
    rest counted. So are copies that break a rule (a mistyped field, a reply topic the
    rule refuses): they were answered with their error as a new attempt of the id, and
    the derender ended the running request with it."""
    import logging

    caplog.set_level(logging.WARNING, logger="workers.generate.worker")
    await make_topics(kafka_settings, partitions=1)
    dup = GenerateRequest(request_id="dup", prompt_token_ids=[1, 7],
                          sampling=SamplingParams(max_tokens=40, ignore_eos=True, temperature=0))
    stop, task = await start_worker(kafka_settings, engine, min_step_s=0.02)  # (paced: the copies arrive while it runs)
    try:
        mistyped = json.dumps({"request_id": "dup", "prompt_token_ids": [1], "sampling": {"temperature": "hot"}})
        refused = msgspec.structs.replace(dup, reply_topic=kafka_settings.topic("requests"))
        json_header = [("content-type", b"application/json")]
        await produce(kafka_settings, [request_record(dup), (b"dup", mistyped.encode(), json_header),
                                       request_record(refused)] + [request_record(dup)] * 12)
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"), until=chunks_finished({"dup"}))
        await wait_for_commit(kafka_settings, f"{kafka_settings.topic_prefix}-gen",
                              TopicPartition(kafka_settings.topic("requests"), 0), 15, what="the commit past every copy")
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0
    chunks = chunks_by_request(records)["dup"]
    assert [c.seq for c in chunks] == list(range(len(chunks))), "one stream, not two"
    assert {c.attempt for c in chunks} == {chunks[0].attempt} and chunks[-1].finish_reason == "length"
    assert sum(len(c.token_ids) for c in chunks) == 40
    lines = [r.getMessage() for r in caplog.records if r.name == "workers.generate.worker" and "dup" in r.getMessage()]
    assert lines[:10] == [f"request dup already running; duplicate at offset {i} dropped" for i in range(1, 11)]
    assert len(lines) == 11, lines
    assert lines[10].startswith("4 more duplicate requests dropped in the last ")
    assert lines[10].endswith("the last: request dup already running; duplicate at offset 14 dropped")


async def test_stop_finishes_in_flight_requests_within_the_grace_period(kafka_settings, make_topics, engine):
    await make_topics(kafka_settings, partitions=1)
    request = GenerateRequest(request_id="drain", prompt_token_ids=[1, 7],
                              sampling=SamplingParams(max_tokens=120, ignore_eos=True, temperature=0))
    stop, task = await start_worker(kafka_settings, engine, grace_s=60)
    await produce(kafka_settings, [request_record(request)])
    await read_topic(kafka_settings, kafka_settings.topic("chunks"),
                     until=lambda rs: any(decode_message(r, GenerateChunk).request_id == "drain" for r in rs))
    stop.set()  # SIGTERM: take nothing new, finish what runs
    assert await asyncio.wait_for(task, 90) == 0
    records = await read_topic(kafka_settings, kafka_settings.topic("chunks"), until=chunks_finished({"drain"}))
    chunks = chunks_by_request(records)["drain"]
    assert chunks[-1].finish_reason == "length"
    assert sum(len(c.token_ids) for c in chunks) == 120


async def test_a_request_that_does_not_decode_is_answered_on_its_reply_topic(kafka_settings, make_topics, engine):
    """A request whose fields do not decode (a wrong type, an integer past 64 bits) is
    answered by the request_id and reply_topic read from it: a client reading its own
    reply topic waited for an answer sent to the shared results topic until it timed out.
    A reply topic the rule refuses is not used (the default topic, as for a full request)."""
    await make_topics(kafka_settings, partitions=1)
    prefix = kafka_settings.topic_prefix
    bodies = [(b"typed", {"request_id": "typed", "prompt_token_ids": "1,2", "reply_topic": f"{prefix}.reply.x"}),
              (b"big", {"request_id": "big", "prompt_token_ids": [1], "priority": 2**64 - 1,
                        "reply_topic": f"{prefix}.reply.x"}),
              (b"ruled", {"request_id": "ruled", "prompt_token_ids": "x", "reply_topic": f"{prefix}.requests"}),
              (b"odd", {"request_id": "odd", "prompt_token_ids": "x", "reply_topic": 5})]
    stop, task = await start_worker(kafka_settings, engine)
    try:
        await produce(kafka_settings, [(key, json.dumps(body).encode(), [("content-type", b"application/json")])
                                       for key, body in bodies])
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"),
                                   until=chunks_finished({"typed", "big", "ruled", "odd"}))
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 60) == 0
    finals = {rid: chunks[-1] for rid, chunks in chunks_by_request(records).items()}
    assert all(c.finish_reason == "error" and c.seq == 0 for c in finals.values())
    assert finals["typed"].reply_topic == f"{prefix}.reply.x" and "prompt_token_ids" in finals["typed"].error.message
    assert finals["big"].reply_topic == f"{prefix}.reply.x" and "priority" in finals["big"].error.message
    assert finals["ruled"].reply_topic is None and finals["odd"].reply_topic is None


@pytest.mark.parametrize("deleted", ["chunks", "dlq"])
async def test_a_worker_whose_own_topic_is_deleted_stops_with_an_error_that_names_it(
        kafka_settings, make_topics, engine, monkeypatch, deleted):
    """The chunks topic (or the DLQ) deleted under a running worker (a broken deployment):
    the producer held its records for good (aiokafka never expires them), or its publish
    step raised and the failure was only logged. The worker ran on with the partition's
    offset held and every request read after it unanswered, while aiokafka logged
    "Topic ... not found in cluster metadata" ~700 times a second. It stops now, as a
    publish step awaited in its loop did, saying which topic; nothing is committed past
    the record, so the partitions' next owner (once the topic is back) redoes it. The DLQ
    takes the records the worker cannot answer (no readable request_id)."""
    from tests.kafka_helpers import delete_topic

    monkeypatch.setattr("workers.kafka.topic_metadata.DELETED_TOPIC_WAIT_S", 2.0)
    await make_topics(kafka_settings, partitions=1)
    topic = kafka_settings.topic(deleted)

    def record(request_id: str):
        if deleted == "dlq":  # a record with no request_id to answer: copied to the DLQ
            return request_id.encode(), b"\xc1\xc1 not a record", [("content-type", b"application/x-msgpack")]
        return request_record(GenerateRequest(request_id=request_id, prompt_token_ids=[1, 7], sampling=SamplingParams(
            max_tokens=2, ignore_eos=True, temperature=0)))

    stop, task = await start_worker(kafka_settings, engine)
    try:
        await produce(kafka_settings, [record("before")])  # (the worker has written to it)
        await read_topic(kafka_settings, topic, until=lambda rs: any(r.key == b"before" for r in rs))
        await wait_for_commit(kafka_settings, f"{kafka_settings.topic_prefix}-gen",
                              TopicPartition(kafka_settings.topic("requests"), 0), 1)
        await delete_topic(kafka_settings, topic)
        await produce(kafka_settings, [record("orphan")])
        with pytest.raises(RuntimeError) as failed:  # (~12 s: the metadata's refresh, then 2 s)
            await asyncio.wait_for(task, 120)
    finally:
        stop.set()
    assert f"publishing to {topic} failed" in str(failed.value), failed.value
    offsets = await committed_offsets(kafka_settings, f"{kafka_settings.topic_prefix}-gen",
                                      [TopicPartition(kafka_settings.topic("requests"), 0)])
    assert [o.offset for o in offsets.values()] == [1], "committed past the record it could not publish"
