"""Interop with a plain kcat: JSON request in, JSON results out, no genpipe code on that side."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import pytest

from workers.derender.service import DerenderWorkerConfig, run_derender_worker
from workers.generate.service import GenerateWorkerConfig, run_generate_worker

pytestmark = [pytest.mark.kafka, pytest.mark.skipif(shutil.which("kcat") is None,
                                                    reason="kcat not installed (.ci/run installs it)")]


async def test_a_request_produced_by_kcat_gets_a_result_kcat_reads(kafka_settings, make_topics, tiny_model_dir):
    await make_topics(kafka_settings, partitions=2)
    broker = kafka_settings.bootstrap_servers
    stop, ready_gen, ready_der = asyncio.Event(), asyncio.Event(), asyncio.Event()
    tasks = [
        asyncio.ensure_future(run_generate_worker(
            kafka_settings, GenerateWorkerConfig(model=str(tiny_model_dir), group_id=f"{kafka_settings.topic_prefix}-g"),
            stop=stop, on_ready=ready_gen.set)),
        asyncio.ensure_future(run_derender_worker(
            kafka_settings, DerenderWorkerConfig(tokenizer=str(tiny_model_dir), group_id=f"{kafka_settings.topic_prefix}-d"),
            stop=stop, on_ready=ready_der.set)),
    ]
    try:
        await asyncio.wait_for(asyncio.gather(ready_gen.wait(), ready_der.wait()), 120)
        request = {"request_id": "kcat-1", "prompt_token_ids": [1, 100, 200, 300],
                   "sampling": {"max_tokens": 6, "temperature": 0, "ignore_eos": True},
                   "output": {"kind": "completion", "stream": True}}
        produced = await asyncio.to_thread(
            subprocess.run, ["kcat", "-P", "-b", broker, "-t", kafka_settings.topic("requests"), "-k", "kcat-1",
                             "-H", "content-type=application/json"],
            input=json.dumps(request).encode(), capture_output=True, timeout=60)
        assert produced.returncode == 0, produced.stderr

        lines: list[dict] = []
        async def read_until_final():
            while not any("genpipe-final" in line["headers"] for line in lines):
                out = await asyncio.to_thread(
                    subprocess.run, ["kcat", "-C", "-b", broker, "-t", kafka_settings.topic("results"),
                                     "-o", "beginning", "-e", "-J", "-q"], capture_output=True, timeout=60)
                assert out.returncode == 0, out.stderr
                lines[:] = [json.loads(line) for line in out.stdout.decode().splitlines() if line.strip()]
                if not any("genpipe-final" in line["headers"] for line in lines):
                    await asyncio.sleep(0.2)  # kcat -e exits at the end of the topic: read again
        await asyncio.wait_for(read_until_final(), 120)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    assert all(line["key"] == "kcat-1" for line in lines)
    values = [json.loads(line["payload"]) for line in lines]
    assert all(v["object"] == "text_completion" and v["id"] == "cmpl-kcat-1" for v in values)
    assert values[-1]["choices"][0]["finish_reason"] == "length"
    headers = lines[-1]["headers"]  # kcat -J: a flat [name, value, name, value, ...] list
    as_dict = dict(zip(headers[::2], headers[1::2]))
    assert as_dict["content-type"] == "application/json" and as_dict["genpipe-final"] == "1"
    assert "".join(v["choices"][0]["text"] for v in values)
