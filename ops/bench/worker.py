"""Engine bench (c): the generate worker through a real broker vs the engine alone.

Same workload on both sides (N greedy requests, EOS ignored, max_tokens spread evenly
over 8..256, batch 32, one torch thread): the engine in this process, then a
`genpipe generate-worker` process fed through Kafka, timed from the first request sent
to the last chunk published (the run is over once the worker has committed past every
request, which it does only when their final chunks are acknowledged). One worker per `--engine-in` mode (the engine stepping in
a thread of the worker process, or in a child process of its own), both up throughout;
rounds interleave the engine alone and each worker so the box's drift hits all alike.
Prints tokens/s and the ratio to the engine alone (goal >= 0.9x).

    python ops/bench/worker.py [--bootstrap-servers 127.0.0.1:9092] [--requests 64] \
        [--rounds 3] [--engine-in thread process]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from schemas import GenerateChunk, GenerateRequest, SamplingParams, encode, headers_for  # noqa: E402
from workers.kafka.clients import make_producer  # noqa: E402
from workers.kafka.follow import follow  # noqa: E402
from workers.kafka.records import decode_message  # noqa: E402
from workers.kafka.settings import KafkaSettings  # noqa: E402


def workload(n: int, vocab: int, rng: random.Random) -> list[GenerateRequest]:
    lengths = [8 + (256 - 8) * i // max(1, n - 1) for i in range(n)]
    rng.shuffle(lengths)
    return [GenerateRequest(request_id=f"w{i}-{uuid.uuid4().hex[:6]}",
                            prompt_token_ids=[1] + [rng.randrange(3, vocab) for _ in range(rng.randint(6, 60))],
                            sampling=SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
            for i, m in enumerate(lengths)]


def engine_alone(model_dir: str, requests: list[GenerateRequest], batch: int) -> tuple[int, float]:
    from workers.generate.engine import Engine

    engine = Engine(model_dir, max_batch=batch)
    warm = GenerateRequest(request_id="warm", prompt_token_ids=[1, 5], sampling=SamplingParams(max_tokens=4))
    engine.add(warm)
    while engine.has_work():
        engine.step()
    start = time.perf_counter()
    for request in requests:
        engine.add(request)
    tokens = 0
    while engine.has_work():
        tokens += sum(len(o.token_ids) for o in engine.step())
    return tokens, time.perf_counter() - start


async def until_committed(settings: KafkaSettings, requests: list[GenerateRequest], group: str) -> tuple[int, float]:
    """Send the requests; time until the worker published its last chunk.

    Done when the worker's group has committed past all of them (it commits a request
    only once the broker acknowledged its final chunk): polled every 100 ms, with no
    consumer in this process competing with the worker for the two cores. The end of the
    run is then read off the chunk topic, the producer's timestamp on each partition's
    last record (the last final chunks), so neither this poll nor the worker's commit
    interval adds to the time.
    """
    from aiokafka import TopicPartition

    from workers.kafka.clients import make_admin

    admin = make_admin(settings)
    await admin.start()
    producer = make_producer(settings)
    await producer.start()
    topic = settings.topic("requests")
    tps = [TopicPartition(topic, p) for p in range(4)]
    base = await admin.list_consumer_group_offsets(group, partitions=tps)
    start_total = sum(max(0, om.offset) for om in base.values() if om is not None)
    start_ms = time.time() * 1000
    for request in requests:
        await producer.send(topic, encode(request), key=request.request_id.encode(), headers=headers_for(request))
    await producer.flush()
    while True:
        committed = await admin.list_consumer_group_offsets(group, partitions=tps)
        if sum(max(0, om.offset) for om in committed.values() if om is not None) - start_total >= len(requests):
            break
        await asyncio.sleep(0.1)  # polling the committed offsets, the condition itself
    await producer.stop()
    await admin.close()
    end_ms = await last_record_ms(settings, settings.topic("chunks"))
    return sum(r.sampling.max_tokens for r in requests), (end_ms - start_ms) / 1000


async def last_record_ms(settings: KafkaSettings, topic: str, partitions: int = 4) -> float:
    """The latest timestamp among the last records of the topic's partitions."""
    from aiokafka import TopicPartition

    from workers.kafka.clients import make_consumer

    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        last = {tp: end - 1 for tp, end in ends.items() if end > 0}
        for tp, offset in last.items():
            consumer.seek(tp, offset)
        latest = 0.0
        while last:
            for tp, records in (await consumer.getmany(timeout_ms=1000)).items():
                for record in records:
                    if record.offset == last.get(tp):
                        latest = max(latest, record.timestamp)
                        del last[tp]
        return latest
    finally:
        await consumer.stop()


