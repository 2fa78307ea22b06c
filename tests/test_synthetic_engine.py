"""The synthetic engine (`--engine synthetic`): no model, deterministic tokens, the same
interface and finish rules as the real engine, through the real worker and Kafka."""

from __future__ import annotations

import asyncio
import time

import pytest

from schemas import GenerateChunk, GenerateRequest, SamplingParams
from schemas.errors import ValidationError
from tests.kafka_helpers import chunks_finished, read_topic
from workers.generate.synthetic import FIRST_ORDINARY_ID, SyntheticEngine, synthetic_token
from workers.kafka.records import decode_message
from workers.generate.logprob_entries import decode_entry


def req(rid: str, **sampling) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=[1, 5, 6], sampling=SamplingParams(**sampling))


def run(engine: SyntheticEngine, requests, max_steps: int = 10_000) -> dict[str, list]:
    outputs: dict[str, list] = {}
    for r in requests:
        engine.add(r)
    steps = 0
    while engine.has_work():
        assert engine.num_running() <= engine.max_batch
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        steps += 1
        assert steps < max_steps
    return outputs


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def test_an_attempt_that_ends_while_its_id_is_aborted_and_added_again_forgets_only_itself():
    """As the model's engine (tests/test_engine.py): the end of the first attempt, in the
    step during which the worker aborted it and added the id again, forgot the second
    attempt's id (its abort ignored, a third copy accepted and one of them never ended)."""
    engine = SyntheticEngine(step_s=0.0, max_batch=4)
    engine.add(req("r", max_tokens=1))
    expire = engine._expire

    def abort_and_add_during_the_step(outputs):  # (the step's last part, before its tokens)
        expire(outputs)
        engine.abort("r")
        engine.add(req("r", max_tokens=50))
    engine._expire = abort_and_add_during_the_step
    assert [o.finish_reason for o in engine.step() if o.finish_reason] == ["length"]
    engine._expire = expire
    with pytest.raises(ValidationError, match="already running"):
        engine.add(req("r", max_tokens=50))
    engine.abort("r")
    assert [o.finish_reason for o in run(engine, [])["r"] if o.finish_reason] == ["abort"]
    assert not engine.has_work()


def test_tokens_are_deterministic_ordinary_ids_and_requests_end_at_max_tokens():
    engine = SyntheticEngine(step_s=0.0, max_batch=3, vocab_size=2000)
    outs = run(engine, [req(f"r{i}", max_tokens=5 + i) for i in range(7)])
    for i in range(7):
        got = tokens(outs[f"r{i}"])
        assert got == [synthetic_token(f"r{i}", j, 2000) for j in range(5 + i)]
        assert all(FIRST_ORDINARY_ID <= t < 1999 for t in got)
        assert outs[f"r{i}"][-1].finish_reason == "length"
    # the same request alone gives the same tokens (batching does not change them)
    assert tokens(run(SyntheticEngine(step_s=0.0), [req("r3", max_tokens=8)])["r3"]) == tokens(outs["r3"])


def test_stop_ids_after_min_tokens_abort_and_deadlines():
    first = [synthetic_token("s", j, 2000) for j in range(10)]
    engine = SyntheticEngine(step_s=0.0, vocab_size=2000)
    outs = run(engine, [req("s", max_tokens=10, stop_token_ids=[first[1], first[4]], min_tokens=3)])["s"]
    assert tokens(outs) == first[:5] and outs[-1].finish_reason == "stop" and outs[-1].stop_token_id == first[4]

    engine.add(req("a", max_tokens=50))
    engine.step()
    engine.abort("a")
    assert [o.finish_reason for o in engine.step()] == ["abort"]
    past = GenerateRequest(request_id="d", prompt_token_ids=[1], deadline_ms=int(time.time() * 1000) - 1)
    engine.add(past)
    assert [o.finish_reason for o in engine.step()] == ["abort"]
    assert not engine.has_work()


def test_logprobs_have_the_wire_shape_and_requests_are_validated():
    engine = SyntheticEngine(step_s=0.0, vocab_size=2000, max_logprobs=5)
    outs = run(engine, [req("l", max_tokens=3, logprobs=4, prompt_logprobs=2)])["l"]
    rows = [decode_entry(row) for o in outs for row in (o.logprobs or [])]
    assert [r.token_id for r in rows] == tokens(outs)
    assert all(len(r.top_logprobs) == 4 and r.top_logprobs[0].token_id == r.token_id for r in rows)
    assert outs[0].prompt_logprobs[0] is None and len(outs[0].prompt_logprobs) == 3
    with pytest.raises(ValidationError):
        engine.add(req("big", logprobs=7))  # a completion's cap is max_logprobs + 1
    with pytest.raises(ValidationError):
        engine.add(GenerateRequest(request_id="v", prompt_token_ids=[1, 2000]))


