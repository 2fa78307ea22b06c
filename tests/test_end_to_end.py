"""The whole pipeline with two generate and two derender worker *processes*."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from openai.types import Completion as OpenAICompletion
from openai.types.chat import ChatCompletion as OpenAIChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChatCompletionChunk
from transformers import AutoTokenizer

from schemas import GenerateChunk, header_value
from tests.kafka_helpers import chunks_finished, read_topic
from tests.process_helpers import WorkerProcesses, last_attempt_text, uninterrupted_texts
from workers.client import GenpipeClient, GenpipeError, make_request
from schemas.headers import HEADER_FINAL
from workers.kafka.records import decode_message

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


PROMPTS = ["Once upon a time", "The weather today is", "Le café est", "東京の天気は", "Hello! 👋 How are",
           "def add(a, b):", "Die Straße war", "¿Dónde está", "The little fox said"]


def build_requests(n: int, tokenizer, rng: random.Random):
    requests = []
    for i in range(n):
        kind = "chat" if i % 2 else "completion"
        prompt = tokenizer.encode(rng.choice(PROMPTS))
        lp = 2 if i % 3 == 0 else None
        requests.append(make_request(
            prompt, kind=kind, request_id=f"e2e-{i}", max_tokens=rng.randrange(4, 24),
            temperature=0.0 if i % 4 else 0.9, seed=i, stream=i % 5 != 0, include_usage=True,
            logprobs=lp, top_logprobs=lp, stop=[" the"] if i % 7 == 0 else ()))
    requests[10].prompt_token_ids = []  # invalid: empty prompt
    requests[20].sampling.logprobs = 99  # invalid: above max_logprobs
    return requests


async def test_hundred_concurrent_requests_through_two_of_each_worker(kafka_settings, make_topics,
                                                                     tiny_model_dir, tmp_path):
    await make_topics(kafka_settings, partitions=4)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    requests = build_requests(100, tokenizer, random.Random(3))
    workers = WorkerProcesses(tmp_path)
    common = ["--bootstrap-servers", kafka_settings.bootstrap_servers, "--topic-prefix",
              kafka_settings.topic_prefix, "--grace-period", "10"]
    # one of each on uvloop (the default), one on Python's asyncio loop: both carry requests
    for i, loop in enumerate(("auto", "asyncio")):
        workers.start(f"generate-{i}", "generate-worker", "--model", str(tiny_model_dir), "--max-batch", "16",
                      "--event-loop", loop, *common)
        workers.start(f"derender-{i}", "derender-worker", "--tokenizer", str(tiny_model_dir), "--event-loop", loop,
                      *common)
    try:
        workers.wait_ready()
        for i, loop in enumerate(("uvloop", "asyncio")):
            for name in (f"generate-{i}", f"derender-{i}"):
                assert f"event loop: {loop}" in workers.log(name), name
        async with GenpipeClient(settings=kafka_settings, timeout_s=180) as client:
            async def run(request):
                try:
                    return await client.complete(request)
                except GenpipeError as exc:
                    return exc
            outcomes = await asyncio.gather(*(run(r) for r in requests))
        chunk_records = await read_topic(kafka_settings, kafka_settings.topic("chunks"),
                                         until=chunks_finished(r.request_id for r in requests))
        result_records = await read_topic(
            kafka_settings, kafka_settings.topic("results"),
            until=lambda rs: {r.key for r in rs if header_value(r.headers, HEADER_FINAL)} >= {
                r.request_id.encode() for r in requests})
    finally:
        codes = workers.stop_all()
    assert all(code == 0 for code in codes.values()), codes  # SIGTERM: clean exit
    for i in range(2):  # each loop had partitions to work on
        assert workers.partitions(f"generate-{i}") and workers.partitions(f"derender-{i}", ".chunks"), i

    errors = {r.request_id: o for r, o in zip(requests, outcomes) if isinstance(o, GenpipeError)}
    assert set(errors) == {"e2e-10", "e2e-20"}
    assert "prompt_token_ids must be non-empty" in str(errors["e2e-10"])
    assert "sampling.logprobs must be -1 or 0..21, got 99" in str(errors["e2e-20"])  # a completion: k+1

    # the sampled ids of each request's winning attempt (the one with a final chunk)
    chunks: dict[str, list[GenerateChunk]] = {}
    for record in chunk_records:
        chunk = decode_message(record, GenerateChunk)
        chunks.setdefault(chunk.request_id, []).append(chunk)
    for request, outcome in zip(requests, outcomes):
        if request.request_id in errors:
            continue
        attempt = next(c.attempt for c in chunks[request.request_id] if c.finish_reason)
        mine = sorted((c for c in chunks[request.request_id] if c.attempt == attempt), key=lambda c: c.seq)
        ids = [t for c in mine for t in c.token_ids]
        tail = mine[0].prompt_tail_ids
        # the text as the coupled endpoint returns it: decoded with the prompt tail as context
        full = tokenizer.decode(tail + ids, skip_special_tokens=True)[len(tokenizer.decode(tail, skip_special_tokens=True)):]
        choice = outcome.choices[0]
        text = choice.message.content if request.output.kind == "chat" else choice.text
        if request.output.stop and choice.finish_reason == "stop" and (
                mine[-1].finish_reason != "stop" or text != full):
            # cut at the stop string; generate was cancelled and may have sampled a few more
            # (or reached EOS before the cancel landed: the cut decides, not generate's end)
            assert full.startswith(text) and full[len(text):].startswith(" the"), (text, full)
            assert outcome.usage.completion_tokens <= len(ids)
        else:
            if "\ufffd" not in full:  # docs/design.md §5.3: equal whenever the byte pieces form valid UTF-8
                assert text == full, request.request_id
            assert outcome.usage.completion_tokens == len(ids)
        assert outcome.usage.prompt_tokens == len(request.prompt_token_ids)
        if request.sampling.logprobs is not None:
            assert choice.logprobs is not None

    # every result record validates against the official openai types
    for record in result_records:
        schema = header_value(record.headers, "genpipe-schema")
        value = json.loads(record.value)
        if schema.startswith("ChatCompletionChunk"):
            OpenAIChatCompletionChunk.model_validate(value)
        elif schema.startswith("ChatCompletion"):
            OpenAIChatCompletion.model_validate(value)
        elif schema.startswith("Completion") and value["choices"][0]["finish_reason"] is not None:
            OpenAICompletion.model_validate(value)
        elif schema.startswith("ErrorResponse"):
            assert value["error"]["message"]


async def test_kill_9_of_a_generate_worker_mid_stream_loses_no_request(kafka_settings, make_topics,
                                                                      tiny_model_dir, tmp_path):
    await make_topics(kafka_settings, partitions=4)
    workers = WorkerProcesses(tmp_path)
    common = ["--bootstrap-servers", kafka_settings.bootstrap_servers, "--topic-prefix", kafka_settings.topic_prefix]
    # Paced (200 tokens ≥ 10 s), so the kill lands mid-stream even if a loaded box delays
    # the first results by seconds (a chunk can't be published before it is sampled); a
    # batch of 16, so no request waits for a row.
    paced = ["--max-batch", "16", "--min-step-ms", "50"]
    workers.start("generate-0", "generate-worker", "--model", str(tiny_model_dir), *paced, *common)
    workers.start("generate-1", "generate-worker", "--model", str(tiny_model_dir), *paced, *common)
    workers.start("derender-0", "derender-worker", "--tokenizer", str(tiny_model_dir), *common)
    requests = [make_request([1, 100 + i, 200], kind="completion", request_id=f"k9-{i}", max_tokens=200,
                             temperature=0, ignore_eos=True, stream=True) for i in range(16)]
    try:
        workers.wait_ready()
        async with GenpipeClient(settings=kafka_settings, timeout_s=180) as client:
            tasks = [asyncio.ensure_future(last_attempt_text(client, r)) for r in requests]
            # kill generate-0 once one of its requests is streaming (a result on one of its
            # partitions: records keep their request's partition number end to end)
            mine = workers.partitions("generate-0")
            await read_topic(kafka_settings, kafka_settings.topic("results"),
                             until=lambda rs: any(r.partition in mine for r in rs))
            workers.kill("generate-0")
            done = await asyncio.gather(*tasks)
    finally:
        workers.stop_all()
    # every request completed, exactly as a single uninterrupted greedy run would
    expected = uninterrupted_texts(tiny_model_dir, requests)
    for request, (text, _) in zip(requests, done):
        assert text == expected[request.request_id], request.request_id
    assert sum(restarts for _, restarts in done) >= 1, "the killed worker's requests restarted on the other one"
