"""`genpipe serve` (workers/gateway): the body rules (pure), then real HTTP over a real
broker with real generate (synthetic engine) and derender workers and the openai SDK."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging

import httpx
import pytest

from tests.process_helpers import free_port
from tests.test_generate_worker import start_worker
from workers.gateway.params import BadParameter, parse


# --- the body rules ---------------------------------------------------------------------------

def test_a_completion_body_maps_onto_a_request():
    p = parse({"model": "m", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "stop": "x", "logprobs": 2,
               "seed": 7, "priority": -1, "user": "ignored", "unknown_field": 1}, "completion", "m")
    assert p.prompts == [[5, 6, 7]] and not p.stream and p.n == 1
    assert {"max_tokens": 3, "temperature": 0.0, "stop": ["x"], "logprobs": 2, "seed": 7,
            "priority": -1}.items() <= p.options.items()


def test_a_chat_body_maps_onto_a_request():
    p = parse({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
               "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 3, "stream": True,
               "stream_options": {"include_usage": True}}, "chat", "m")
    assert p.messages == [{"role": "user", "content": "hi"}]
    assert p.options["max_tokens"] == 4 and p.options["top_logprobs"] == 3 and p.options["include_usage"]


@pytest.mark.parametrize("body, kind, param, status", [
    ({"model": "other", "prompt": "x"}, "completion", "model", 404),
    ({"prompt": "x", "logit_bias": {"5": 1}}, "completion", "logit_bias", 400),
    ({"prompt": "x", "best_of": 3}, "completion", "best_of", 400),
    ({"prompt": "x", "n": 0}, "completion", "n", 400),
    ({"prompt": ["a", "b"], "n": 100}, "completion", "n", 400),
    ({"prompt": ["a", 5]}, "completion", "prompt", 400),
    ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "chat", "echo", 400),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "completion", "prompt_logprobs", 400),
    ({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 2, "stream": True}, "chat",
     "prompt_logprobs", 400),
    ({"prompt": "x", "prompt_logprobs": 21}, "completion", "prompt_logprobs", 400),
    ({"prompt": "x", "prompt_logprobs": "2"}, "completion", "prompt_logprobs", 400),
    ({"prompt": "x", "suffix": "y"}, "completion", "suffix", 400),
    ({"prompt": []}, "completion", "prompt", 400),
    ({"prompt": "x", "max_tokens": -1}, "completion", "max_tokens", 400),
    ({"prompt": "x", "temperature": "hot"}, "completion", "temperature", 400),
    ({"prompt": "x", "top_p": 0}, "completion", "top_p", 400),
    ({"prompt": "x", "logprobs": 21}, "completion", "logprobs", 400),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "completion", "stream_options", 400),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "chat", "top_logprobs", 400),
    ({"messages": [{"content": "x"}]}, "chat", "messages[0]", 400),
    ({"messages": []}, "chat", "messages", 400),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "chat", "tools", 400),
    ([1, 2], "chat", "body", 400),
    # 64-bit integers only: a larger one could not be encoded into the request record (a 503
    # "genpipe is unavailable" before), nor could the worker read one past 2**63 - 1 (a hang
    # until the timeout: its error went to the shared results topic)
    ({"prompt": "x", "max_tokens": 2**63}, "completion", "max_tokens", 400),
    ({"prompt": "x", "top_k": 10**5000}, "completion", "top_k", 400),
    ({"prompt": [1, 2**64]}, "completion", "prompt", 400),
    ({"prompt": "x", "stop_token_ids": [2**70]}, "completion", "stop_token_ids", 400),
    ({"prompt": "x", "temperature": 10**400}, "completion", "temperature", 400),  # (float() overflows)
    # sizes a request's rules bound: the record was too large for Kafka, and that came
    # back as a 503 "genpipe is unavailable" (retried by the SDKs)
    ({"prompt": "x", "stop": ["y" * 100_000] * 11}, "completion", "stop", 400),
    ({"prompt": "x", "stop": "y" * 1001}, "completion", "stop", 400),
    ({"prompt": "x", "stop": ""}, "completion", "stop", 400),
    ({"prompt": "x", "stop_token_ids": list(range(1025))}, "completion", "stop_token_ids", 400),
    # vLLM's extensions that change the output: ignored, a structured-output request got
    # free text that looked valid
    ({"messages": [{"role": "user", "content": "x"}], "guided_choice": ["yes", "no"]}, "chat", "guided_choice", 400),
    ({"prompt": "x", "guided_json": {"type": "object"}}, "completion", "guided_json", 400),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": False}}, "chat",
     "chat_template_kwargs", 400),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, "chat",
     "continue_final_message", 400),
    ({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False}, "chat",
     "add_generation_prompt", 400),
    ({"prompt": "x", "add_special_tokens": False}, "completion", "add_special_tokens", 400),
    ({"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True}, "chat", "add_special_tokens", 400),
    ({"prompt": "x", "use_beam_search": True}, "completion", "use_beam_search", 400),
    ({"prompt": "x", "return_tokens_as_token_ids": True}, "completion", "return_tokens_as_token_ids", 400),
    ({"prompt": "x", "priority": 2 ** 63}, "completion", "priority", 400),
])
def test_bad_bodies_are_refused_naming_the_parameter(body, kind, param, status):
    with pytest.raises(BadParameter) as err:
        parse(body, kind, "genpipe-tiny" if "model" not in body else "m")
    assert err.value.param == param and err.value.status == status
    assert param.split("[")[0].split(".")[0] in str(err.value) or param == "body"


def test_a_prompt_with_no_room_in_the_context_is_refused_before_the_fan_out():
    from workers.gateway.params import check_context as _check_context

    _check_context([[1] * 2047, [1]], 2048, "prompt")
    _check_context([[1] * 10_000], None, "prompt")  # (the context unknown: the worker decides)
    with pytest.raises(BadParameter) as err:
        _check_context([[1], [1] * 2048], 2048, "prompt")
    assert err.value.param == "prompt" and err.value.status == 400
    assert str(err.value).startswith("prompt[1] has 2048 tokens but the model's context is 2048")


def test_vllm_s_extensions_at_their_defaults_pass():
    """A client that sends vLLM's request model whole sends these at their defaults."""
    chat = {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True, "add_special_tokens": False,
            "continue_final_message": False, "use_beam_search": False, "length_penalty": 1.0, "guided_json": None,
            "chat_template_kwargs": None, "bad_words": [], "return_tokens_as_token_ids": False}
    assert parse(chat, "chat", "m").messages == chat["messages"]
    assert parse({"prompt": "x", "add_special_tokens": True, "truncate_prompt_tokens": None}, "completion",
                 "m").prompts == ["x"]


def test_numbers_and_content_parts_as_vllm_reads_them():
    """`max_tokens: 256.0` (a number a script computed) got 400; vLLM takes it. Text
    content parts were joined with "" where vLLM joins them with a newline: the same
    request rendered another prompt."""
    p = parse({"prompt": "x", "max_tokens": 256.0, "n": 2.0, "seed": 7.0}, "completion", "m")
    assert (p.options["max_tokens"], p.n, p.options["seed"]) == (256, 2, 7)
    with pytest.raises(BadParameter, match="max_tokens must be an integer"):
        parse({"prompt": "x", "max_tokens": 2.5}, "completion", "m")
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    assert parse({"messages": [{"role": "user", "content": parts}]}, "chat", "m").messages == [
        {"role": "user", "content": "first\nsecond"}]


def test_priority_takes_the_request_records_64_bits():
    """The record's `priority` is 64 bits (as `submit --priority` takes it); the gateway
    refused what passed 32."""
    for priority in (-(2 ** 63), 2 ** 31, 2 ** 63 - 1):
        assert parse({"prompt": "x", "priority": priority}, "completion", "genpipe-tiny").options["priority"] == priority


