"""The client library and the user commands (submit, tail, replay) against a real pipeline.

One generate and one derender worker run in-process as asyncio tasks on the session
loop; the CLI commands run `workers.cli.main` in a thread (they call asyncio.run).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math

import msgspec
import pytest

from schemas import (Cancel, ChatCompletion, ChatCompletionChunk, ChatCompletionStreamChoice, Completion,
                     DeltaMessage, ErrorResponse, GenerateChunk, GenerateRequest, JSON, OutputOptions, encode,
                     headers_for)
from tests.kafka_helpers import chunks_finished, read_to_end, read_topic
from workers.cli import main
from workers.client import (AttemptFilter, GenpipeClient, GenpipeError, GenpipeTimeout, Restart, assemble,
                            load_tokenizer, make_request, render_chat, render_prompt)
from workers.kafka.clients import make_admin, make_producer
from workers.kafka.follow import follow
from workers.kafka.records import decode_message

pytestmark = pytest.mark.kafka


# --- fixtures and helpers ------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from workers.generate.engine import Engine

    return Engine(str(tiny_model_dir), max_batch=16, max_logprobs=20)


@pytest.fixture
async def pipeline(kafka_settings, make_topics, engine):
    """Topics plus one generate and one derender worker; yields the settings."""
    from workers.derender.service import DerenderWorkerConfig, run_derender_worker
    from workers.generate.service import GenerateWorkerConfig, run_generate_worker

    await make_topics(kafka_settings, partitions=2)
    prefix = kafka_settings.topic_prefix
    stops, tasks = [], []
    try:
        for run, config, kwargs in (
                (run_generate_worker, GenerateWorkerConfig(group_id=f"{prefix}-gen", max_batch=16),
                 {"engine": engine}),
                (run_derender_worker, DerenderWorkerConfig(group_id=f"{prefix}-der"), {})):
            stop, ready = asyncio.Event(), asyncio.Event()
            task = asyncio.ensure_future(run(kafka_settings, config, stop=stop, on_ready=ready.set, **kwargs))
            stops.append(stop)
            tasks.append(task)
            waiter = asyncio.ensure_future(ready.wait())
            await asyncio.wait([task, waiter], timeout=90, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            assert ready.is_set(), f"{run.__name__} did not become ready: " + (
                repr(task.exception()) if task.done() else "timeout after 90 s")
        yield kafka_settings
    finally:
        for stop in stops:
            stop.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        assert results == [0] * len(tasks), results


async def create_topic(settings, name: str, partitions: int = 2) -> None:
    from aiokafka.admin import NewTopic

    admin = make_admin(settings)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        await admin.close()


async def sampled_chunks(settings, request_ids) -> dict[str, list[GenerateChunk]]:
    """Every request's chunks from the chunk topic, once each has its final chunk."""
    wanted = set(request_ids)
    records = await read_topic(settings, settings.topic("chunks"), until=chunks_finished(wanted), timeout=120)
    out: dict[str, list[GenerateChunk]] = {}
    for chunk in map(_chunk, records):
        if chunk.request_id in wanted:
            out.setdefault(chunk.request_id, []).append(chunk)
    for rid, chunks in out.items():
        assert len({c.attempt for c in chunks}) == 1, f"{rid}: unexpected restart in a clean run"
        assert [c.seq for c in chunks] == list(range(len(chunks)))
    return out


def _chunk(record) -> GenerateChunk:
    return decode_message(record, GenerateChunk)


