"""Latency the two Kafka hops add, side by side with the engine alone.

Contender: the pipeline (a generate and a derender worker as processes, a real broker,
the client library). Per token: the time from the token being sampled (the chunk's
`sampled_at_ns`) to its result record reaching the client, p50 and p99; and time to first
token through the pipeline minus the engine's own time to first token (prefill) measured
in this process on the same prompts. Reference: the engine alone, in-process, where the
added latency is zero by definition. Low load: one request at a time; moderate: 16 at once.

    python ops/bench/pipeline.py [--bootstrap-servers 127.0.0.1:9092] [--requests 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from schemas import GenerateChunk  # noqa: E402
from workers.kafka.follow import follow  # noqa: E402
from workers.kafka.records import decode_message  # noqa: E402
from workers.kafka.settings import KafkaSettings  # noqa: E402

PROMPTS = ["Once upon a time", "The weather today is", "Le café est", "Hello! How are", "The little fox said"]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def engine_ttft(model_dir: str, prompts: list[list[int]]) -> list[float]:
    """The engine's own time to first token (prefill + first sample), batch of one."""
    from schemas import GenerateRequest, SamplingParams
    from workers.generate.engine import Engine

    engine = Engine(model_dir, max_batch=4)
    times = []
    for i, ids in enumerate(prompts * 2):
        engine.add(GenerateRequest(request_id=f"ref-{i}", prompt_token_ids=ids,
                                   sampling=SamplingParams(max_tokens=1, temperature=0)))
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
        if i >= len(prompts):  # the first pass warms up
            times.append(time.perf_counter() - start)
    return times


async def run_load(settings: KafkaSettings, prompts: list[list[int]], n: int, concurrency: int,
                   max_tokens: int) -> tuple[list[float], list[float]]:
    from workers.client import GenpipeClient, make_request

    sampled: dict[tuple[str, str, int], int] = {}
    received: list[tuple[str, str, int, int]] = []
    ttfts: list[float] = []
    stop, ready = asyncio.Event(), asyncio.Event()

    def on_chunk(message) -> None:
        chunk = decode_message(message, GenerateChunk)
        sampled[(chunk.request_id, chunk.attempt, chunk.seq)] = chunk.sampled_at_ns

    chunk_reader = asyncio.ensure_future(follow(settings, settings.topic("chunks"), on_chunk, stop, ready=ready))
    await ready.wait()
    async with GenpipeClient(settings=settings, timeout_s=120) as client:
        semaphore = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with semaphore:
                request = make_request(prompts[i % len(prompts)], request_id=f"bench-{uuid.uuid4().hex[:8]}",
                                       max_tokens=max_tokens, temperature=0, stream=True, ignore_eos=True)
                sent = time.time_ns()
                first = True
                async for message in client.records(request):
                    now = time.time_ns()
                    if first:
                        ttfts.append((now - sent) / 1e9)
                        first = False
                    received.append((message.request_id, message.attempt, message.seq, now))

        await asyncio.gather(*(one(i) for i in range(n)))
    # a chunk record can reach the follower a moment after its result reached the client
    deadline = time.monotonic() + 10
    while any((r, a, s) not in sampled for r, a, s, _ in received) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    stop.set()
    await chunk_reader
    added = [(now - sampled[(r, a, s)]) / 1e9 for r, a, s, now in received if (r, a, s) in sampled]
    return added, ttfts


def start_workers(settings: KafkaSettings, model_dir: str, log_dir: Path) -> list[subprocess.Popen]:
    common = ["--bootstrap-servers", settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix,
              "--log-level", "WARNING"]
    procs = []
    for name, args in (("generate", ["generate-worker", "--model", model_dir]),
                       ("derender", ["derender-worker", "--tokenizer", model_dir])):
        log = open(log_dir / f"{name}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, "-m", "workers.cli", *args, *common], stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap-servers", default=os.environ.get("GENPIPE_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from workers.broker.topics import create_topics
    from workers.generate.tinymodel import default_model_dir

    model_dir = str(default_model_dir("spm"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    settings = KafkaSettings(bootstrap_servers=args.bootstrap_servers, topic_prefix=f"bench-{uuid.uuid4().hex[:6]}")
    asyncio.run(create_topics(settings, partitions=4))
    reference = engine_ttft(model_dir, prompts)
    print(f"engine alone: time to first token p50 {statistics.median(reference) * 1e3:.2f} ms "
          f"(prefill + first sample, batch of one, in-process)")
    log_dir = Path(tempfile.mkdtemp(prefix="genpipe-bench-"))
    procs = start_workers(settings, model_dir, log_dir)
    try:
        # warm-up: workers join their groups, load, and compile their first steps
        asyncio.run(run_load(settings, prompts, 2, 1, 4))
        print(f"{'load':<24} {'tokens':>7} {'added p50':>10} {'added p99':>10} {'ttft p50':>9} "
              f"{'ttft overhead p50':>18}")
        for label, concurrency in (("low (1 at a time)", 1), ("moderate (16 at once)", 16)):
            added, ttfts = asyncio.run(run_load(settings, prompts, args.requests, concurrency, args.max_tokens))
            overhead = statistics.median(ttfts) - statistics.median(reference)
            print(f"{label:<24} {len(added):>7} {pct(added, 0.5) * 1e3:>8.2f}ms {pct(added, 0.99) * 1e3:>8.2f}ms "
                  f"{statistics.median(ttfts) * 1e3:>7.1f}ms {overhead * 1e3:>16.1f}ms")
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            proc.wait(60)


if __name__ == "__main__":
    main()