@pytest.mark.kafka
async def test_a_synthetic_generate_worker_streams_its_tokens_through_kafka(kafka_settings, make_topics):
    """In the engine child process (make_engine there), as `--engine synthetic` runs it."""
    from tests.test_generate_worker import produce, request_record, start_worker

    await make_topics(kafka_settings, partitions=2)
    requests = [req(f"syn-{i}", max_tokens=20 + i, logprobs=2 if i % 2 else None) for i in range(12)]
    with_logprobs = {r.request_id for r in requests if r.sampling.logprobs is not None}
    stop, task = await start_worker(kafka_settings, None, engine="synthetic", synthetic_step_s=0.002,
                                    max_batch=4, engine_in="process")
    try:
        await produce(kafka_settings, [request_record(r) for r in requests], partitions=2)
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"),
                                   until=chunks_finished({r.request_id for r in requests}), timeout=120)
    finally:
        stop.set()
    assert await asyncio.wait_for(task, 60) == 0
    got: dict[str, list[int]] = {}
    for record in records:
        chunk = decode_message(record, GenerateChunk)
        got.setdefault(chunk.request_id, []).extend(chunk.token_ids)
        if chunk.request_id in with_logprobs and chunk.token_ids:
            assert len(chunk.logprobs.content) == len(chunk.token_ids)
    for i, r in enumerate(requests):
        assert got[r.request_id] == [synthetic_token(r.request_id, j, 2000) for j in range(20 + i)]


@pytest.mark.kafka
async def test_a_worker_whose_engine_makes_no_step_stops_and_the_next_owner_finishes_its_request(
        kafka_settings, make_topics):
    """An engine that makes no step while a request is in it (here: steps of 3 s against a
    stall limit of 0.5 s; in a deployment a hung GPU call, or a thread that died) stops its
    worker with the reason, instead of the request waiting for good behind a worker that
    still heartbeats; nothing was committed, so the next worker of the group redoes it."""
    from tests.test_generate_worker import produce, request_record, start_worker

    await make_topics(kafka_settings, partitions=1)
    stuck_stop, stuck = await start_worker(kafka_settings, None, engine="synthetic", synthetic_step_s=3.0,
                                           max_batch=4, engine_in="process", engine_stall_s=0.5)
    r = req("stalled", max_tokens=5)
    try:
        await produce(kafka_settings, [request_record(r)], partitions=1)
        with pytest.raises(RuntimeError, match=r"the engine made no step for \d+ s with 1 request in it"):
            await asyncio.wait_for(stuck, 60)
    finally:
        stuck_stop.set()
    healthy_stop, healthy = await start_worker(kafka_settings, None, engine="synthetic", synthetic_step_s=0.002,
                                               max_batch=4, engine_in="process")
    try:
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"),
                                   until=chunks_finished({r.request_id}), timeout=120)
    finally:
        healthy_stop.set()
    assert await asyncio.wait_for(healthy, 60) == 0
    chunks = [decode_message(record, GenerateChunk) for record in records]
    assert [t for c in chunks for t in c.token_ids] == [synthetic_token(r.request_id, j, 2000) for j in range(5)]
    assert [c.finish_reason for c in chunks][-1] == "length"


def test_max_tokens_zero_is_the_prompt_only():
    engine = SyntheticEngine(step_s=0.0, max_batch=2, vocab_size=2000)
    engine.add(GenerateRequest(request_id="score", prompt_token_ids=[1, 5, 6],
                               sampling=SamplingParams(max_tokens=0, prompt_logprobs=2)))
    outs = [o for _ in range(3) for o in engine.step()]
    assert len(outs) == 1 and outs[0].token_ids == [] and outs[0].finish_reason == "length"
    assert outs[0].prompt_logprobs[0] is None and [e.token_id for e in outs[0].prompt_logprobs[1:]] == [5, 6]


def test_prompt_tokens_repeat_the_prompt_and_an_unknown_rule_is_refused():
    """`tokens="prompt"` (`--synthetic-tokens prompt`): a benchmark's own text comes back."""
    engine = SyntheticEngine(step_s=0.0, max_batch=2, vocab_size=2000, tokens="prompt")
    outs = run(engine, [req("a", max_tokens=7), req("b", max_tokens=2)])
    assert tokens(outs["a"]) == [1, 5, 6, 1, 5, 6, 1]
    assert tokens(outs["b"]) == [1, 5]
    assert outs["a"][-1].finish_reason == "length"
    with pytest.raises(ValueError, match="tokens must be one of hash, prompt"):
        SyntheticEngine(tokens="prompts")


def test_a_request_validated_on_its_way_is_not_checked_again_but_an_id_still_running_is_refused():
    """The worker validates a request once (its handler) and tells the engine so
    (`validated=True`: the engine process and its inbox skip the rules); a second request
    with a running id is refused all the same, and an unvalidated one is still checked."""
    engine = SyntheticEngine(step_s=0.0, max_batch=4, vocab_size=100)
    engine.add(req("a", max_tokens=3), validated=True)
    with pytest.raises(ValidationError, match="already running"):
        engine.add(req("a", max_tokens=3), validated=True)
    with pytest.raises(ValidationError, match="out of range"):
        engine.add(GenerateRequest(request_id="b", prompt_token_ids=[1, 500]))
    while engine.has_work():
        engine.step()
