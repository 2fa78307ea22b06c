"""`genpipe serve` when a generate worker dies under a request (docs/design.md §9):
what the HTTP client sees. Real broker, worker processes killed with SIGKILL, real HTTP.

- Streamed, after bytes went out: the gateway cannot take them back, so the stream ends
  with an error event saying the output so far is void (no `[DONE]`), and the request's
  new attempt is cancelled, so it does not hold an engine row for nobody.
- Not streamed (nothing sent yet): the restart is invisible; the answer is the new
  attempt's, whole, exactly what an uninterrupted run gives.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.kafka_helpers import read_topic
from tests.process_helpers import WorkerProcesses
from tests.test_gateway import serving_gateway

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
GENERATE = ("generate-0", "generate-1", "generate-2")
PROMPT = [1, 5, 6]


def owner(workers: WorkerProcesses, alive: list[str]) -> str:
    """The generate worker that holds partition 0 of the requests topic now."""
    holders = [name for name in alive if 0 in workers.partitions(name)]
    assert len(holders) == 1, holders
    return holders[0]


def uninterrupted_text(tokenizer: str, request_id: str, max_tokens: int) -> str:
    """What the synthetic engine's ids for this request read as, through the derender rules."""
    from tests.derender_support import make_chunks, run_chunks, streamed_text
    from workers.derender.state import Derenderer
    from workers.generate.service import _vocab_size
    from workers.generate.synthetic import synthetic_token

    ids = [synthetic_token(request_id, i, _vocab_size(tokenizer)) for i in range(max_tokens)]
    chunks = make_chunks(request_id, ids, prompt_tail=PROMPT, prompt_count=len(PROMPT))
    return streamed_text(run_chunks(Derenderer(tokenizer), chunks))


async def test_a_generate_worker_killed_under_http_requests(kafka_settings, make_topics, tiny_model_dir, tmp_path):
    # One partition: one generate worker owns every request, the others stand by.
    await make_topics(kafka_settings, partitions=1)
    workers = WorkerProcesses(tmp_path)
    common = ["--bootstrap-servers", kafka_settings.bootstrap_servers, "--topic-prefix", kafka_settings.topic_prefix]
    for name in GENERATE:  # 50 ms steps: a 100-token request is mid-stream for seconds
        workers.start(name, "generate-worker", "--engine", "synthetic", "--step-ms", "50", "--max-batch", "8",
                      *common)
    workers.start("derender-0", "derender-worker", "--tokenizer", str(tiny_model_dir), *common)
    alive = list(GENERATE)
    try:
        workers.wait_ready()
        async with serving_gateway(kafka_settings, str(tiny_model_dir), gateway_id="restarts") as (base, _), \
                httpx.AsyncClient(base_url=base, timeout=120) as http:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 100, "ignore_eos": True}

            # Streamed: kill the owner once the first event is out.
            events: list[str] = []
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
                assert stream.status_code == 200
                async for line in stream.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[len("data: "):])
                    if len(events) == 1:
                        victim = owner(workers, alive)
                        workers.kill(victim)
                        alive.remove(victim)
            assert "[DONE]" not in events
            first, last = json.loads(events[0]), json.loads(events[-1])
            assert first["object"] == "text_completion" and first["choices"][0]["text"]
            assert last["error"]["type"] == "server_error"
            assert "restarted" in last["error"]["message"] and "send the request again" in last["error"]["message"]
            # ... and the new attempt, which nobody reads now, is cancelled.
            request_id = first["id"].removeprefix("cmpl-")
            await read_topic(kafka_settings, kafka_settings.topic("cancel"), timeout=60,
                             until=lambda records: any(r.key == request_id.encode() for r in records))

            # Not streamed: kill the owner once the request's chunks flow; the answer is whole.
            answer = asyncio.ensure_future(http.post("/v1/completions", json=body))
            await read_topic(kafka_settings, kafka_settings.topic("chunks"), timeout=60,  # a chunk of this one
                             until=lambda records: any(r.key != request_id.encode() for r in records))
            victim = owner(workers, alive)
            workers.kill(victim)
            alive.remove(victim)
            response = await answer
            assert response.status_code == 200, response.text
            result = response.json()
            choice = result["choices"][0]
            assert choice["finish_reason"] == "length" and result["usage"]["completion_tokens"] == 100
            assert choice["text"] == uninterrupted_text(str(tiny_model_dir), result["id"].removeprefix("cmpl-"), 100)
    finally:
        codes = workers.stop_all()
    assert all(codes[name] == 0 for name in alive + ["derender-0"]), codes