def ids_of(chunks: list[GenerateChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def expected_text(tokenizer_dir, prompt: list[int], ids: list[int]) -> str:
    """What the coupled endpoint returns: the output decoded in the prompt's context."""
    tok = load_tokenizer(str(tokenizer_dir))
    full = tok.decode(prompt + ids, skip_special_tokens=True)
    before = tok.decode(prompt, skip_special_tokens=True)
    assert full.startswith(before)
    return full[len(before):]


def render_unstreamed(tokenizer_dir, chunks: list[GenerateChunk]):
    """What derender publishes for these chunks when the request is not streamed."""
    from workers.derender.service import DerenderWorkerConfig
    from workers.derender.state import Derenderer

    derenderer = Derenderer(str(tokenizer_dir), model_name=DerenderWorkerConfig().model_name)
    first = msgspec.structs.replace(chunks[0], output=msgspec.structs.replace(chunks[0].output, stream=False))
    results = [out for c in [first, *chunks[1:]] for out in derenderer.process(c)]
    assert len(results) == 1 and results[0].final
    return results[0].value


def sampled_logprobs(chunks: list[GenerateChunk]) -> list[float]:
    return [e.logprob for c in chunks for e in c.logprobs.content]


async def cli(*argv: str) -> int:
    """`genpipe ARGV...` in a worker thread (the command runs its own event loop)."""
    return await asyncio.to_thread(main, list(argv))


def kafka_args(settings) -> list[str]:
    return ["--bootstrap-servers", settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix]


# --- the pipeline through the client -------------------------------------------------------


async def test_chat_stream_and_completion_with_logprobs_match_the_sampled_ids(pipeline, tiny_model_dir):
    settings = pipeline
    chat_ids = render_chat(tiny_model_dir, [{"role": "user", "content": "Hello there, how are you?"}])
    prompt_ids = render_prompt(tiny_model_dir, "Once upon a time")
    assert chat_ids[0] == 1 and prompt_ids[0] == 1  # BOS, from the template / the tokenizer
    chat_opts = dict(kind="chat", temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=True,
                     top_logprobs=2, include_usage=True, created=1700000000)
    chat_stream = make_request(chat_ids, stream=True, **chat_opts)
    chat_final = make_request(chat_ids, stream=False, **chat_opts)
    comp_opts = dict(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True, logprobs=3, created=1700000000)
    comp_final = make_request(prompt_ids, stream=False, **comp_opts)
    comp_stream = make_request(prompt_ids, stream=True, include_usage=True, **comp_opts)
    # logprobs=20, the deployment's max_logprobs: generate is asked for 21 candidates
    comp_max = make_request(prompt_ids, stream=False, temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=20)
    invalid = make_request(prompt_ids, logprobs=30)  # asks generate for 31, past 20 + 1

    async with GenpipeClient(settings=settings, timeout_s=60) as client:
        async def collect(request):
            return [item async for item in client.stream(request)]

        async def error_of(request):
            with pytest.raises(GenpipeError) as info:
                await client.complete(request)
            return info.value

        # every request in flight at once on one client; the streamed chat also goes
        # through complete() (a second request id: one stream per id)
        chat_stream_again = msgspec.structs.replace(chat_stream, request_id="again-" + chat_stream.request_id)
        streamed, from_chat_stream, chat, comp, from_comp_stream, error, at_max = await asyncio.gather(
            collect(chat_stream), client.complete(chat_stream_again), client.complete(chat_final),
            client.complete(comp_final), client.complete(comp_stream), error_of(invalid),
            client.complete(comp_max))

    chunks = await sampled_chunks(settings, [r.request_id for r in (
        chat_stream, chat_stream_again, chat_final, comp_final, comp_stream, comp_max)])

    # chat, streamed: ordered chunks, no restart, text and logprobs of the sampled ids
    assert all(isinstance(i, ChatCompletionChunk) for i in streamed), streamed
    ids = ids_of(chunks[chat_stream.request_id])
    assert len(ids) == 12
    assert streamed[0].choices[0].delta.role == "assistant"
    assert all(i.choices[0].finish_reason is None for i in streamed[:-1])
    assert streamed[-1].choices[0].finish_reason == "length"
    assert streamed[-1].usage.completion_tokens == 12 and streamed[-1].usage.prompt_tokens == len(chat_ids)
    text = "".join(i.choices[0].delta.content or "" for i in streamed)
    assert text == expected_text(tiny_model_dir, chat_ids, ids) and text.strip()
    entries = [e for i in streamed if i.choices[0].logprobs for e in i.choices[0].logprobs.content]
    assert [e.logprob for e in entries] == sampled_logprobs(chunks[chat_stream.request_id])
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in entries)

    # chat, not streamed: the final object of its own sampled ids
    assert isinstance(chat, ChatCompletion)
    chat_final_ids = ids_of(chunks[chat_final.request_id])
    assert chat.choices[0].message.content == expected_text(tiny_model_dir, chat_ids, chat_final_ids)
    assert [e.logprob for e in chat.choices[0].logprobs.content] == sampled_logprobs(chunks[chat_final.request_id])
    # a stream assembled by complete() is exactly what derender renders non-streamed
    # from the same chunks (logprob floats depend on the batch, so compare like this)
    assert from_chat_stream == render_unstreamed(tiny_model_dir, chunks[chat_stream_again.request_id])
    assert from_chat_stream.choices[0].logprobs.content and from_chat_stream.usage is not None

    # completion, not streamed, with logprobs=3: the sampled token plus its top 3
    assert isinstance(comp, Completion)
    comp_ids = ids_of(chunks[comp_final.request_id])
    assert comp.choices[0].text == expected_text(tiny_model_dir, prompt_ids, comp_ids)
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == len(comp_ids) == 10
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(comp_ids) and lp.token_logprobs == sampled_logprobs(chunks[comp_final.request_id])
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert next(iter(top)) == token and 1 <= len(top) <= 4
    assert from_comp_stream == render_unstreamed(tiny_model_dir, chunks[comp_stream.request_id])
    assert len(from_comp_stream.choices[0].logprobs.tokens) == 10

    # a completion's logprobs at the cap: 21 candidates a position, the sampled token first
    assert isinstance(at_max, Completion) and len(at_max.choices[0].logprobs.tokens) == 4
    positions = [p for c in chunks[comp_max.request_id] if c.logprobs for p in c.logprobs.content]
    assert len(positions) == 4 and all(len(p.top_logprobs) == 21 for p in positions)
    for token, top in zip(at_max.choices[0].logprobs.tokens, at_max.choices[0].logprobs.top_logprobs):
        assert next(iter(top)) == token and 1 <= len(top) <= 21

    # an invalid request: one error result, raised with its type, naming the k asked for
    assert error.type == "invalid_request_error" and "so k may be 0..20" in error.message


async def test_duplicates_and_restarts_are_hidden(kafka_settings, make_topics, capsys):
    """A scripted derender publishes duplicates and a restart; the client shows the winner."""
    await make_topics(kafka_settings, partitions=2)
    reply_topic = f"{kafka_settings.topic_prefix}.reply.mine"
    await create_topic(kafka_settings, reply_topic)

    def value(rid: str, text: str, finish: str | None = None):
        return ChatCompletionChunk(id=f"chatcmpl-{rid}", created=1, model="m", choices=[
            ChatCompletionStreamChoice(delta=DeltaMessage(content=text), finish_reason=finish)])

    def script(rid: str):
        A, B = "attempt-a", "attempt-b"
        rec = lambda attempt, seq, text, restart=False, final=False: (attempt, seq, value(rid, text, "length" if final else None), restart, final)  # noqa: E731
        return [rec(A, 0, "a0"), rec(A, 1, "a1"), rec(A, 1, "a1"), rec(A, 0, "a0"),
                rec(B, 0, "b0", restart=True), rec(A, 2, "a2"), rec(B, 1, "b1"),
                rec(B, 0, "b0", restart=True), rec(A, 1, "a1"), rec(B, 2, "b2", final=True),
                rec(B, 2, "b2", final=True)]

    seen_reply_topics = []
    producer = make_producer(kafka_settings)
    await producer.start()

    async def fake_derender(message):
        from schemas import GenerateRequest

        request = decode_message(message, GenerateRequest)
        seen_reply_topics.append(request.reply_topic)
        for attempt, seq, val, restart, final in script(request.request_id):
            headers = {"genpipe-attempt": attempt, "genpipe-seq": str(seq)}
            if restart:
                headers["genpipe-restart"] = "1"
            if final:
                headers["genpipe-final"] = "1"
            await producer.send_and_wait(
                request.reply_topic, encode(val, JSON), key=request.request_id.encode(),
                headers=headers_for(val, JSON, [(k, v.encode()) for k, v in headers.items()]))

    stop, ready = asyncio.Event(), asyncio.Event()
    worker = asyncio.ensure_future(follow(kafka_settings, kafka_settings.topic("requests"), fake_derender,
                                          stop, ready=ready))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        async with GenpipeClient(settings=kafka_settings, reply_topic=reply_topic, timeout_s=30) as client:
            items = [item async for item in client.stream(make_request([1, 2, 3], kind="chat", stream=True))]
            final = await client.complete(make_request([1, 2, 3], kind="chat", stream=True))
        rc = await cli("submit", *kafka_args(kafka_settings), "--token-ids", "1,2,3", "--kind", "chat",
                       "--reply-topic", reply_topic, "--timeout", "30")
        out, err = capsys.readouterr()
    finally:
        stop.set()
        await asyncio.wait_for(worker, 30)
        await producer.stop()

    assert seen_reply_topics == [reply_topic] * 3  # the client addressed its replies
    shown = [item if isinstance(item, Restart) else item.choices[0].delta.content for item in items]
    assert shown[:2] == ["a0", "a1"] and isinstance(shown[2], Restart) and shown[2].attempt == "attempt-b"
    assert shown[3:] == ["b0", "b1", "b2"]
    assert isinstance(final, ChatCompletion)
    assert final.choices[0].message.content == "b0b1b2" and final.choices[0].finish_reason == "length"
    # the command line shows the abandoned text, says so, and prints the new attempt
    assert rc == 0, err
    assert out == "a0a1\nb0b1b2\n" and "restarted (attempt attempt-b)" in err


def test_make_request_takes_one_stop_string_or_id_as_openai_does():
    """`stop="END"` became three stop strings, E, N and D (any of them ended the answer);
    a deadline of inf overflowed into a traceback at send time."""
    from workers.requests import make_request

    one = make_request([1, 2], stop="END", stop_token_ids=7)
    assert one.output.stop == ["END"] and one.sampling.stop_token_ids == [7]
    assert make_request([1, 2], stop=("a", "b")).output.stop == ["a", "b"]
    for bad in (math.inf, math.nan, -1.0):
        with pytest.raises(ValueError, match="deadline_s must be a number of seconds"):
            make_request([1, 2], deadline_s=bad)


def test_attempt_filter_rules():
    f = AttemptFilter()
    assert f.accept("a", 0) is False and f.accept("a", 1) is False
    assert f.accept("a", 1) is None and f.accept("a", 0) is None  # duplicates
    assert f.accept("x", 3) is None  # a stray record of an unknown attempt, not its start
    assert f.accept("b", 0) is True  # a new attempt's first record restarts, header or not
    assert f.accept("a", 2) is None and f.accept("b", 0, True) is None
    assert f.accept("b", 1) is False
    first = AttemptFilter()
    assert first.accept("b", 5, True) is False  # nothing shown yet: no restart to signal (non-streamed)
    assert AttemptFilter().accept(None, None) is False  # no genpipe headers: shown as is
    with pytest.raises(ValueError):
        assemble([])


async def test_closing_the_client_cancels_the_requests_still_waiting(kafka_settings, make_topics):
    """close() woke the waiting readers and dropped the producer before they could send
    their cancels (their cleanup needs it): the requests ran on, on the workers, for
    nobody, while `records()` promises that leaving early cancels."""
    from tests.kafka_helpers import wait_for

    await make_topics(kafka_settings, partitions=1)
    client = GenpipeClient(settings=kafka_settings, timeout_s=120)
    await client.start()
    waiting = asyncio.ensure_future(client.complete(make_request([1, 5, 6], request_id="left-behind")))
    await wait_for(lambda: "left-behind" in client._waiting and client._waiting["left-behind"].started, 30,
                   "the request to be sent")
    await client.close()
    with pytest.raises(RuntimeError, match="closed while request 'left-behind' was waiting"):
        await waiting
    cancels = await read_topic(kafka_settings, kafka_settings.topic("cancel"), until=lambda r: len(r) >= 1, timeout=30)
    assert [decode_message(c, Cancel).request_id for c in cancels] == ["left-behind"]


async def test_a_client_with_its_own_reply_topic_submits_requests_that_name_it(kafka_settings, make_topics):
    """Only `records()` filled in the client's reply topic: a request sent with `submit()`
    named none, and its results went to the shared results topic, where every tenant
    reads, while whoever watched the client's own topic waited for good."""
    from tests.kafka_helpers import create_topic

    await make_topics(kafka_settings, partitions=1)
    mine = f"{kafka_settings.topic_prefix}.reply.team-a"
    await create_topic(kafka_settings, mine)
    async with GenpipeClient(settings=kafka_settings, reply_topic=mine) as client:
        await client.submit(make_request([1, 5, 6], request_id="fire-and-forget"))
        await client.submit(make_request([1, 5, 6], request_id="elsewhere", reply_topic=f"{mine}-b"))
    sent = await read_topic(kafka_settings, kafka_settings.topic("requests"), until=lambda r: len(r) >= 2, timeout=30)
    assert [decode_message(r, GenerateRequest).reply_topic for r in sent] == [mine, f"{mine}-b"]


async def test_tail_s_idle_exit_counts_only_the_records_it_would_print(kafka_settings, make_topics, capsys):
    """`tail --request-id X --idle-exit S` reset its idle clock on any record, other
    requests' too: on a busy results topic it never exited. Here another request's
    records keep coming every 50 ms while X has none."""
    from workers.kafka.clients import make_producer

    await make_topics(kafka_settings, partitions=1)
    producer = make_producer(kafka_settings)
    await producer.start()
    tail = asyncio.ensure_future(cli("tail", *kafka_args(kafka_settings), "--request-id", "quiet-one",
                                     "--idle-exit", "2"))
    deadline = asyncio.get_running_loop().time() + 30
    try:
        while not tail.done():  # (the busy topic: a record every 50 ms until tail exits)
            assert asyncio.get_running_loop().time() < deadline, "tail did not exit: the other records kept it"
            await producer.send_and_wait(kafka_settings.topic("results"), b"{}", key=b"someone-else")
            await asyncio.wait({tail}, timeout=0.05)
        assert tail.result() == 0
    finally:
        await producer.stop()
        await asyncio.wait_for(tail, 60)  # (without the fix: ends once the records stop)
    assert capsys.readouterr().out == ""


async def test_replay_rebuilds_a_request_restarted_inside_its_range(kafka_settings, make_topics, tiny_model_dir,
                                                                    tmp_path, capsys):
    """The range starts inside an attempt (its seq 0 before it: that attempt cannot be
    rebuilt) and holds the whole of the request's next attempt, restarted on another
    worker, with a straggler of the old attempt after the new one's start. The next
    attempt was skipped too, as the request was; its result is there, and the straggler
    is not a "seq gap" error in its place."""
    from tests.derender_support import make_chunks
    from workers.kafka.clients import make_producer

    await make_topics(kafka_settings, partitions=1)
    old = make_chunks("restarted", [40, 41, 42, 45], attempt="old", finish_reason=None)
    new = make_chunks("restarted", [43, 44], attempt="new", output=OutputOptions(kind="completion"))
    producer = make_producer(kafka_settings)
    await producer.start()
    try:
        for chunk in [*old[:3], new[0], old[3], new[1]]:
            await producer.send_and_wait(kafka_settings.topic("chunks"), encode(chunk), key=b"restarted",
                                         headers=list(headers_for(chunk)), partition=0)
    finally:
        await producer.stop()
    out = tmp_path / "results.jsonl"
    rc = await cli("replay", *kafka_args(kafka_settings), "--from", "1", "--out", str(out), "--tokenizer",
                   str(tiny_model_dir))  # (from offset 1: the old attempt's seq 0 is out of range)
    err = capsys.readouterr().err
    assert rc == 0, err
    (line,) = [json.loads(l) for l in out.read_text().splitlines()]
    assert line["key"] == "restarted" and line["headers"]["genpipe-attempt"] == "new"
    assert line["value"]["choices"][0]["finish_reason"] == "length"
    assert "0 partial request(s) skipped" in err


async def test_no_workers_times_out_with_a_clear_message_and_cancels(kafka_settings, make_topics, caplog):
    await make_topics(kafka_settings, partitions=2)
    request = make_request([1, 5, 6], request_id="lonely")
    async with GenpipeClient(settings=kafka_settings, timeout_s=1.5) as client:
        with pytest.raises(GenpipeTimeout) as info:
            await client.complete(request)
    message = str(info.value)
    assert "no result for request lonely within 1.5 s" in message
    assert "generate and a derender worker" in message and kafka_settings.topic_prefix in message
    assert isinstance(info.value, TimeoutError)
    # the client gave up, so it cancelled the request for whichever worker picks it up later
    cancels = await read_topic(kafka_settings, kafka_settings.topic("cancel"), until=lambda r: len(r) >= 1, timeout=30)
    assert decode_message(cancels[0], Cancel).request_id == "lonely"
    # a client on its own reply topic is told where an answer it cannot see would be: an
    # error for a reply topic the workers' rule refuses goes to the results topic
    mine = f"{kafka_settings.topic_prefix}.team-replies"
    await create_topic(kafka_settings, mine)
    with caplog.at_level(logging.WARNING, logger="workers.kafka.reply_topics"):
        client = GenpipeClient(settings=kafka_settings, reply_topic=mine, timeout_s=1.0)
    # (told at once, where it used to learn it only from a timeout)
    assert f"reply_topic {mine!r} does not match the workers' default --reply-topic-pattern" in caplog.text
    async with client:
        with pytest.raises(GenpipeTimeout) as info:
            await client.complete(make_request([1, 5, 6], request_id="elsewhere"))
    assert "--reply-topic-pattern does not allow" in str(info.value)
    assert f"{kafka_settings.topic('results')!r}" in str(info.value) and "--request-id elsewhere" in str(info.value)


# --- the commands --------------------------------------------------------------------------


async def test_submit_prints_the_streamed_text_and_tail_follows(pipeline, tiny_model_dir, capsys):
    settings = pipeline
    rc = await cli("submit", *kafka_args(settings), "--prompt", "The cat", "--max-tokens", "9",
                   "--temperature", "0", "--ignore-eos", "--request-id", "cli-1", "--timeout", "60")
    out, err = capsys.readouterr()
    assert rc == 0, err
    chunks = await sampled_chunks(settings, ["cli-1"])
    prompt = render_prompt(tiny_model_dir, "The cat")
    assert len(ids_of(chunks["cli-1"])) == 9
    assert out == expected_text(tiny_model_dir, prompt, ids_of(chunks["cli-1"])) + "\n"

    rc = await cli("submit", *kafka_args(settings), "--chat", "user: Hi!", "--max-tokens", "5", "--no-stream",
                   "--ignore-eos", "--logprobs", "--top-logprobs", "2", "--json", "--request-id", "cli-2")
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 1 and lines[0]["key"] == "cli-2"
    assert lines[0]["headers"]["genpipe-final"] == "1" and lines[0]["headers"]["content-type"] == JSON
    assert lines[0]["value"]["object"] == "chat.completion"
    assert len(lines[0]["value"]["choices"][0]["logprobs"]["content"]) == 5

    rc = await cli("submit", *kafka_args(settings), "--token-ids", "1,5,6", "--logprobs", "30")
    out, err = capsys.readouterr()
    assert rc == 1 and len(err.strip().splitlines()) == 1
    assert err.startswith("genpipe submit: error (invalid_request_error):") and "k may be 0..20" in err

    # past its deadline before it starts: aborted, and submit says why (the reason was only
    # in the genpipe-error header, and submit printed an empty line), with exit status 1
    # (it was 0, a complete answer's)
    rc = await cli("submit", *kafka_args(settings), "--token-ids", "1,5,6", "--deadline-s", "0.001",
                   "--request-id", "cli-late")
    out, err = capsys.readouterr()
    assert rc == 1 and out == "\n"
    assert err.startswith("genpipe submit: request cli-late was aborted: ") and "deadline" in err

    rc = await cli("tail", *kafka_args(settings), "--request-id", "cli-1", "--from-beginning", "--until-final")
    out, err = capsys.readouterr()
    assert rc == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["key"] for r in records] == ["cli-1"] * len(chunks["cli-1"])  # one streamed result per chunk
    assert [int(r["headers"]["genpipe-seq"]) for r in records] == list(range(len(records)))
    assert "".join(r["value"]["choices"][0]["text"] for r in records) + "\n" == expected_text(
        tiny_model_dir, prompt, ids_of(chunks["cli-1"])) + "\n"