def test_null_is_not_given():
    """Clients built from typed request models send every field, null where unset: OpenAI
    and vLLM read null as "not given". A null temperature got 400, and a chat's null
    max_completion_tokens beside max_tokens 50 dropped the 50 (it ran to the context)."""
    nulls = dict.fromkeys(["temperature", "top_p", "min_p", "min_tokens", "priority", "seed", "stop", "n", "model"])
    p = parse({"messages": [{"role": "user", "content": "x"}], "max_tokens": 50, "max_completion_tokens": None,
               **nulls}, "chat", "m")
    assert p.n == 1 and p.options["max_tokens"] == 50
    assert {k: p.options[k] for k in ("temperature", "top_p", "min_p", "min_tokens", "priority", "seed", "stop")} == \
        {"temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "min_tokens": 0, "priority": 0, "seed": None, "stop": []}
    assert parse({"messages": [{"role": "user", "content": "x"}], "max_tokens": None, "max_completion_tokens": 7},
                 "chat", "m").options["max_tokens"] == 7


def test_max_logprobs_minus_one_is_no_cap_at_the_gateway_too():
    """`serve --max-logprobs -1` ("no cap", as the workers read it) refused every
    logprobs, top_logprobs and prompt_logprobs: "must be between 0 and -1"."""
    chat = parse({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50,
                  "prompt_logprobs": 40}, "chat", "m", max_logprobs=-1)
    assert chat.options["top_logprobs"] == 50 and chat.options["prompt_logprobs"] == 40
    assert parse({"prompt": "x", "logprobs": 30}, "completion", "m", max_logprobs=-1).options["logprobs"] == 30
    with pytest.raises(BadParameter) as err:
        parse({"prompt": "x", "logprobs": -1}, "completion", "m", max_logprobs=-1)
    assert str(err.value) == "logprobs must be between 0 and 9223372036854775807, got -1"
    with pytest.raises(BadParameter) as err:
        parse({"prompt": "x", "logprobs": 21}, "completion", "m", max_logprobs=20)
    assert str(err.value) == "logprobs must be between 0 and 20, got 21"


def test_continuous_usage_stats_as_vllm_reads_them():
    both = {"include_usage": True, "continuous_usage_stats": True}
    assert parse({"prompt": "x", "stream": True, "stream_options": both}, "completion", "m").options["continuous_usage"]
    alone = {"continuous_usage_stats": True}  # without include_usage: no usage at all
    assert not parse({"prompt": "x", "stream": True, "stream_options": alone}, "completion", "m").options[
        "continuous_usage"]
    with pytest.raises(BadParameter) as err:
        parse({"prompt": "x", "stream_options": both}, "completion", "m")
    assert err.value.param == "stream_options"


def test_the_four_prompt_forms_and_n():
    assert parse({"prompt": "x"}, "completion", "m").prompts == ["x"]
    assert parse({"prompt": ["x", "y"], "n": 3}, "completion", "m").prompts == ["x", "y"]
    assert parse({"prompt": [1, 2]}, "completion", "m").prompts == [[1, 2]]
    assert parse({"prompt": [[1, 2], [3]], "n": 2}, "completion", "m").n == 2


def test_fan_out_results_merge_as_openai_does():
    from schemas.openai import Completion, CompletionChoice, UsageInfo
    from workers.gateway.fanout import merge_final, reindex, total_usage

    def result(rid, text, prompt_tokens, completion_tokens):
        return Completion(id=f"cmpl-{rid}", created=1, model="m",
                          choices=[CompletionChoice(index=0, text=text, finish_reason="length")],
                          usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                          total_tokens=prompt_tokens + completion_tokens))
    # 2 prompts x n=2: the prompt's tokens count once per prompt, completions every time
    merged = merge_final([result("a", "0", 5, 3), result("b", "1", 5, 4), result("c", "2", 7, 1),
                          result("d", "3", 7, 2)], prompt_of=[0, 0, 1, 1])
    assert merged.id == "cmpl-a" and [(c.index, c.text) for c in merged.choices] == [(0, "0"), (1, "1"), (2, "2"), (3, "3")]
    assert merged.usage == UsageInfo(prompt_tokens=12, completion_tokens=10, total_tokens=22)
    assert reindex(result("x", "t", 1, 1), 3, "cmpl-a").choices[0].index == 3
    assert total_usage([None, UsageInfo(prompt_tokens=1, completion_tokens=1, total_tokens=2)], [0, 0]) is None


def test_an_answer_that_may_outgrow_a_record_is_asked_for_streamed():
    """Which non-streamed choices the gateway asks for streamed (and assembles): those
    whose logprobs may not fit a result record by their max_tokens. Text alone never is
    (a record per chunk in place of one, for an answer that fits), nor a request without
    max_tokens (guessed to the end of a long context, every chat with logprobs would be)."""
    from workers.client import make_request
    from workers.results import answer_may_outgrow, streamed_inside

    mb = 1_000_000
    assert not answer_may_outgrow(make_request([1] * 10, max_tokens=100_000), mb)
    assert not answer_may_outgrow(make_request([1], logprobs=5, max_tokens=16), mb)
    # top 20 (21 candidates a position): ~930 positions of a completion fit the guess, ~370 of a chat
    assert not answer_may_outgrow(make_request([1], logprobs=20, max_tokens=900), mb)
    assert answer_may_outgrow(make_request([1], logprobs=20, max_tokens=1000), mb)
    assert not answer_may_outgrow(make_request([1], kind="chat", logprobs=True, top_logprobs=20, max_tokens=300), mb)
    assert answer_may_outgrow(make_request([1], kind="chat", logprobs=True, top_logprobs=20, max_tokens=400), mb)
    assert answer_may_outgrow(make_request([1], kind="chat", logprobs=True, max_tokens=10_000), mb)
    assert not answer_may_outgrow(make_request([1], kind="chat", logprobs=True, top_logprobs=20, max_tokens=None), mb)
    # echo: the prompt's positions too
    assert answer_may_outgrow(make_request([1] * 800, logprobs=20, max_tokens=200, echo=True), mb)
    assert not answer_may_outgrow(make_request([1] * 800, logprobs=20, max_tokens=200), mb)
    # streamed already; vLLM's prompt_logprobs, which streamed results do not carry
    assert not answer_may_outgrow(make_request([1], logprobs=20, max_tokens=1000, stream=True), mb)
    assert not answer_may_outgrow(make_request([1], logprobs=20, max_tokens=1000, prompt_logprobs=2), mb)

    request = make_request([1, 2], logprobs=3, max_tokens=7, model="m", echo=True)
    inside = streamed_inside(request)
    assert inside.output.stream and inside.output.include_usage and not inside.output.continuous_usage
    assert (inside.request_id, inside.sampling, inside.output.echo, inside.output.top_logprobs) == (
        request.request_id, request.sampling, True, 3)


async def test_the_stall_watch_gives_up_a_write_that_waits_not_a_stream_waiting_for_its_first_token():
    """workers/gateway/event_stream.py on its own (a `send` stand-in for uvicorn's): a
    request queued longer than --write-timeout before its first token is not a client
    that stopped reading (it was given up as one); a write that waits that long is."""
    from workers.gateway.event_stream import EventStream, StallWatch

    closed = []

    async def events(first_after_s: float):
        try:
            await asyncio.sleep(first_after_s)  # the engine's queue, before the first token
            yield b"data: 1\n\n"
            yield b"data: 2\n\n"
        finally:
            closed.append(True)

    sent = []

    async def send(message):
        sent.append(message)

    watch = StallWatch(0.2)
    slow_start = EventStream(events(0.6), watch, "slow-start")
    await asyncio.wait_for(slow_start.stream_response(send), 10)
    assert not slow_start.stalled and [m.get("body") for m in sent[1:]] == [b"data: 1\n\n", b"data: 2\n\n", b""]

    async def parked_send(message):  # the client's socket full: nothing after the headers leaves
        sent.append(message)
        if len(sent) > 1:
            await asyncio.Event().wait()

    sent.clear()
    parked = EventStream(events(0), watch, "parked")
    await asyncio.wait_for(parked.stream_response(parked_send), 10)
    assert parked.stalled and len(sent) == 2 and closed == [True, True]  # (its generator closed: the slot back)
    assert not watch.streams
    watch.close()


async def test_a_stream_whose_client_went_before_its_headers_is_counted_once_by_its_response():
    """A stream counts itself when its body's generator ends (`_events`). One whose client
    went while its headers were being sent never ran that generator, so nothing counted
    it: `EventStream.on_unstarted` is called then, and only then (ASGI 2.3: Starlette
    listens for the disconnect beside the write, and cancels the write)."""
    from workers.gateway.event_stream import EventStream, StallWatch

    ran = []

    async def events():
        ran.append(True)
        yield b"data: 1\n\n"

    async def parked_send(message):  # the headers never leave: the client's socket is full
        await asyncio.Event().wait()

    async def gone():
        return {"type": "http.disconnect"}

    watch, unstarted = StallWatch(60), []
    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    never = EventStream(events(), watch, "never")
    never.on_unstarted = lambda: unstarted.append("never")
    await asyncio.wait_for(never(scope, gone, parked_send), 10)
    assert unstarted == ["never"] and ran == []

    sent = []

    async def send(message):
        sent.append(message)

    async def reading():
        await asyncio.Event().wait()  # (the client stays)

    whole = EventStream(events(), watch, "whole")
    whole.on_unstarted = lambda: unstarted.append("whole")
    await asyncio.wait_for(whole(scope, reading, send), 10)
    assert unstarted == ["never"] and ran == [True], "a stream that ran counts itself"
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n", b""]
    watch.close()