async def through_kafka(settings: KafkaSettings, requests: list[GenerateRequest]) -> tuple[int, float]:
    pending = {r.request_id for r in requests}
    tokens = 0
    done = asyncio.Event()
    stop, ready = asyncio.Event(), asyncio.Event()

    def on_chunk(message) -> None:
        nonlocal tokens
        chunk = decode_message(message, GenerateChunk)
        if chunk.request_id in pending or chunk.finish_reason is None:
            tokens += len(chunk.token_ids)
        if chunk.finish_reason is not None:
            pending.discard(chunk.request_id)
            if not pending:
                done.set()

    reader = asyncio.ensure_future(follow(settings, settings.topic("chunks"), on_chunk, stop, ready=ready))
    await ready.wait()
    producer = make_producer(settings)
    await producer.start()
    start = time.perf_counter()
    for request in requests:
        await producer.send(settings.topic("requests"), encode(request), key=request.request_id.encode(),
                            headers=headers_for(request))
    await producer.flush()
    await asyncio.wait_for(done.wait(), 600)
    elapsed = time.perf_counter() - start
    await producer.stop()
    stop.set()
    await reader
    return tokens, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap-servers", default=os.environ.get("GENPIPE_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds (engine alone, then each worker); medians are reported")
    parser.add_argument("--commit-interval-ms", type=float, default=500,
                        help="the workers' commit interval (the worker's default; it does not add to the time)")
    parser.add_argument("--engine-in", nargs="+", default=["thread", "process"], choices=("thread", "process"),
                        help="generate-worker --engine-in modes to compare")
    args = parser.parse_args()

    import torch

    from workers.broker.topics import create_topics
    from workers.models.tinymodel import default_model_dir

    torch.set_num_threads(1)
    model_dir = str(default_model_dir("spm"))
    log_dir = Path(tempfile.mkdtemp(prefix="genpipe-bench-"))
    workers = {}
    for engine_in in args.engine_in:  # one worker per mode, each on its own topics, all up throughout
        settings = KafkaSettings(bootstrap_servers=args.bootstrap_servers,
                                 topic_prefix=f"bench-{engine_in}-{uuid.uuid4().hex[:6]}")
        asyncio.run(create_topics(settings, partitions=4))
        workers[engine_in] = (settings, start_worker(settings, model_dir, args.batch, engine_in, log_dir,
                                                            args.commit_interval_ms))
    try:
        for settings, _ in workers.values():  # each has joined its group and loaded its model
            warm = [GenerateRequest(request_id=f"warm-{uuid.uuid4().hex[:6]}", prompt_token_ids=[1, 5],
                                    sampling=SamplingParams(max_tokens=4)) for _ in range(2)]
            asyncio.run(through_kafka(settings, warm))
        rates: dict[str, list[float]] = {"alone": [], **{m: [] for m in workers}}
        ratios: dict[str, list[float]] = {m: [] for m in workers}
        for _ in range(args.rounds):
            tokens, seconds = engine_alone(model_dir, workload(args.requests, 2000, random.Random(0)), args.batch)
            rates["alone"].append(tokens / seconds)
            for engine_in, (settings, _) in workers.items():
                tokens, seconds = asyncio.run(until_committed(
                    settings, workload(args.requests, 2000, random.Random(0)), f"{settings.topic_prefix}-gen"))
                rates[engine_in].append(tokens / seconds)
                ratios[engine_in].append(rates[engine_in][-1] / rates["alone"][-1])
    finally:
        for _, proc in workers.values():
            os.killpg(proc.pid, signal.SIGTERM)
        for _, proc in workers.values():
            proc.wait(60)
    print(f"{args.requests} requests, max_tokens 8..256, batch {args.batch}, 1 torch thread, tiny model on CPU, "
          f"{args.rounds} interleaved rounds (median; all rounds in brackets)")
    print(f"engine alone, in-process      : {statistics.median(rates['alone']):6.0f} tok/s  "
          f"[{' '.join(f'{r:.0f}' for r in rates['alone'])}]")
    for engine_in in workers:
        print(f"worker, engine in a {engine_in:<7}   : {statistics.median(rates[engine_in]):6.0f} tok/s  "
              f"ratio {statistics.median(ratios[engine_in]):.2f}x  "
              f"[{' '.join(f'{r:.2f}' for r in ratios[engine_in])}]  (goal >= 0.9x)")


def start_worker(settings: KafkaSettings, model_dir: str, batch: int, engine_in: str, log_dir: Path,
                 commit_ms: float) -> subprocess.Popen:
    log = open(log_dir / f"generate-{engine_in}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "workers.cli", "generate-worker", "--model", model_dir,
                             "--bootstrap-servers", settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix,
                             "--max-batch", str(batch), "--threads", "1", "--commit-interval-ms", str(commit_ms),
                             "--group-id", f"{settings.topic_prefix}-gen", "--engine-in", engine_in],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


if __name__ == "__main__":
    main()