async def test_submit_without_workers_exits_nonzero_with_one_line(kafka_settings, make_topics, capsys):
    await make_topics(kafka_settings, partitions=1)
    rc = await cli("submit", *kafka_args(kafka_settings), "--token-ids", "1,2,3", "--timeout", "1",
                   "--request-id", "nobody-home")
    out, err = capsys.readouterr()
    assert rc == 1 and out == ""
    assert err.strip().splitlines() == [
        f"genpipe submit: no result for request nobody-home within 1 s: are a generate and a derender "
        f"worker running on topic prefix {kafka_settings.topic_prefix!r} "
        f"(bootstrap {kafka_settings.bootstrap_servers})?"]


async def test_submit_says_early_that_no_worker_is_running(kafka_settings, make_topics, capsys):
    """It waited the whole timeout (120 s by default) without a word. (The generate
    workers here would run with a --group-id of their own: the one it looks at.)"""
    await make_topics(kafka_settings, partitions=1)
    rc = await cli("submit", *kafka_args(kafka_settings), "--token-ids", "1,2,3", "--timeout", "13",
                   "--request-id", "early-word", "--generate-group-id", "team-gen")
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 1 and out == ""
    prefix = kafka_settings.topic_prefix
    assert lines[0] == (
        f"genpipe submit: no generate worker (consumer group team-gen has no members); no derender "
        f"worker (consumer group {prefix}-derender has no members). Request early-word waits in {prefix}.requests "
        f"until one runs (genpipe generate-worker / genpipe derender-worker; workers with a --group-id of their "
        f"own: --generate-group-id / --derender-group-id)")
    assert lines[1].startswith("genpipe submit: still waiting for request early-word (1") and "of 13 s)" in lines[1]
    assert lines[-1].startswith("genpipe submit: no result for request early-word within 13 s")