# --- real HTTP --------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def serving_gateway(settings, tokenizer: str, send_buffer: int | None = None, **config):
    """`genpipe serve` in this process (uvicorn on a free port); yields (base URL, gateway).
    `send_buffer`: the kernel's send buffer of each connection, in bytes (a small one fills
    at once, whatever the machine's autotuning would give)."""
    import socket

    import uvicorn

    from workers.gateway.app import Gateway, GatewayConfig

    port = free_port()
    gateway = Gateway(settings, GatewayConfig(tokenizer=tokenizer, **{"model_name": "tiny", **config}))
    server = uvicorn.Server(uvicorn.Config(gateway.app(), host="127.0.0.1", port=port, log_level="warning"))
    listening = socket.socket()
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer is not None:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)  # (accepted sockets inherit it)
    listening.bind(("127.0.0.1", port))
    serving = asyncio.ensure_future(server.serve(sockets=[listening]))
    try:
        deadline = asyncio.get_running_loop().time() + 60
        while not server.started:
            assert asyncio.get_running_loop().time() < deadline, "the gateway did not start"
            assert not serving.done(), serving.exception() if serving.done() else None
            await asyncio.sleep(0.05)  # polling uvicorn's started flag (no event to wait on)
        yield f"http://127.0.0.1:{port}", gateway
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 30)


@contextlib.asynccontextmanager
async def running_stack(settings, tiny_model_dir, step_s=0.005, keepalive_s=15.0, loaded_engine=None,
                        derender_config=None, **gateway_config):
    """Generate (the synthetic engine, or `loaded_engine`: the tiny model) and derender
    workers (`derender_config`: more DerenderWorkerConfig fields) and a gateway
    (`gateway_config`: more GatewayConfig fields), all in this process."""
    from workers.derender.service import DerenderWorkerConfig, run_derender_worker

    groups = gateway_config.get("worker_groups") or {}
    group = next((g for g, role in groups.items() if role == "generate"), f"{settings.topic_prefix}-generate")
    if loaded_engine is not None:
        gen_stop, gen_task = await start_worker(settings, loaded_engine, group_id=group)
    else:
        gen_stop, gen_task = await start_worker(settings, None, engine="synthetic", engine_in="thread",
                                                synthetic_step_s=step_s, max_batch=8, group_id=group)
    der_stop, der_ready = asyncio.Event(), asyncio.Event()
    der_task = asyncio.ensure_future(run_derender_worker(
        settings, DerenderWorkerConfig(tokenizer=str(tiny_model_dir), group_id=next(
            (g for g, role in groups.items() if role == "derender"), f"{settings.topic_prefix}-derender"),
            **(derender_config or {})),
        stop=der_stop, on_ready=der_ready.set))
    await asyncio.wait_for(der_ready.wait(), 60)
    try:
        async with serving_gateway(settings, str(tiny_model_dir), gateway_id="t1", keepalive_s=keepalive_s,
                                   **gateway_config) as served:
            yield served
    finally:
        gen_stop.set()
        der_stop.set()
        assert await asyncio.wait_for(gen_task, 60) == 0
        assert await asyncio.wait_for(der_task, 60) == 0


