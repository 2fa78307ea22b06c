"""docs/design.md §6: nothing is lost when the broker restarts mid-stream.

The test owns a broker of its own (the session broker serves every other test and must
not go away), runs one generate and one derender worker *process* and a client against
it, restarts the broker while tokens are streaming and checks that every request still
ends with its one complete, correct text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import time

import pytest
from transformers import AutoTokenizer

from schemas import GenerateChunk
from tests.kafka_helpers import read_to_end, read_topic
from tests.process_helpers import WorkerProcesses, last_attempt_text, uninterrupted_texts
from workers.client import GenpipeClient, make_request
from workers.kafka.records import decode_message
from workers.kafka.settings import KafkaSettings

pytestmark = [pytest.mark.kafka, pytest.mark.slow,
              pytest.mark.skipif(not (shutil.which("java") and shutil.which("mvn")),
                                 reason="restarting a broker needs the local one (java and mvn)")]

# Neither the session broker (19092) nor the life-cycle test's (29092).
RESTART_PORT = 29192
DOWN_PORT = 29292  # the gateway's broker that goes away
GONE_PORT = 29392  # the broker that is gone when the workers are told to stop
AWAY_S = 40  # longer than the producer's request timeout (workers/kafka/clients.py: 30 s)
PROMPTS = ["Once upon a time", "The weather today is", "Le café est", "東京の天気は", "Hello! 👋 How are",
           "Die Straße war", "¿Dónde está", "The little fox said"]


@pytest.mark.parametrize("how", ["sigterm", "sigkill", "away"])
async def test_broker_restart_mid_stream_loses_no_request(how, make_topics, tiny_model_dir, tmp_path):
    """"away": the broker is gone for longer than the producer's request timeout (30 s),
    past which aiokafka refuses more records for a partition whose queue is still full
    (while it retries what is queued); before, those records were dropped: a request's
    chunks got a hole and the derender failed it (seq gap)."""
    from workers.broker import local

    if local.answers(RESTART_PORT):
        pytest.skip(f"something already answers on port {RESTART_PORT}")
    data_dir = tmp_path / "broker"
    info = await asyncio.to_thread(local.broker_up, port=RESTART_PORT, data_dir=data_dir,
                                   timeout=120, quiet=True)
    settings = dataclasses.replace(KafkaSettings(), bootstrap_servers=info.bootstrap_servers,
                                   topic_prefix="restart")
    workers = WorkerProcesses(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    # "away": 10 logprobs a token make ~0.5 kB of chunk per token, so a partition's queued
    # batch fills (256 kB: records join it while it waits, workers/kafka/publisher.py) well
    # within the outage, and the sends after it find no room.
    logprobs = {"logprobs": 10} if how == "away" else {}
    requests = [make_request(tokenizer.encode(prompt), kind="completion", request_id=f"br-{i}", max_tokens=320,
                             temperature=0, ignore_eos=True, stream=True, **logprobs)
                for i, prompt in enumerate(PROMPTS)]
    try:
        await make_topics(settings, partitions=2)
        common = ["--bootstrap-servers", settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix]
        # Paced like a real model (320 tokens ≈ 6.4 s): the restart lands mid-stream.
        workers.start("generate", "generate-worker", "--model", str(tiny_model_dir), "--max-batch", "8",
                      "--min-step-ms", "20", *common)
        workers.start("derender", "derender-worker", "--tokenizer", str(tiny_model_dir), *common)
        await asyncio.to_thread(workers.wait_ready)

        async with GenpipeClient(settings=settings, timeout_s=240) as client:
            tasks = [asyncio.ensure_future(last_attempt_text(client, r)) for r in requests]
            # Restart once tokens are flowing but well before the requests can finish: at
            # the first result (a count of records would say nothing of the time passed, as
            # chunks coalesce tokens when publishing is slow).
            await read_topic(settings, settings.topic("results"), until=lambda rs: len(rs) >= 1)
            chunks = await read_to_end(settings, settings.topic("chunks"))
            finals = sum(decode_message(r, GenerateChunk).finish_reason is not None for r in chunks)
            assert finals < len(requests), "the generate worker is still streaming when the broker goes"
            if how in ("sigkill", "away"):
                os.kill(info.pid, signal.SIGKILL)
                assert await asyncio.to_thread(local._wait_gone, info.pid, 30)
                (data_dir / "broker.pid").unlink()
                if how == "away":  # the outage itself is what is tested: its length is the point
                    await asyncio.sleep(AWAY_S)
            else:
                await asyncio.to_thread(local.broker_down, port=RESTART_PORT, data_dir=data_dir)
            assert not local.answers(RESTART_PORT, timeout=1), "the broker is down"
            info = await asyncio.to_thread(local.broker_up, port=RESTART_PORT, data_dir=data_dir,
                                           timeout=120, quiet=True)
            assert not info.reused
            texts = [text for text, _ in await asyncio.wait_for(asyncio.gather(*tasks), 300)]
        for name, proc in workers.procs:
            assert proc.poll() is None, f"{name} died across the restart:\n{workers.log(name)[-3000:]}"
        if how == "away":  # the outage did what it is there for: a send found no room and waited
            assert "no room in the producer's queue for" in workers.log("generate"), workers.log("generate")[-3000:]
    finally:
        codes = workers.stop_all()
        await asyncio.to_thread(local.broker_down, port=RESTART_PORT, data_dir=data_dir)
    assert codes == {"generate": 0, "derender": 0}, codes

    expected = uninterrupted_texts(tiny_model_dir, requests)
    for request, text in zip(requests, texts):
        assert text == expected[request.request_id], request.request_id


async def test_the_gateway_answers_503_while_kafka_is_down(make_topics, tiny_model_dir, tmp_path, caplog):
    """`genpipe serve` with its broker gone: /health and every request say 503 within the
    send timeout, in OpenAI's error shape, instead of hanging on the producer's retries;
    and it stops when told to, though its producer still holds the refused records
    (aiokafka's stop() waited for the broker to take them: the client's close() now waits
    at most CLOSE_WAIT_S, workers/client.py), leaving nothing behind."""
    import httpx

    from tests.test_gateway import serving_gateway
    from workers.broker import local

    if local.answers(DOWN_PORT):
        pytest.skip(f"something already answers on port {DOWN_PORT}")
    data_dir = tmp_path / "broker"
    info = await asyncio.to_thread(local.broker_up, port=DOWN_PORT, data_dir=data_dir, timeout=120, quiet=True)
    settings = dataclasses.replace(KafkaSettings(), bootstrap_servers=info.bootstrap_servers, topic_prefix="down")
    try:
        await make_topics(settings, partitions=1)
        async with serving_gateway(settings, str(tiny_model_dir), gateway_id="down", send_timeout_s=3) as (base, _), \
                httpx.AsyncClient(base_url=base, timeout=60) as http:
            await asyncio.to_thread(local.broker_down, port=DOWN_PORT, data_dir=data_dir)
            health = await http.get("/health")
            assert health.status_code == 503 and "does not answer" in health.json()["reason"]
            body = {"model": "tiny", "prompt": "Once", "max_tokens": 3}
            answer = await http.post("/v1/completions", json=body)
            assert answer.status_code == 503, answer.text
            error = answer.json()["error"]
            # what failed, not where: the cluster's address is the operator's (the log's)
            assert error["type"] == "service_unavailable", error
            assert error["message"].startswith("Kafka did not take request "), error
            assert info.bootstrap_servers not in answer.text
            assert any(info.bootstrap_servers in r.getMessage() and "is it reachable" in r.getMessage()
                       for r in caplog.records if r.name == "workers.gateway.app")
            events = []
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("data: "):
                        events.append(json.loads(line[len("data: "):]))
            assert len(events) == 1 and events[0]["error"]["code"] == 503  # the stream says why, and ends
            assert events[0]["error"]["message"].startswith("Kafka did not take request "), events
        # (serving_gateway's exit waits at most 30 s for the gateway to stop, Kafka still down)
        # and nothing of its producer is left waiting for Kafka (aiokafka's accumulator close
        # task stayed pending for good: workers/kafka/clients.py `stop_producer`)
        left = [task for task in asyncio.all_tasks() if "MessageAccumulator.close" in repr(task.get_coro())]
        assert not left, left
    finally:
        await asyncio.to_thread(local.broker_down, port=DOWN_PORT, data_dir=data_dir)


async def test_workers_told_to_stop_while_the_broker_is_gone_stop_without_their_last_commit(
        make_topics, tiny_model_dir, tmp_path):
    """Workers with work done but not yet committed, and records not yet acknowledged (a
    request still streaming), their broker gone, get SIGTERM: they stop (exit 0) after
    bounded waits for the records and the last commit, and say why, instead of waiting
    for as long as the broker is away (before: both workers still up 150 s after SIGTERM
    with the work committed only, and the generate worker for good with records in
    flight, until a supervisor killed them). Nothing is lost: the partitions' next owner
    re-reads from the last commit."""
    from workers.broker import local

    if local.answers(GONE_PORT):
        pytest.skip(f"something already answers on port {GONE_PORT}")
    data_dir = tmp_path / "broker"
    info = await asyncio.to_thread(local.broker_up, port=GONE_PORT, data_dir=data_dir, timeout=120, quiet=True)
    settings = dataclasses.replace(KafkaSettings(), bootstrap_servers=info.bootstrap_servers, topic_prefix="gone")
    workers = WorkerProcesses(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    done = make_request(tokenizer.encode("Once upon a time"), kind="completion", request_id="gone-done",
                        max_tokens=8, temperature=0, ignore_eos=True, stream=True)
    # ~60 s of tokens at 20 ms a step: still streaming when the broker goes.
    streaming = [make_request(tokenizer.encode(prompt), kind="completion", request_id=f"gone-{i}",
                              max_tokens=3000, temperature=0, ignore_eos=True, stream=True)
                 for i, prompt in enumerate(PROMPTS[:4])]
    try:
        await make_topics(settings, partitions=1)
        # No periodic commit during the test: what the workers did is uncommitted when the broker goes.
        common = ["--bootstrap-servers", settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix,
                  "--commit-interval-ms", "600000"]
        workers.start("generate", "generate-worker", "--model", str(tiny_model_dir), "--min-step-ms", "20",
                      "--grace-period", "2", *common)
        workers.start("derender", "derender-worker", "--tokenizer", str(tiny_model_dir), *common)
        await asyncio.to_thread(workers.wait_ready)
        async with GenpipeClient(settings=settings, timeout_s=120, cancel_on_abandon=False) as client:
            text, _ = await last_attempt_text(client, done)
            assert text
            for request in streaming:  # each has sent results: its chunks are flowing
                stream = client.records(request)
                await stream.__anext__()
                await stream.aclose()
        os.kill(info.pid, signal.SIGKILL)
        assert await asyncio.to_thread(local._wait_gone, info.pid, 30)
        (data_dir / "broker.pid").unlink()
        # Told to stop once the generate worker waits for room in its producer's queue (it
        # says so after the producer's request timeout, 30 s). Its chunks wait in a lane
        # (workers/kafka/lanes.py): the loop is not stuck in a publish, the engine goes on.
        await asyncio.to_thread(wait_for_log, workers, "generate", "no room in the producer's queue", 90)
        # The bounds: 10 s for a stuck turn, 2 s of grace, 10 s for the records, 10 s for
        # the commit, 1 s for the producer; a hang is killed at 60.
        codes = await asyncio.to_thread(workers.stop_all, 60)
    finally:
        workers.stop_all()
        await asyncio.to_thread(local.broker_down, port=GONE_PORT, data_dir=data_dir)
    assert codes == {"generate": 0, "derender": 0}, {name: (code, workers.log(name)[-2000:])
                                                     for name, code in codes.items()}
    for name in ("generate", "derender"):
        assert "final commit not done within 10 s" in workers.log(name), workers.log(name)[-2000:]
    generate = workers.log("generate")
    assert "gone.chunks[0]: the producer has not taken a batch for 1 s" in generate  # its lane opened
    assert "records not acknowledged within 10 s (is the broker reachable?)" in generate
    for name in ("generate", "derender"):  # (aiokafka's KeyError for a retried batch: clients.py)
        assert "Exception in callback" not in workers.log(name), workers.log(name)[-3000:]


def wait_for_log(workers: WorkerProcesses, name: str, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in workers.log(name):
        assert time.monotonic() < deadline, f"{name} never logged {text!r}:\n{workers.log(name)[-2000:]}"
        time.sleep(0.2)  # polling a log file: the condition is checked, not assumed