async def test_replay_reproduces_the_results_record_for_record(pipeline, tiny_model_dir, tmp_path, capsys):
    settings = pipeline
    chat = render_chat(tiny_model_dir, [{"role": "user", "content": "Tell me about cats."}])
    prompt = render_prompt(tiny_model_dir, "Über café 中文 🙂")
    requests = [
        make_request(chat, kind="chat", stream=True, max_tokens=10, seed=1, logprobs=True, top_logprobs=3,
                     include_usage=True),
        make_request(prompt, stream=False, max_tokens=12, seed=2, logprobs=2),
        make_request(prompt, stream=True, max_tokens=16, seed=3, ignore_eos=True, stop=[" "]),
        make_request(chat, kind="chat", stream=False, max_tokens=8, temperature=0.0),
        make_request([1, 10**6]),  # an id outside the vocabulary: an error result
    ]
    # Run alone before the rest, so its chunks open its partition of the chunk log: with
    # more tokens than a chunk may hold (16), it spans offsets 0, 1, ... there.
    opening = make_request(prompt, stream=True, max_tokens=40, ignore_eos=True, temperature=0.0)
    async with GenpipeClient(settings=settings, timeout_s=60) as client:
        async def run(request):
            return [r async for r in client.records(request)]
        await run(opening)
        got = await asyncio.gather(*(run(r) for r in requests))
    # the stop string matched, where its 16 sampled tokens hold a space (most CPUs' models)
    assert got[2][-1].value.choices[0].finish_reason in ("stop", "length")
    assert " " not in "".join(r.value.choices[0].text for r in got[2])
    assert isinstance(got[4][-1].value, ErrorResponse) and got[4][-1].final
    assert all(r[-1].final and not any(x.restart for x in r) for r in got)
    rids = {r.request_id for r in requests} | {opening.request_id}

    def by_request(records) -> dict[str, list]:
        out: dict[str, list] = {}
        for record in records:
            key = record.key.decode()
            if key in rids:
                out.setdefault(key, []).append((record.value, list(record.headers)))
        return out

    def complete(records) -> bool:
        return {r.key.decode() for r in records if dict(r.headers).get("genpipe-final") == b"1"} >= rids

    original = by_request(await read_topic(settings, settings.topic("results"), until=complete))
    assert set(original) == rids

    target = f"{settings.topic_prefix}.replayed"
    await create_topic(settings, target)
    rc = await cli("replay", *kafka_args(settings), "--from", "0", "--to-topic", target)
    _, err = capsys.readouterr()
    assert rc == 0, err
    assert "0 partial request(s) skipped" in err
    replayed = by_request(await read_topic(settings, target, until=complete))
    assert replayed == original  # same values (bytes) and headers, in per-request order

    out_file = tmp_path / "replayed.jsonl"
    rc = await cli("replay", *kafka_args(settings), "--from", "2000-01-01T00:00:00Z", "--out", str(out_file))
    _, err = capsys.readouterr()
    assert rc == 0, err
    from_file: dict[str, list] = {}
    for line in out_file.read_bytes().splitlines():
        entry = json.loads(line)
        from_file.setdefault(entry["key"], []).append((entry["value"], entry["headers"]))
    assert from_file == {rid: [(json.loads(v), {k: h.decode() for k, h in hs}) for v, hs in records]
                         for rid, records in original.items()}

    # from the middle of the log: requests whose seq 0 is before the range are skipped
    # (reported), every other request is still reproduced exactly
    chunk_offsets: dict[str, list[tuple[int, int]]] = {}  # request -> (seq, offset) of its chunks
    for record in await read_to_end(settings, settings.topic("chunks")):
        chunk = decode_message(record, GenerateChunk)
        chunk_offsets.setdefault(chunk.request_id, []).append((chunk.seq, record.offset))
    begins = {rid: dict(chunks)[0] for rid, chunks in chunk_offsets.items()}
    cut = {rid for rid, chunks in chunk_offsets.items() if begins[rid] < 1 <= max(o for _, o in chunks)}
    whole = {rid for rid, offset in begins.items() if offset >= 1}
    assert opening.request_id in cut and whole  # the case under test occurs: not a vacuous pass
    partial_file = tmp_path / "partial.jsonl"
    rc = await cli("replay", *kafka_args(settings), "--from", "1", "--out", str(partial_file))
    _, err = capsys.readouterr()
    assert rc == 0, err
    assert f" {len(cut)} partial request(s) skipped" in err
    partial: dict[str, list] = {}
    for line in partial_file.read_bytes().splitlines():
        entry = json.loads(line)
        partial.setdefault(entry["key"], []).append((entry["value"], entry["headers"]))
    assert set(partial) == whole
    assert all(records == from_file[rid] for rid, records in partial.items())