@pytest.mark.kafka
async def test_completions_and_chat_over_http_streamed_and_not(kafka_settings, make_topics, tiny_model_dir):
    await make_topics(kafka_settings, partitions=2)
    async with running_stack(kafka_settings, tiny_model_dir) as (base, gateway):
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            r = await http.post("/v1/completions", json={"model": "tiny", "prompt": "Once upon a time",
                                                         "max_tokens": 5, "ignore_eos": True, "logprobs": 20})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 5
            assert len(body["choices"][0]["logprobs"]["tokens"]) == 5
            assert body["choices"][0]["finish_reason"] == "length"

            events = []
            async with http.stream("POST", "/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as s:
                assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
                async for line in s.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            assert [c["usage"] for c in chunks[:-1] if c.get("usage")] == []  # usage only in the last
            assert [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] == "length"]
            assert chunks[-1]["usage"]["completion_tokens"] == 6

            events = []  # vLLM's continuous_usage_stats: the usage so far on every chunk
            async with http.stream("POST", "/v1/completions", json={
                    "model": "tiny", "prompt": "Once", "max_tokens": 5, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as s:
                async for line in s.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[len("data: "):]))
            counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
            assert counts == sorted(counts) and counts[-1] == 5 and len(counts) >= 1
            assert all(e["usage"]["prompt_tokens"] == events[0]["usage"]["prompt_tokens"] for e in events)
            assert not events[-1]["choices"] and events[-1]["usage"]["completion_tokens"] == 5

            fan = await http.post("/v1/completions", json={"model": "tiny", "prompt": ["Once", [5, 6, 7]], "n": 2,
                                                           "max_tokens": 3, "ignore_eos": True, "seed": 1})
            assert fan.status_code == 200, fan.text
            assert [c["index"] for c in fan.json()["choices"]] == [0, 1, 2, 3]
            assert fan.json()["usage"]["completion_tokens"] == 12

            events = []
            async with http.stream("POST", "/v1/completions", json={
                    "model": "tiny", "prompt": "Once", "n": 2, "max_tokens": 4, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}) as s:
                async for line in s.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
            assert events[-1] == "[DONE]"
            parts = [json.loads(e) for e in events[:-1]]
            assert len({p["id"] for p in parts}) == 1  # one response id for every choice
            assert {c["index"] for p in parts for c in p["choices"]} == {0, 1}
            assert [p["usage"] for p in parts if p.get("usage")] == [
                {"prompt_tokens": parts[-1]["usage"]["prompt_tokens"], "completion_tokens": 8,
                 "total_tokens": parts[-1]["usage"]["prompt_tokens"] + 8}]  # one, summed, last

            scored = await http.post("/v1/completions", json={"model": "tiny", "prompt": "Once upon a time",
                                                              "max_tokens": 0, "echo": True, "logprobs": 1})
            assert scored.status_code == 200, scored.text
            choice = scored.json()["choices"][0]
            assert choice["text"] == "Once upon a time" and scored.json()["usage"]["completion_tokens"] == 0
            assert choice["logprobs"]["token_logprobs"][0] is None
            assert all(isinstance(v, float) for v in choice["logprobs"]["token_logprobs"][1:])
            assert len(choice["logprobs"]["tokens"]) == scored.json()["usage"]["prompt_tokens"]

            broken = await http.post("/v1/completions", json={"model": "tiny", "prompt": [[5, 6], [5, 10**6]],
                                                              "max_tokens": 50, "ignore_eos": True})
            assert broken.status_code == 400 and "out of range" in broken.json()["error"]["message"]

            late = await http.post("/v1/completions", headers={"X-Request-Timeout": "0.001"},
                                   json={"model": "tiny", "prompt": "x", "max_tokens": 500, "ignore_eos": True})
            assert late.status_code == 200 and late.json()["choices"][0]["finish_reason"] == "abort"
            bad_timeout = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "timeout": -1})
            assert bad_timeout.status_code == 400 and bad_timeout.json()["error"]["param"] == "timeout"
            huge_timeout = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "timeout": 10**400})
            assert huge_timeout.status_code == 400 and huge_timeout.json()["error"]["param"] == "timeout"
            nested = await http.post("/v1/completions", content=b'{"prompt": "x", "junk": ' + b"[" * 5000 + b"]" * 5000
                                     + b"}", headers={"content-type": "application/json"})
            assert nested.status_code == 400 and "nested too deeply" in nested.json()["error"]["message"]
            # the last seed: choice 1's seed (seed + 1) wraps into 64 bits, not past them
            top_seed = await http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6], "n": 2,
                                                                "max_tokens": 2, "ignore_eos": True, "seed": 2**63 - 1})
            assert top_seed.status_code == 200 and len(top_seed.json()["choices"]) == 2, top_seed.text
            wide = await http.post("/v1/completions", json={"model": "tiny", "prompt": [5] * 250_000, "n": 64})
            assert wide.status_code == 400 and wide.json()["error"]["param"] == "prompt"
            assert "250000 tokens but the model's context is" in wide.json()["error"]["message"]

            bad = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "logit_bias": {"1": 2}})
            assert bad.status_code == 400
            assert bad.json()["error"] == {"message": "logit_bias is not supported by genpipe",
                                           "type": "invalid_request_error", "param": "logit_bias", "code": 400}
            assert (await http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})).status_code == 404
            assert (await http.post("/v1/completions", content=b"{not json")).status_code == 400
            models = (await http.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["tiny"]
            assert models["data"][0]["root"] == "tiny" and models["data"][0]["permission"] == []  # (vLLM's card)
            health = await http.get("/health")
            assert health.status_code == 200, health.text
        assert gateway.in_flight == 0


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from workers.generate.engine import Engine

    return Engine(str(tiny_model_dir), max_batch=16, max_logprobs=20)


def _teacher_forced(tiny_model_dir, ids: list[int]):
    """Per prompt position i >= 1: the model's log-softmax over the vocabulary after ids[:i]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check_against_model(entries, ids, logp, k):
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        row = logp[i - 1]
        entry = entries[i]
        assert str(ids[i]) in entry and list(entry)[0] == str(ids[i])  # the prompt token first
        assert len(entry) in (k, k + 1)  # the top k, and the prompt token when it is not among them
        for tid, lp in entry.items():
            assert lp["logprob"] == pytest.approx(row[int(tid)].item(), abs=1e-4)
            v = row[int(tid)]  # (ranks within a rounding: engine and HF differ by ~3e-6 on some CPUs)
            assert 1 + int((row > v + 1e-5).sum()) <= lp["rank"] <= int((row >= v - 1e-5).sum())
            assert tid == str(ids[i]) or lp["rank"] <= k
            assert isinstance(lp["decoded_token"], str)


@pytest.mark.kafka
async def test_prompt_logprobs_are_the_models_teacher_forced_logprobs(kafka_settings, make_topics, tiny_model_dir,
                                                                      engine):
    from workers.client import render_chat, render_prompt

    await make_topics(kafka_settings, partitions=2)
    ids = render_prompt(tiny_model_dir, "Once upon a time, a little fox")
    async with running_stack(kafka_settings, tiny_model_dir, loaded_engine=engine) as (base, gateway):
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            r = await http.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 2,
                                                         "temperature": 0, "prompt_logprobs": 3})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            logp = _teacher_forced(tiny_model_dir, ids)
            _check_against_model(choice["prompt_logprobs"], ids, logp, 3)
            assert choice["logprobs"] is None  # the output's logprobs were not asked for

            # echo renders the same prompt logprobs its own way: equal values and token texts
            echo = await http.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 0,
                                                            "echo": True, "logprobs": 3, "prompt_logprobs": 0})
            assert echo.status_code == 200, echo.text
            echoed = echo.json()["choices"][0]
            for i in range(1, len(ids)):
                (tid, lp), = echoed["prompt_logprobs"][i].items()  # prompt_logprobs 0: the token only
                assert tid == str(ids[i]) and lp["decoded_token"] == echoed["logprobs"]["tokens"][i]
                assert lp["logprob"] == pytest.approx(echoed["logprobs"]["token_logprobs"][i], abs=1e-5)
                assert lp["logprob"] == pytest.approx(choice["prompt_logprobs"][i][tid]["logprob"], abs=1e-5)

            plain = await http.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 1})
            assert "prompt_logprobs" not in plain.json()["choices"][0]  # only when asked for

            messages = [{"role": "user", "content": "Hello"}]
            chat = await http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "n": 2,
                                                                 "max_tokens": 1, "prompt_logprobs": 2})
            assert chat.status_code == 200, chat.text
            chat_ids = render_chat(tiny_model_dir, messages)
            assert "prompt_logprobs" not in chat.json()["choices"][0]  # vLLM: on the response, for chat
            _check_against_model(chat.json()["prompt_logprobs"], chat_ids, _teacher_forced(tiny_model_dir, chat_ids), 2)

            streamed = await http.post("/v1/completions", json={"model": "tiny", "prompt": ids, "stream": True,
                                                                "prompt_logprobs": 1})
            assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
        assert gateway.in_flight == 0


@pytest.mark.kafka
async def test_a_non_streamed_answer_too_large_for_one_record_comes_whole(kafka_settings, make_topics,
                                                                          tiny_model_dir, engine):
    """A non-streamed answer comes in one result record: with logprobs, a few hundred
    tokens passed the record limit, and the derender ended the request with a 400 telling
    the caller to stream. The gateway now asks for such a request streamed and assembles
    its records: the answer the one record gives, whole, and one too large for a record
    comes too, within --max-answer-mib. One that fits its guess still comes in one record.
    The client library's `complete()` does the same (the gateway's answers are its).
    (Record limits of 5,000 bytes for the gateway's guess and 20,000 for the derender
    stand for Kafka's ~1 MB.)"""
    import msgspec

    from schemas import Cancel, GenerateRequest
    from tests.kafka_helpers import read_to_end, read_topic
    from workers.client import AnswerBudget, GenpipeClient, GenpipeError, make_request
    from workers.kafka.records import decode_message

    await make_topics(kafka_settings, partitions=2)
    limit = 20_000
    medium = dict(prompt_token_ids=[1, 5, 6], max_tokens=40, ignore_eos=True, temperature=0, logprobs=5, echo=True)
    large = {**medium, "max_tokens": 300}  # ~50 kB as one record (~160 bytes a position)
    chat = dict(kind="chat", max_tokens=120, ignore_eos=True, temperature=0, logprobs=True, top_logprobs=5)

    def http_body(options: dict) -> dict:
        body = {k: v for k, v in options.items() if k not in ("prompt_token_ids", "kind")}
        return {"model": "tiny", "prompt": options["prompt_token_ids"], **body}

    async with running_stack(kafka_settings, tiny_model_dir, loaded_engine=engine, max_record_bytes=5_000,
                             max_answer_bytes=200_000, derender_config={"max_record_bytes": limit}) \
            as (base, gateway), httpx.AsyncClient(base_url=base, timeout=60) as http:
        # the one-record path, as the client library sends a request
        async with GenpipeClient(settings=kafka_settings) as client:
            one_record = await client.complete(make_request(**medium, model="tiny"))
            async with contextlib.aclosing(client.stream(make_request(**large, model="tiny"),
                                                         raise_errors=False)) as results:
                too_large = await results.__anext__()
        async with GenpipeClient(settings=kafka_settings, max_record_bytes=5_000) as client:
            library_whole = await client.complete(make_request(**large, model="tiny"))
            with pytest.raises(GenpipeError) as over_budget:
                await client.complete(make_request(**large, model="tiny"), budget=AnswerBudget(10_000))
        switched = await http.post("/v1/completions", json=http_body(medium))
        whole = await http.post("/v1/completions", json=http_body(large))
        whole_chat = await http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hello there"}],
            **{k: v for k, v in chat.items() if k != "kind"}})
        small = await http.post("/v1/completions", json={**http_body(medium), "max_tokens": 3, "logprobs": 1,
                                                         "echo": False})
        streamed_chat = await _sse(http, "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "Hello there"}],
            **{k: v for k, v in chat.items() if k != "kind"}, "stream": True})
        # --max-answer-mib: the request's records all told (8 × ~50 kB past 200 kB), then 400
        over = await http.post("/v1/completions", json={**http_body(large), "n": 8})
        assert gateway.in_flight == 0

    # the switched answer is the one record's, field for field (but its id and time)
    assert switched.status_code == 200, switched.text
    got, expected = ({k: v for k, v in answer.items() if k not in ("id", "created")}
                     for answer in (switched.json(), msgspec.to_builtins(one_record)))
    assert got == expected and got["choices"][0]["logprobs"]["tokens"], (got, expected)
    # one too large for a record: the derender's 400 on the one-record path, whole here
    assert too_large.error.code == 400 and "result too large" in too_large.error.message, too_large
    assert whole.status_code == 200, whole.text
    (answer,) = whole.json()["choices"]
    assert answer["finish_reason"] == "length" and whole.json()["usage"]["completion_tokens"] == 300
    assert len(answer["logprobs"]["tokens"]) == 303 and len(whole.content) > limit  # (echo: the prompt's 3)
    assert answer["logprobs"]["text_offset"] == sorted(answer["logprobs"]["text_offset"])
    # the library's complete(): the same answer, and its budget
    assert msgspec.to_builtins(library_whole.choices) == whole.json()["choices"]
    assert over_budget.value.code == 400 and "the answer passed 10000 bytes" in over_budget.value.message
    (message,) = whole_chat.json()["choices"]
    assert message["message"] == {"role": "assistant", "content": "".join(
        e["choices"][0]["delta"].get("content") or "" for e in streamed_chat if e["choices"])}
    assert message["logprobs"]["content"] == [x for e in streamed_chat if e["choices"]
                                              for x in e["choices"][0]["logprobs"]["content"]]
    assert len(message["logprobs"]["content"]) == 120 and whole_chat.json()["usage"]["completion_tokens"] == 120
    assert small.status_code == 200 and len(small.json()["choices"][0]["logprobs"]["tokens"]) == 3
    assert over.status_code == 400 and "the answer passed 200000 bytes" in over.json()["error"]["message"], over.text
    # asked for as the client asked: streamed inside only where the answer may outgrow a record
    requests = [decode_message(r, GenerateRequest)
                for r in await read_to_end(kafka_settings, kafka_settings.topic("requests"))]
    asked = {r.request_id: r.output.stream for r in requests}
    for response, inside in ((switched, True), (whole, True), (whole_chat, True), (small, False)):
        assert asked[response.json()["id"].split("-", 1)[1]] is inside
    # and the choices of the request over the budget were cancelled (the one that passed it, the rest)
    over_ids = {r.request_id for r in requests if r.sampling.max_tokens == 300 and r.output.stream} - {
        whole.json()["id"].split("-", 1)[1], library_whole.id.split("-", 1)[1], over_budget.value.request_id}
    assert len(over_ids) == 8
    over_ids.add(over_budget.value.request_id)  # (the library's too: its client cancels what it gives up)
    await read_topic(kafka_settings, kafka_settings.topic("cancel"), timeout=30, until=lambda records: over_ids <= {
        decode_message(r, Cancel).request_id for r in records})


@pytest.mark.kafka
async def test_a_switched_answer_is_waited_for_as_long_as_one_record(kafka_settings, make_topics, tiny_model_dir):
    """--answer-timeout bounds a non-streamed answer whole; asked for streamed inside, its
    records each came within it and the answer ran on for as long as generation did. It
    gets the one record's 504, and is cancelled."""
    await make_topics(kafka_settings, partitions=2)
    async with running_stack(kafka_settings, tiny_model_dir, step_s=0.05, answer_timeout_s=1.0,
                             max_record_bytes=5_000) as (base, gateway), \
            httpx.AsyncClient(base_url=base, timeout=60) as http:
        body = {"model": "tiny", "prompt": [1, 5, 6], "max_tokens": 100, "ignore_eos": True, "logprobs": 5}  # ~5 s
        r = await http.post("/v1/completions", json=body)
        # (its records came every 50 ms: only a deadline on the whole answer gives 504)
        assert r.status_code == 504 and "did not come whole within 1 s" in r.json()["error"]["message"], r.text
        assert gateway.in_flight == 0


async def _sse(http, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed request (without [DONE])."""
    events = []
    async with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    assert not any("error" in e for e in events), events
    return events


@pytest.mark.kafka
async def test_tokenize_and_detokenize_lend_the_deployments_tokenizer(kafka_settings, make_topics, tiny_model_dir):
    """vLLM's /tokenize and /detokenize: a client that sends token ids (genpipe's own use)
    gets them from the gateway's tokenizer and chat template, and the text of ids it got
    back; what a generation request's text prompt becomes, id for id."""
    from workers.client import load_tokenizer, render_chat, render_prompt

    await make_topics(kafka_settings, partitions=1)
    tokenizer = load_tokenizer(str(tiny_model_dir))
    text, messages = "Once upon a time, a fox", [{"role": "user", "content": "Hello there"}]
    async with serving_gateway(kafka_settings, str(tiny_model_dir), gateway_id="tok") as (base, gateway), \
            httpx.AsyncClient(base_url=base, timeout=60) as http:
        plain = (await http.post("/tokenize", json={"model": "tiny", "prompt": text})).json()
        assert plain["tokens"] == render_prompt(tiny_model_dir, text) and plain["count"] == len(plain["tokens"])
        assert plain["max_model_len"] == gateway.max_model_len and "token_strs" not in plain
        bare = (await http.post("/tokenize", json={"prompt": text, "add_special_tokens": False,
                                                   "return_token_strs": True})).json()
        assert bare["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"] != plain["tokens"]
        assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(bare["tokens"])
        chat = (await http.post("/tokenize", json={"messages": messages})).json()
        assert chat["tokens"] == render_chat(tiny_model_dir, messages)
        opened = (await http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})).json()
        assert opened["tokens"] != chat["tokens"]  # (without the template's "[assistant]:")
        assert chat["tokens"][:len(opened["tokens"])] == opened["tokens"]
        back = await http.post("/detokenize", json={"model": "tiny", "tokens": bare["tokens"]})
        assert back.status_code == 200 and back.json() == {"prompt": text}

        # every field hostile: a 400 (404 for another model) naming it, in OpenAI's shape
        vocab = len(tokenizer)
        for path, body, status, param, says in [
                ("/tokenize", {"prompt": 5}, 400, "prompt", "prompt must be a string"),
                ("/tokenize", {"messages": [{"content": "x"}]}, 400, "messages[0]", "with a role"),
                ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, 400, "return_token_strs", "true or false"),
                ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
                ("/tokenize", {"messages": messages, "add_special_tokens": True}, 400, "add_special_tokens",
                 "not supported"),
                ("/tokenize", {"messages": messages, "chat_template": "{{ 1 }}"}, 400, "chat_template",
                 "not supported"),
                ("/tokenize", {"messages": messages, "continue_final_message": True}, 400,
                 "continue_final_message", "not supported"),
                ("/tokenize", [1, 2], 400, "body", "JSON object"),
                ("/detokenize", {"tokens": [1, vocab]}, 400, "tokens", f"tokens[1] = {vocab} is not a token id"),
                ("/detokenize", {"tokens": [1, -1]}, 400, "tokens", "tokens[1] = -1 is not a token id"),
                ("/detokenize", {"tokens": [1, 2 ** 64]}, 400, "tokens", "64-bit integers"),
                ("/detokenize", {"tokens": "1 2"}, 400, "tokens", "64-bit integers"),
                ("/detokenize", {}, 400, "tokens", "64-bit integers")]:
            r = await http.post(path, json=body)
            assert r.status_code == status, (path, body, r.text)
            error = r.json()["error"]
            assert error["param"] == param and says in error["message"], (path, body, error)
        r = await http.post("/tokenize", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


@pytest.mark.kafka
async def test_the_openai_sdk_works_against_the_gateway(kafka_settings, make_topics, tiny_model_dir):
    import openai

    await make_topics(kafka_settings, partitions=2)
    async with running_stack(kafka_settings, tiny_model_dir) as (base, _):
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
        done = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=4, extra_body={"ignore_eos": True})
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 4
        text = []
        stream = await client.completions.create(model="tiny", prompt="Once", max_tokens=4, stream=True,
                                                 extra_body={"ignore_eos": True})
        async for part in stream:
            text.append(part.choices[0].text)
        assert "".join(text) and len(text) >= 1
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="nope", prompt="x", max_tokens=1)
        await client.close()


@pytest.mark.kafka
async def test_a_client_that_goes_away_cancels_its_request(kafka_settings, make_topics, tiny_model_dir):
    from schemas import Cancel
    from tests.kafka_helpers import read_topic
    from workers.kafka.records import decode_message

    await make_topics(kafka_settings, partitions=2)
    async with running_stack(kafka_settings, tiny_model_dir) as (base, gateway):
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json={
                    "model": "tiny", "prompt": "x", "max_tokens": 1500, "ignore_eos": True, "stream": True}) as s:
                async for line in s.aiter_lines():
                    if line.startswith("data: "):
                        request_id = json.loads(line[len("data: "):])["id"].removeprefix("cmpl-")
                        break  # one event, then hang up
        cancels = await read_topic(kafka_settings, kafka_settings.topic("cancel"), timeout=30,
                                   until=lambda records: len(records) >= 1)
        assert "HTTP" in decode_message(cancels[0], Cancel).reason
        # ... and the engine let it go: its last record (nobody reads it) is an abort, long
        # before its 1,500 tokens (7.5 s of 5 ms steps).
        finals = await read_topic(kafka_settings, gateway.reply_topic, timeout=30, until=lambda records: any(
            r.key == request_id.encode() and dict(r.headers).get("genpipe-final") == b"1" for r in records))
        final = next(r for r in finals if r.key == request_id.encode() and dict(r.headers).get("genpipe-final"))
        assert json.loads(final.value)["choices"][0]["finish_reason"] == "abort"
        deadline = asyncio.get_running_loop().time() + 30
        while gateway.in_flight:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)  # polling a counter the response task decrements


@pytest.mark.kafka
async def test_a_reader_that_falls_behind_is_cut_off_and_its_request_cancelled(kafka_settings, make_topics,
                                                                              tiny_model_dir, monkeypatch):
    """The bound behind --max-unread, on the client the gateway uses: a request whose reader
    stops taking records (an HTTP client that stopped reading parks the gateway's writer)
    is cancelled as soon as `max_unread` records wait, the oldest for `STALLED_AFTER_S`
    (0.5 s here), without waiting for that reader; the reader, when it comes back, gets
    GenpipeOverflow (the gateway's error event)."""
    from schemas import Cancel
    from tests.kafka_helpers import read_topic
    from workers.client import GenpipeClient, GenpipeOverflow, make_request
    from workers.kafka.records import decode_message

    import workers.mailbox

    await make_topics(kafka_settings, partitions=2)
    monkeypatch.setattr(workers.mailbox, "STALLED_AFTER_S", 0.5)
    async with running_stack(kafka_settings, tiny_model_dir, step_s=0.002):
        async with GenpipeClient(settings=kafka_settings, max_unread=8, timeout_s=60) as client:
            request = make_request([1, 5, 6], max_tokens=100_000, ignore_eos=True, stream=True)  # (till cancelled)
            records = client.records(request)
            first = await records.__anext__()  # sent, its first record read; then not reading
            assert not first.final
            cancels = await read_topic(kafka_settings, kafka_settings.topic("cancel"), timeout=60,
                                       until=lambda records: len(records) >= 1)
            cancel = decode_message(cancels[0], Cancel)
            assert cancel.request_id == request.request_id
            assert "fell 8 result records behind" in cancel.reason and "max_unread" in cancel.reason
            with pytest.raises(GenpipeOverflow) as raised:
                async for _ in records:
                    pass
            assert raised.value.code == 500 and "fell 8 result records behind" in raised.value.message
            await records.aclose()
        cancels = await read_topic(kafka_settings, kafka_settings.topic("cancel"), timeout=10,
                                   until=lambda records: len(records) >= 1)
        assert len(cancels) == 1  # once: not again when the reader left