async def test_partitions_a_topic_gains_are_read_by_a_running_client_and_by_followers(kafka_settings, make_topics,
                                                                                    monkeypatch):
    """`genpipe topics create --partitions 4 --grow` while a client and the generate
    workers' cancel followers run: a reader assigned every partition by hand never read
    the new ones (aiokafka re-assigns only a group's subscription), so a request the
    client's producer sent to a new partition timed out though its answer was there, and
    cancels there never reached generate. Now both are read, from the new partitions'
    beginnings. (The metadata is looked up every 0.5 s here, every 30 s in life.)"""
    import workers.kafka.clients as clients_module
    from tests.kafka_helpers import wait_for
    from workers.broker.topics import create_topics

    monkeypatch.setattr(clients_module, "METADATA_MAX_AGE_MS", 500)
    await make_topics(kafka_settings, partitions=2)
    cancels, stop, ready = [], asyncio.Event(), asyncio.Event()
    follower = asyncio.ensure_future(follow(kafka_settings, kafka_settings.topic("cancel"),
                                            lambda message: cancels.append(message.key), stop, ready=ready))
    producer = make_producer(kafka_settings)
    try:
        await asyncio.wait_for(ready.wait(), 30)
        async with GenpipeClient(settings=kafka_settings, timeout_s=20) as client:
            await create_topics(kafka_settings, partitions=4, grow=True)
            await producer.start()  # (knows the new partitions: a producer's first metadata is the whole cluster's)
            request = make_request([1, 2, 3], kind="completion")
            answer = Completion(id="cmpl-x", created=1, model="m", choices=[])
            await producer.send_and_wait(kafka_settings.topic("results"), encode(answer, JSON),
                                         key=request.request_id.encode(), partition=3, headers=headers_for(
                                             answer, JSON, [("genpipe-attempt", b"a"), ("genpipe-seq", b"0"),
                                                            ("genpipe-final", b"1")]))
            await producer.send_and_wait(kafka_settings.topic("cancel"), encode(Cancel(request_id="on-3")),
                                         key=b"on-3", partition=3)
            assert await client.complete(request) == answer
        await wait_for(lambda: b"on-3" in cancels, 20, "the cancel on a new partition")
    finally:
        stop.set()
        await asyncio.wait_for(follower, 30)
        await producer.stop()