@pytest.mark.kafka
async def test_a_stream_whose_client_reads_nothing_is_given_up_and_frees_its_slot(kafka_settings, make_topics,
                                                                                 tiny_model_dir):
    """An HTTP client that keeps its socket open and reads nothing parks the stream's
    writer once the socket's buffers are full. The request was cancelled (--max-unread),
    but the stream kept its --max-in-flight slot until the client closed. Now a write
    that waits --write-timeout ends the stream: the slot comes back and the request is
    cancelled, while the client still holds its socket. Counted as a client that went
    first (499), not as answered."""
    import socket

    from schemas import Cancel
    from tests.kafka_helpers import read_topic, wait_for
    from workers.kafka.records import decode_message

    await make_topics(kafka_settings, partitions=2)
    # (max_unread out of the way: the write timeout alone gives the stream up)
    async with running_stack(kafka_settings, tiny_model_dir, step_s=0.002, write_timeout_s=1.0,
                             send_buffer=4096, max_unread=100_000) as (base, gateway):
        body = json.dumps({"model": "tiny", "prompt": [1, 5, 6], "max_tokens": 3000, "ignore_eos": True,
                           "stream": True}).encode()
        gone_before = _requests("completions", 499)
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connecting: the window)
        client.connect(("127.0.0.1", int(base.rsplit(":", 1)[1])))  # (loopback: at once)
        try:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await wait_for(lambda: gateway.in_flight == 1, 30, "the stream under way")
            await wait_for(lambda: gateway.in_flight == 0, 60, "the stalled stream to give its slot back")
            assert _requests("completions", 499) == gone_before + 1
            cancels = await read_topic(kafka_settings, kafka_settings.topic("cancel"), timeout=60,
                                       until=lambda records: len(records) >= 1)
        finally:
            client.close()
    assert decode_message(cancels[0], Cancel).reason == "the HTTP stream ended before the request"


@pytest.mark.kafka
async def test_a_stream_whose_client_fell_behind_ends_with_an_error_event_and_counts_as_gone(
        kafka_settings, make_topics, tiny_model_dir, monkeypatch):
    """--max-unread through HTTP: a client that stops reading while its request produces is
    given up once that many records wait (the oldest for STALLED_AFTER_S) and its request
    cancelled; when it reads again its stream ends with the error event that says so. It
    counts as a client that went first (499), as one the stall watch gives up, not as the
    error event's code (500): nothing failed in genpipe."""
    import socket

    import workers.mailbox
    from schemas import Cancel
    from tests.kafka_helpers import read_topic, wait_for
    from workers.kafka.records import decode_message

    monkeypatch.setattr(workers.mailbox, "STALLED_AFTER_S", 0.5)
    await make_topics(kafka_settings, partitions=2)
    # (the write timeout out of the way: the bound on unread records alone gives it up)
    async with running_stack(kafka_settings, tiny_model_dir, step_s=0.002, write_timeout_s=300.0,
                             send_buffer=4096, max_unread=8) as (base, gateway):
        body = json.dumps({"model": "tiny", "prompt": [1, 5, 6], "max_tokens": 100_000, "ignore_eos": True,
                           "stream": True}).encode()
        gone_before, failed_before = _requests("completions", 499), _requests("completions", 500)
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connecting: the window)
        client.connect(("127.0.0.1", int(base.rsplit(":", 1)[1])))
        client.setblocking(False)
        loop, received = asyncio.get_running_loop(), bytearray()
        try:
            await loop.sock_sendall(client, b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: "
                                            b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            cancels = await read_topic(kafka_settings, kafka_settings.topic("cancel"), timeout=60,
                                       until=lambda records: len(records) >= 1)
            assert "fell 8 result records behind" in decode_message(cancels[0], Cancel).reason
            assert gateway.in_flight == 1  # (its writer still parked on the full socket)

            async def read_to_the_end():  # (chunked: the last chunk is empty)
                while not received.endswith(b"0\r\n\r\n"):
                    data = await loop.sock_recv(client, 65536)
                    assert data, "the connection closed before the stream ended"
                    received.extend(data)

            await asyncio.wait_for(read_to_the_end(), 60)
            await wait_for(lambda: gateway.in_flight == 0, 30, "the stream to give its slot back")
        finally:
            client.close()
    events = [line for line in bytes(received).split(b"\r\n") if line.startswith(b"data: ")]
    last = json.loads(events[-1][len(b"data: "):])
    assert last["error"]["code"] == 500 and "fell 8 result records behind" in last["error"]["message"], last
    assert b"data: [DONE]" not in events
    assert (_requests("completions", 499) - gone_before, _requests("completions", 500) - failed_before) == (1, 0)


@pytest.mark.kafka
async def test_an_idle_stream_gets_keep_alive_comments(kafka_settings, make_topics, tiny_model_dir):
    await make_topics(kafka_settings, partitions=2)
    async with running_stack(kafka_settings, tiny_model_dir, step_s=0.3, keepalive_s=0.05) as (base, _):
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            relayed_before, answered_before = _relayed(await http.get("/metrics")), _requests("completions", 200)
            lines = []
            async with http.stream("POST", "/v1/completions", json={
                    "model": "tiny", "prompt": "x", "max_tokens": 3, "ignore_eos": True, "stream": True}) as s:
                async for line in s.aiter_lines():
                    lines.append(line)
            relayed = _relayed(await http.get("/metrics")) - relayed_before
    assert ": keep-alive" in lines  # between tokens 0.3 s apart
    events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    # /metrics: every event's relay time (its record read -> handed to the HTTP server) observed
    assert relayed == len(events) - 1
    # and the stream counted once it ended, as answered whole
    assert _requests("completions", 200) - answered_before == 1


def _relayed(metrics: httpx.Response) -> float:
    assert metrics.status_code == 200
    line = next(line for line in metrics.text.splitlines() if line.startswith("genpipe_gateway_relay_seconds_count"))
    return float(line.split()[-1])


def _requests(route: str, status: int) -> float:
    """genpipe_gateway_requests_total for /v1/`route` and `status`, counted so far in this process."""
    from prometheus_client import REGISTRY

    labels = {"route": f"/v1/{route}", "status": str(status)}
    return REGISTRY.get_sample_value("genpipe_gateway_requests_total", labels) or 0.0


@pytest.mark.kafka
async def test_without_workers_health_is_503_and_a_request_times_out_with_504(kafka_settings, make_topics,
                                                                              tiny_model_dir, monkeypatch, caplog):
    from workers.kafka import groups

    admins = []
    make_admin = groups.make_admin
    monkeypatch.setattr(groups, "make_admin", lambda settings: admins.append(1) or make_admin(settings))
    await make_topics(kafka_settings, partitions=2)
    async with serving_gateway(kafka_settings, str(tiny_model_dir), gateway_id="lonely", timeout_s=1.0,
                               answer_timeout_s=1.0) as \
            (base, gateway), httpx.AsyncClient(base_url=base, timeout=60) as http:
        before = {(route, status): _requests(route, status)
                  for route in ("completions", "chat/completions") for status in (400, 504)}
        health = await http.get("/health")
        assert health.status_code == 503 and "no generate worker" in health.json()["reason"]
        # a burst of checks (a load balancer's, anyone's: /health takes no credentials)
        # shares one look at the groups; each opened an admin client
        burst = await asyncio.gather(*(http.get("/health") for _ in range(20)))
        assert {r.status_code for r in burst} == {503} and len(admins) <= 2, len(admins)
        r = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
        assert "raise --answer-timeout" in r.json()["error"]["message"]
        # a stream gets its timeout as an error event after its 200
        async with http.stream("POST", "/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True}) as s:
            lines = [line async for line in s.aiter_lines() if line.startswith("data: ")]
        assert s.status_code == 200 and '"code":504' in lines[-1], lines
        # what an operator checks (the cluster, the topic prefix) is logged, not told the caller
        for text in (r.text, lines[-1]):
            assert "no result for request " in text and " within 1 s" in text, text
            assert kafka_settings.bootstrap_servers not in text and kafka_settings.topic_prefix not in text, text
        logged = [m for m in caplog.messages if "are a generate and a derender worker running" in m]
        assert len(logged) == 2 and all(kafka_settings.bootstrap_servers in m for m in logged), caplog.messages
        bad = await http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1})
        assert bad.status_code == 400
        assert gateway.in_flight == 0
    # counted by route and the status its client got (a stream's: its error event's),
    # which the workers' metrics cannot see
    counted = {key: _requests(*key) - count for key, count in before.items()}
    assert counted == {("completions", 400): 1, ("completions", 504): 1,
                       ("chat/completions", 400): 0, ("chat/completions", 504): 1}


@pytest.mark.kafka
async def test_health_looks_at_the_worker_groups_it_is_given(kafka_settings, make_topics, tiny_model_dir):
    """Workers run with a --group-id of their own: /health looked only at
    <prefix>-generate and <prefix>-derender, and said 503 for good (a load balancer sent
    the gateway nothing). `serve --generate-group-id / --derender-group-id` name them."""
    await make_topics(kafka_settings, partitions=1)
    groups = {"team-gen": "generate", "team-der": "derender"}
    async with running_stack(kafka_settings, tiny_model_dir, worker_groups=groups) as (base, _), \
            httpx.AsyncClient(base_url=base, timeout=60) as http:
        health = await http.get("/health")
        assert health.status_code == 200, health.text
        async with serving_gateway(kafka_settings, str(tiny_model_dir), gateway_id="t2") as (other, _):
            unaware = await http.get(f"{other}/health")  # the defaults: no such groups here
    prefix = kafka_settings.topic_prefix
    assert unaware.status_code == 503 and unaware.json()["reason"] == (
        f"no generate worker (consumer group {prefix}-generate has no members); "
        f"no derender worker (consumer group {prefix}-derender has no members)")


@pytest.mark.kafka
async def test_a_non_streamed_answer_longer_than_the_stream_timeout_is_waited_for(kafka_settings, make_topics,
                                                                                tiny_model_dir):
    """A non-streamed answer comes in one record when its request ends: with --timeout (a
    stream's wait between two records) as its wait, every answer that took longer got
    504 and its request was cancelled. It waits --answer-timeout, or the request's own
    timeout if longer."""
    await make_topics(kafka_settings, partitions=2)
    async with running_stack(kafka_settings, tiny_model_dir, step_s=0.05, timeout_s=1.0, answer_timeout_s=1.0) \
            as (base, _), httpx.AsyncClient(base_url=base, timeout=60) as http:
        long = {"model": "tiny", "prompt": [1, 5, 6], "max_tokens": 60, "ignore_eos": True}  # ~3 s
        r = await http.post("/v1/completions", json={**long, "timeout": 30})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 60
        r = await http.post("/v1/completions", json=long)
        assert r.status_code == 504  # (--answer-timeout 1 s: the request's own timeout raised it above)


@pytest.mark.kafka
async def test_serve_max_model_len_is_the_context_the_gateway_checks_and_reports(kafka_settings, make_topics,
                                                                                  tiny_model_dir, caplog, tmp_path):
    """Generate workers run with `--max-model-len` below the model's: the gateway takes
    the same flag, refuses a prompt that long itself, and /v1/models and /tokenize report
    it (they gave the model's 2048, or null for a tokenizer directory without config.json,
    where vLLM always gives a number)."""
    import shutil

    from workers.gateway.commands import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert parser.parse_args(["serve", "--max-model-len", "40"]).max_model_len == 40
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--max-model-len", "0"])

    await make_topics(kafka_settings, partitions=1)
    async with serving_gateway(kafka_settings, str(tiny_model_dir), gateway_id="ctx", max_model_len=40) as (
            base, gateway), httpx.AsyncClient(base_url=base, timeout=60) as http:
        assert (await http.get("/v1/models")).json()["data"][0]["max_model_len"] == 40
        assert (await http.post("/tokenize", json={"prompt": "a fox"})).json()["max_model_len"] == 40
        r = await http.post("/v1/completions", json={"model": "tiny", "prompt": [5] * 40})
        assert r.status_code == 400 and "40 tokens but the model's context is 40" in r.json()["error"]["message"]

    from workers.gateway.app import Gateway, GatewayConfig

    bare = tmp_path / "tokenizer-only"  # (a tokenizer directory without the model's config.json)
    shutil.copytree(tiny_model_dir, bare, ignore=shutil.ignore_patterns("config.json", "*.safetensors"))
    with caplog.at_level(logging.WARNING, logger="workers.gateway.app"):
        assert Gateway(kafka_settings, GatewayConfig(tokenizer=str(bare))).max_model_len is None
    assert "pass --max-model-len" in caplog.text
    assert Gateway(kafka_settings, GatewayConfig(tokenizer=str(bare), max_model_len=64)).max_model_len == 64


@pytest.mark.kafka
async def test_allowed_origins_let_those_pages_call_the_gateway_from_a_browser(kafka_settings, make_topics,
                                                                               tiny_model_dir):
    """A web page's call (CORS): with `--allowed-origins` its preflight passes and the
    answers, a stream's too, carry Access-Control-Allow-Origin; another origin's page and
    a gateway without the flag (the default) give browsers no such header."""
    from workers.gateway.commands import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert parser.parse_args(["serve"]).allowed_origins == ()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--allowed-origins", "app.example.com"])  # (no scheme: would never match)

    page, other = "https://app.example.com", "https://elsewhere.example.com"
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type,x-request-timeout"}
    await make_topics(kafka_settings, partitions=1)
    allowed = parser.parse_args(["serve", "--allowed-origins", f"{page}, http://localhost:3000"]).allowed_origins
    async with serving_gateway(kafka_settings, str(tiny_model_dir), gateway_id="cors", timeout_s=1.0,
                               allowed_origins=allowed) as (base, _), \
            httpx.AsyncClient(base_url=base, timeout=60) as http:
        r = await http.options("/v1/chat/completions", headers={"Origin": page, **preflight})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "x-request-timeout" in r.headers["access-control-allow-headers"].lower()
        r = await http.options("/v1/chat/completions", headers={"Origin": other, **preflight})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = await http.post("/tokenize", json={"prompt": "a fox"}, headers={"Origin": page})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        async with http.stream("POST", "/v1/completions", headers={"Origin": page}, json={
                "model": "tiny", "prompt": [1, 2], "max_tokens": 2, "stream": True}) as stream:
            assert stream.headers["access-control-allow-origin"] == page  # (no worker here: it ends in a 504 event)
            assert "504" in (await stream.aread()).decode()
    async with serving_gateway(kafka_settings, str(tiny_model_dir), gateway_id="nocors") as (base, _), \
            httpx.AsyncClient(base_url=base, timeout=60) as http:
        r = await http.post("/tokenize", json={"prompt": "a fox"}, headers={"Origin": page})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = await http.options("/v1/chat/completions", headers={"Origin": page, **preflight})
        assert "access-control-allow-origin" not in r.headers


def test_api_keys_are_read_and_compared_as_a_bearer_header_carries_them():
    from workers.gateway.api_keys import api_keys, bearer_key, key_digest, key_matches

    assert api_keys("") == () and api_keys(" k1 , k2,") == ("k1", "k2")
    for bad in ("has space", "tab\tkey", "ünï"):
        with pytest.raises(argparse.ArgumentTypeError):
            api_keys(bad)
    assert bearer_key([(b"authorization", b"Bearer k1")]) == b"k1"
    assert bearer_key([(b"authorization", b"bearer  k1 ")]) == b"k1"
    assert bearer_key([(b"authorization", b"Basic k1")]) is None
    assert bearer_key([(b"authorization", b"Bearer")]) is None and bearer_key([]) is None
    digests = (key_digest(b"k1"), key_digest(b"k2"))
    assert key_matches(b"k2", digests) and not key_matches(b"k3", digests) and not key_matches(b"k", digests)
    assert not key_matches(None, digests) and not key_matches(key_digest(b"k1"), digests)