async def test_a_request_too_large_for_kafka_is_the_caller_s_error_not_unavailable(kafka_settings, make_topics):
    """A request whose record Kafka does not take for its size (a long prompt, many stop
    strings) raised the producer's KafkaError as it was: the gateway answered it 503
    "genpipe is unavailable", which the SDKs retry. It is a GenpipeError with code 413."""
    await make_topics(kafka_settings, partitions=1)
    async with GenpipeClient(settings=kafka_settings, timeout_s=20) as client:
        with pytest.raises(GenpipeError) as raised:
            await client.complete(make_request([70_000] * 300_000))  # ~1.5 MB of msgpack
    assert raised.value.code == 413 and raised.value.type == "invalid_request_error"
    assert "too large for Kafka" in raised.value.message
    # and no cancel: generate remembers cancelled ids, and aborted the same id sent again, corrected
    assert await read_to_end(kafka_settings, kafka_settings.topic("cancel")) == []


def test_a_reply_topic_no_worker_answers_on_is_refused_when_the_client_is_made(capsys, caplog, monkeypatch):
    """A reply topic that is one of the deployment's own topics, or not a topic name:
    every request timed out; now the client (and `genpipe submit`) refuses it at once.
    One the workers' default pattern refuses is a warning (the deployment may set
    another): the test above."""
    from workers.kafka.settings import KafkaSettings

    settings = KafkaSettings(topic_prefix="acme")
    for topic, message in [("acme.requests", "one of the deployment's own topics"),
                           ("acme.dlq", "one of the deployment's own topics"),
                           ("no spaces", "not a valid Kafka topic name"), ("..", "not a valid Kafka topic name")]:
        with pytest.raises(ValueError, match=message):
            GenpipeClient(settings=settings, reply_topic=topic)
    assert GenpipeClient(settings=settings, reply_topic="acme.reply.team").reply_topic == "acme.reply.team"
    assert main(["submit", "--topic-prefix", "acme", "--token-ids", "1,2", "--reply-topic", "acme.chunks",
                 "--bootstrap-servers", "127.0.0.1:1"]) == 2
    assert "reply_topic 'acme.chunks' is one of the deployment's own topics" in capsys.readouterr().err
    # a doubtful one: `submit` says so once (the client's warning), then tries
    with caplog.at_level(logging.WARNING, logger="workers.kafka.reply_topics"):
        main(["submit", "--topic-prefix", "acme", "--token-ids", "1,2", "--reply-topic", "team.replies",
              "--bootstrap-servers", "127.0.0.1:1", "--timeout", "1"])
    assert caplog.text.count("reply_topic 'team.replies' does not match") == 1, caplog.text
    # the workers' pattern, where the client's environment has it
    caplog.clear()
    monkeypatch.setenv("GENPIPE_REPLY_TOPIC_PATTERN", r"team\..+")
    with caplog.at_level(logging.WARNING, logger="workers.kafka.reply_topics"):
        GenpipeClient(settings=settings, reply_topic="team.replies")
        assert not caplog.text
        GenpipeClient(settings=settings, reply_topic="acme.reply.team")
    assert "does not match GENPIPE_REPLY_TOPIC_PATTERN" in caplog.text