@pytest.mark.kafka
async def test_a_gateway_with_api_keys_answers_only_callers_that_send_one(kafka_settings, make_topics,
                                                                         tiny_model_dir):
    """`serve --api-key`: a call without one of the keys gets 401 in OpenAI's shape and
    reaches nothing (no request on the topic), counted; the OpenAI SDK's api_key passes;
    the probes stay open, and a browser's preflight (no credentials) is answered."""
    import openai

    from tests.kafka_helpers import read_to_end
    from workers.gateway.commands import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    keys = parser.parse_args(["serve", "--api-key", "old-key,new-key"]).api_key
    assert keys == ("old-key", "new-key") and parser.parse_args(["serve"]).api_key == ()

    await make_topics(kafka_settings, partitions=1)
    body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 2}
    refused_before = _requests("completions", 401)
    async with serving_gateway(kafka_settings, str(tiny_model_dir), gateway_id="keys", timeout_s=1.0,
                               answer_timeout_s=1.0, api_keys=keys,
                               allowed_origins=("https://app.example.com",)) as (base, _), \
            httpx.AsyncClient(base_url=base, timeout=60) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic new-key"},
                        {"Authorization": "Bearer"}):
            r = await http.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key" and "Authorization: Bearer" in r.text
        for path in ("/v1/models", "/tokenize"):
            r = await (http.get(path) if path == "/v1/models" else http.post(path, json={"prompt": "a"}))
            assert r.status_code == 401, path
        assert (await http.get("/metrics")).status_code == 200
        assert (await http.get("/health")).status_code == 503  # (open, and no worker runs here)
        preflight = await http.options("/v1/completions", headers={
            "Origin": "https://app.example.com", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert preflight.status_code == 200
        # either key; the OpenAI SDK sends its api_key as the bearer header
        for key in keys:
            r = await http.post("/tokenize", json={"prompt": "a"}, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
        sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="new-key", max_retries=0)
        assert [m.id for m in (await sdk.models.list()).data] == ["tiny"]
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="nope", max_retries=0).models.list()
        with pytest.raises(openai.APIStatusError) as sent:
            await sdk.completions.create(model="tiny", prompt=[1, 2], max_tokens=2)
        assert sent.value.status_code == 504  # (let through, and sent: no worker runs here to answer)
    assert _requests("completions", 401) - refused_before == 4
    sent_requests = await read_to_end(kafka_settings, kafka_settings.topic("requests"))
    assert len(sent_requests) == 1  # only the SDK's, with its key


@pytest.mark.kafka
async def test_a_request_too_large_for_a_record_is_413_before_its_fan_out(kafka_settings, make_topics,
                                                                          tiny_model_dir):
    """A prompt of token ids too long for a Kafka record was copied n times first (a 15 MB
    body at n = 64 held the event loop 13 s, where the model's context length is not
    known), then refused by the producer: a 503 "genpipe is unavailable" that the SDKs
    retry. Now one copy is sized, and the request gets 413 naming the prompt."""
    await make_topics(kafka_settings, partitions=2)
    async with serving_gateway(kafka_settings, str(tiny_model_dir), gateway_id="big") as (base, gateway), \
            httpx.AsyncClient(base_url=base, timeout=60) as http:
        gateway.max_model_len = None  # (a tokenizer directory that does not say it)
        r = await http.post("/v1/completions", json={"model": "tiny", "prompt": [70_000] * 300_000, "n": 64})
        assert r.status_code == 413, r.text
        assert r.json()["error"]["param"] == "prompt" and "as a Kafka record" in r.json()["error"]["message"]
        assert gateway.in_flight == 0


@pytest.mark.kafka
async def test_a_gateway_takes_requests_as_large_as_its_max_record_bytes(kafka_settings, make_topics,
                                                                         tiny_model_dir):
    """A deployment that raised its record limit (the broker's, the workers'
    --max-record-bytes) still got 413 from the gateway past ~1 MB, and its client
    library's producer refused such records: `serve --max-record-bytes` raises both."""
    from tests.kafka_helpers import read_to_end, set_topic_config

    await make_topics(kafka_settings, partitions=1)
    requests_topic = kafka_settings.topic("requests")
    await set_topic_config(kafka_settings, requests_topic, {"max.message.bytes": "3000000"})
    prompt = [1500] * 500_000  # ~1.5 MB as a record
    async with serving_gateway(kafka_settings, str(tiny_model_dir), gateway_id="large", timeout_s=1.0,
                               answer_timeout_s=1.0, max_record_bytes=3_000_000) as (base, gateway), \
            httpx.AsyncClient(base_url=base, timeout=60) as http:
        gateway.max_model_len = None  # (a tokenizer directory that does not say it)
        r = await http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 504, r.text  # sent: no worker runs here to answer it
    (record,) = await read_to_end(kafka_settings, requests_topic)
    assert len(record.value) > 1_000_000


@pytest.mark.kafka
async def test_a_gateway_whose_reply_reader_failed_says_so_on_health(kafka_settings, make_topics, tiny_model_dir):
    """The gateway reads every answer through one consumer. Once that reader fails, every
    request gets 503, but /health still said ok, so a load balancer kept sending traffic
    to a gateway that could answer none of it. Here the reader's consumer is stopped
    under it (aiokafka then raises in its poll)."""
    from tests.kafka_helpers import wait_for

    await make_topics(kafka_settings, partitions=2)
    async with running_stack(kafka_settings, tiny_model_dir) as (base, gateway), \
            httpx.AsyncClient(base_url=base, timeout=60) as http:
        assert (await http.get("/health")).status_code == 200
        await gateway.client._consumer.stop()
        await wait_for(lambda: gateway.client.reader_error is not None, 30, "the reader to fail")
        health = await http.get("/health")
        assert health.status_code == 503, health.text
        # (what failed is in its log: /health takes no credentials)
        assert health.json()["reason"] == "this gateway's reader of its reply topic failed (its log says why); restart it"
        r = await http.post("/v1/completions", json={"model": "tiny", "prompt": [1, 5], "max_tokens": 2})
        assert r.status_code == 503 and "reader" in r.json()["error"]["message"], r.text


@pytest.mark.kafka
async def test_a_body_over_the_limit_is_refused_with_413_before_it_is_read(kafka_settings, make_topics,
                                                                          tiny_model_dir):
    """--max-body-mib: Starlette read any body into memory, so one client could send
    gigabytes. A body that says it is too large gets 413 at once, unread; one sent in
    chunks with no length gets it once the limit has come (the rest is discarded as it
    arrives, not kept); the gateway serves on."""
    await make_topics(kafka_settings, partitions=2)
    limit = 4096
    async with serving_gateway(kafka_settings, str(tiny_model_dir), gateway_id="small", max_body_bytes=limit,
                               timeout_s=1.0) as \
            (base, gateway), httpx.AsyncClient(base_url=base, timeout=60) as http:
        big = {"model": "tiny", "prompt": [7] * 5000, "max_tokens": 2}  # ~10 KB

        async def chunks():  # no Content-Length: the gateway counts what arrives
            for _ in range(1000):  # 1 MB
                yield b" " * 1024

        declared = await http.post("/v1/completions", json=big)
        chunked = await http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        for response in (declared, chunked):
            assert response.status_code == 413, response.text
            error = response.json()["error"]
            assert error["param"] == "body" and error["code"] == 413
            assert f"larger than this gateway takes: {limit} bytes (--max-body-mib)" in error["message"]
        assert f"body ({declared.request.headers['content-length']} bytes)" in declared.json()["error"]["message"]
        # under the limit: read and answered (a model it does not serve: 404, no workers needed)
        small = await http.post("/v1/completions", json={"model": "other", "prompt": [7], "max_tokens": 2})
        assert small.status_code == 404, small.text
        assert gateway.in_flight == 0
        # a client gone while it sent its body: counted as gone (499), where it was not counted
        from tests.kafka_helpers import wait_for

        gone_before = _requests("completions", 499)
        reader, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        await writer.drain()
        writer.close()
        await wait_for(lambda: _requests("completions", 499) == gone_before + 1, 30,
                       "the request gone mid-body counted")


@pytest.mark.kafka
async def test_the_sync_openai_sdk_n_logprobs_stop_strings_echo_and_errors(kafka_settings, make_topics,
                                                                        tiny_model_dir, engine):
    """The official SDK's sync client (in a thread: the gateway runs on this event loop)
    against the tiny model, greedy: what each parameter does is derived on this machine."""
    import openai

    await make_topics(kafka_settings, partitions=2)
    greedy = {"model": "tiny", "temperature": 0, "extra_body": {"ignore_eos": True}}

    def calls(base: str) -> dict:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        out = {"full": client.completions.create(prompt="Once upon a time", max_tokens=12, **greedy)}
        text = out["full"].choices[0].text
        start = next(i for i in range(1, len(text) - 2) if "\ufffd" not in text[i:i + 3] and text[i:i + 3].strip())
        out["stop"] = text[start:start + 3]
        out["stopped"] = client.completions.create(prompt="Once upon a time", max_tokens=12, stop=[out["stop"]],
                                                   **greedy)
        out["n"] = client.completions.create(prompt=["Once", "The"], n=2, max_tokens=3, logprobs=2, **greedy)
        out["chat"] = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                                     logprobs=True, top_logprobs=2, **greedy)
        out["streamed"] = [c for c in client.chat.completions.create(
            messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True, **greedy)]
        out["echo"] = client.completions.create(prompt="Once upon", max_tokens=2, echo=True, **greedy)
        for name, bad in (("bad", {"prompt": "x", "logprobs": 21}), ("unsupported", {"prompt": "x", "suffix": "y"})):
            try:
                client.completions.create(model="tiny", **bad)
            except openai.BadRequestError as exc:
                out[name] = exc
        client.close()
        return out

    async with running_stack(kafka_settings, tiny_model_dir, loaded_engine=engine) as (base, _):
        out = await asyncio.to_thread(calls, base)

    full = out["full"].choices[0].text
    stopped = out["stopped"].choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == full[:full.index(out["stop"])]
    n = out["n"]
    assert [c.index for c in n.choices] == [0, 1, 2, 3] and n.usage.completion_tokens == 12
    assert n.choices[0].text == n.choices[1].text  # greedy: both samples of a prompt agree
    for choice in n.choices:
        assert len(choice.logprobs.tokens) == 3 and all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)
    content = out["chat"].choices[0].logprobs.content
    assert len(content) == 3 and all(len(position.top_logprobs) == 2 for position in content)
    streamed = "".join(c.choices[0].delta.content or "" for c in out["streamed"] if c.choices)
    assert streamed == out["chat"].choices[0].message.content
    assert out["echo"].choices[0].text.startswith("Once upon")
    assert out["bad"].status_code == 400 and out["bad"].param == "logprobs"
    assert out["unsupported"].status_code == 400 and out["unsupported"].param == "suffix"
