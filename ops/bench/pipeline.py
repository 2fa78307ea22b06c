"""Latency the two Kafka hops add, side by side with the engine alone and the Kafka floor.

Contender: the pipeline (a generate and a derender worker as processes, a real broker,
the client library). Per result record (one per chunk: at low load a chunk is one token,
now and then two; the `results` column counts them): the time from its newest token being
sampled (the chunk's `sampled_at_ns`) to the record reaching the client, p50 and p99, split at the
moment a reader in this process sees the chunk (hop 1: generate → chunk topic; hop 2:
derender → client); and time to first token through the pipeline minus the engine's own
time to first token (prefill) measured in this process on the same prompts. Low load:
one request at a time; moderate: 16 at once.

References, in the same run:
- the engine alone, in-process: added latency zero by definition, its TTFT subtracted;
- the Kafka floor: the same two hops with no genpipe code in them, one record per token
  at the same pace: this process produces (genpipe's producer settings) → a relay
  process consumes and re-produces (genpipe's consumer and producer settings) → this
  process consumes. What genpipe adds beyond that is its own cost.
- the same floor with a reader of its first topic in this process. The pipeline's
  figures need one (the chunk reader: a token's `sampled_at_ns` is only in its chunk),
  and that reader costs the hop it watches: on 2 vCPUs two more of them raised the
  added p50 by 1.7-2.3 ms (BENCHMARKS.md, "Low-load latency: where a token's time
  goes"). The floor got none before 2026-12-02; both floors are printed, each with its
  goal (c) verdict, and the segments below compare with this one.

The built-in tiny model steps in a few ms on a CPU, so one request already emits a few
hundred tokens/s, each its own record; `--min-step-ms` (the generate worker's option)
paces the engine like a real model (20 ms ≈ 50 tokens/s per request). Each pace runs as
its own table.

    python ops/bench/pipeline.py [--bootstrap-servers 127.0.0.1:9092] [--requests 32] \
        [--min-step-ms 0 20] [--loads low moderate] [--reference REV]

Where the time goes: the bench's chunk and results topics (and the floor's two) keep the
broker's append time as each record's timestamp (`message.timestamp.type=LogAppendTime`),
so each token's time splits into three segments on the broker's clock: sampled (the
floor: sent) → first log (the chunk topic), first log → second log (the results topic:
the derender, or the floor's relay, and a consumer and producer hop), second log → the
client. Printed per row as means in ms (of the values between the 5th and 95th
percentiles), for genpipe, for the floor with a reader and their difference:
what genpipe's generate side adds (engine child, worker, producer), what its derender
adds over a bare relay, and what its client adds over a bare reader. (The broker's
timestamps are whole ms, cut down: a mean is 0.5 ms low into a log and 0.5 ms high out
of one, the same for both, so the differences hold.)

--reference REV also runs the workers of git revision REV (a worktree under /tmp, as
throughput.py makes) on the same loads, each row right before this tree's, with its own
floor: what the changes since REV did to latency, in one run. Each row also says whether
it meets the issue #11 goal (c): added p50 <= floor p50 + 1 ms, p99 <= floor p99 + 5 ms.
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
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from schemas import GenerateChunk  # noqa: E402
from workers.kafka.follow import follow  # noqa: E402
from workers.kafka.records import decode_message  # noqa: E402
from workers.kafka.settings import KafkaSettings  # noqa: E402

LOADS = {"low": ("low (1 at a time)", 1), "moderate": ("moderate (16 at once)", 16)}
PROMPTS = ["Once upon a time", "The weather today is", "Le café est", "Hello! How are", "The little fox said"]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


@dataclass
class LoadRun:
    added: list[float]  # per token: sampled → result at the client (s)
    hop1: list[float]  # sampled → chunk seen by a reader here
    hop2: list[float]  # chunk seen here → its result at the client
    ttfts: list[float]
    segments: list[tuple[float, float, float]]  # per token: sampled → chunk log → result log → client (s)


async def log_append_time(settings: KafkaSettings, roles: tuple[str, ...]) -> None:
    """The broker stamps records of these topics with its append time (see above)."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    admin = AIOKafkaAdminClient(**settings.client_kwargs())
    await admin.start()
    try:
        await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, settings.topic(role),
                                                  configs={"message.timestamp.type": "LogAppendTime"})
                                   for role in roles])
    finally:
        await admin.close()


def segment_means(segments: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Each segment's mean over its values between the 5th and 95th percentiles: a stall
    of the shared box (tens of ms, now and then) would swing a plain mean by more than
    the differences it is read for."""
    means = []
    for i in range(3):
        values = sorted(s[i] for s in segments)
        cut = len(values) // 20
        means.append(statistics.fmean(values[cut:len(values) - cut]))
    return tuple(means)


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
                   max_tokens: int) -> LoadRun:
    from workers.client import GenpipeClient, make_request

    sampled: dict[tuple[str, str, int], int] = {}
    seen: dict[tuple[str, str, int], int] = {}
    logged: dict[tuple[str, str, int], int] = {}  # the chunk's append time (ms)
    received: list[tuple[str, str, int, int, int]] = []  # ..., at the client (ns), the result's append time (ms)
    ttfts: list[float] = []
    stop, ready = asyncio.Event(), asyncio.Event()

    def on_chunk(message) -> None:
        chunk = decode_message(message, GenerateChunk)
        seen[(chunk.request_id, chunk.attempt, chunk.seq)] = time.time_ns()
        logged[(chunk.request_id, chunk.attempt, chunk.seq)] = message.timestamp
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
                    received.append((message.request_id, message.attempt, message.seq, now, message.timestamp))

        await asyncio.gather(*(one(i) for i in range(n)))
    # a chunk record can reach the follower a moment after its result reached the client
    deadline = time.monotonic() + 10
    while any((r, a, s) not in sampled for r, a, s, _, _ in received) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    stop.set()
    await chunk_reader
    keys = [((r, a, s), now, logged_ms) for r, a, s, now, logged_ms in received if (r, a, s) in sampled]
    return LoadRun(added=[(now - sampled[k]) / 1e9 for k, now, _ in keys],
                   hop1=[(seen[k] - sampled[k]) / 1e9 for k, now, _ in keys],
                   hop2=[(now - seen[k]) / 1e9 for k, now, _ in keys], ttfts=ttfts,
                   segments=[(logged[k] / 1e3 - sampled[k] / 1e9, (result_ms - logged[k]) / 1e3,
                              now / 1e9 - result_ms / 1e3) for k, now, result_ms in keys])


def start_workers(settings: KafkaSettings, model_dir: str, log_dir: Path, min_step_ms: float,
                  code: Path | None = None) -> list[subprocess.Popen]:
    """A generate and a derender worker, from this checkout or from `code` (a worktree)."""
    common = ["--bootstrap-servers", settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix,
              "--log-level", "WARNING"]
    env = dict(os.environ, PYTHONPATH=str(code)) if code is not None else None
    procs = []
    for name, args in (("generate", ["generate-worker", "--model", model_dir, "--min-step-ms", str(min_step_ms)]),
                       ("derender", ["derender-worker", "--tokenizer", model_dir])):
        log = open(log_dir / f"{name}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, "-m", "workers.cli", *args, *common], stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True, cwd=code, env=env))
    return procs


def stop_processes(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        proc.wait(60)


# --- the Kafka floor: the same two hops with nothing of genpipe's in them ------------

async def relay(settings: KafkaSettings) -> None:
    """Consume `requests`, re-produce each record unchanged to `chunks` (until killed)."""
    from workers.kafka.clients import make_consumer, make_producer

    consumer = make_consumer(settings, settings.topic("requests"), group_id=f"{settings.topic_prefix}-relay")
    producer = make_producer(settings)
    await consumer.start()
    await producer.start()
    print("relay ready", flush=True)
    while True:
        for messages in (await consumer.getmany(timeout_ms=20)).values():
            for message in messages:
                # (the first log's append time, for the floor's segments)
                await producer.send(settings.topic("chunks"), message.value, key=message.key,
                                    headers=[("logged", str(message.timestamp).encode())])


async def floor_run(settings: KafkaSettings, records: int, rate_per_s: float,
                    segments: list | None = None, observed: bool = False) -> list[float]:
    """Send `records` at `rate_per_s` into the relay; per record, send → read back (s);
    `segments` gets each record's three segments (see above). `observed`: a reader of the
    first topic runs here too, as the pipeline's chunk reader does (see above)."""
    from workers.kafka.clients import make_producer

    latencies: list[float] = []
    stop, ready = asyncio.Event(), asyncio.Event()

    def on_record(message) -> None:
        now, sent = time.time_ns(), int(message.value)
        latencies.append((now - sent) / 1e9)
        first = dict(message.headers).get("logged")
        if segments is not None and first is not None:
            first_ms = int(first)
            segments.append((first_ms / 1e3 - sent / 1e9, (message.timestamp - first_ms) / 1e3,
                             now / 1e9 - message.timestamp / 1e3))

    firsts: dict[bytes, int] = {}

    def on_first(message) -> None:  # the work the pipeline's chunk reader does per record, about
        firsts[message.value] = int(message.value)

    readers = [asyncio.ensure_future(follow(settings, settings.topic("chunks"), on_record, stop, ready=ready))]
    await ready.wait()
    if observed:
        first_ready = asyncio.Event()
        readers.append(asyncio.ensure_future(follow(settings, settings.topic("requests"), on_first, stop,
                                                    ready=first_ready)))
        await first_ready.wait()
    producer = make_producer(settings)
    await producer.start()
    try:
        start = time.perf_counter()
        for i in range(records):
            delay = start + i / rate_per_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await producer.send(settings.topic("requests"), str(time.time_ns()).encode(), key=f"f{i % 16}".encode())
        deadline = time.monotonic() + 30
        while len(latencies) < records and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    finally:
        await producer.stop()
        stop.set()
        for reader in readers:
            await reader
    return latencies


def start_relay(settings: KafkaSettings, log_dir: Path) -> subprocess.Popen:
    log = open(log_dir / "relay.log", "wb")
    proc = subprocess.Popen([sys.executable, __file__, "--relay", "--bootstrap-servers", settings.bootstrap_servers,
                             "--topic-prefix", settings.topic_prefix], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while b"relay ready" not in (log_dir / "relay.log").read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the relay did not start: {(log_dir / 'relay.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return proc


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}ms"


def hops(values: list[float]) -> str:
    return f"{pct(values, 0.5) * 1e3:.1f}/{pct(values, 0.99) * 1e3:.1f}ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap-servers", default=os.environ.get("GENPIPE_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--min-step-ms", type=float, nargs="+", default=[0.0, 20.0],
                        help="generate worker paces to run, one table each (0 = unpaced)")
    parser.add_argument("--loads", nargs="+", choices=list(LOADS), default=list(LOADS))
    parser.add_argument("--reference", metavar="REV", help="also run the workers of this git revision (see above)")
    parser.add_argument("--relay", action="store_true", help=argparse.SUPPRESS)  # the floor's relay process
    parser.add_argument("--topic-prefix", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.relay:
        asyncio.run(relay(KafkaSettings(bootstrap_servers=args.bootstrap_servers, topic_prefix=args.topic_prefix)))
        return

    from transformers import AutoTokenizer

    from workers.broker.topics import create_topics
    from workers.models.tinymodel import default_model_dir

    model_dir = str(default_model_dir("spm"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    reference = engine_ttft(model_dir, prompts)
    print(f"engine alone: time to first token p50 {ms(statistics.median(reference))} "
          f"(prefill + first sample, batch of one, in-process)")
    log_dir = Path(tempfile.mkdtemp(prefix="genpipe-bench-"))
    floor_settings = KafkaSettings(bootstrap_servers=args.bootstrap_servers, topic_prefix=f"floor-{uuid.uuid4().hex[:6]}")
    asyncio.run(create_topics(floor_settings, partitions=4))
    asyncio.run(log_append_time(floor_settings, ("requests", "chunks")))
    relay_proc = start_relay(floor_settings, log_dir)
    try:
        asyncio.run(floor_run(floor_settings, 50, 100))  # warm-up: group join, connections
        codes = [("this", None)]
        if args.reference:
            from ops.bench.throughput import worktree

            codes.insert(0, (args.reference[:9], worktree(args.reference)))
        for min_step_ms in args.min_step_ms:
            print(f"\ngenerate --min-step-ms {min_step_ms:g}")
            print(f"{'code':<9} {'load':<22} {'results':>7} {'res/s':>6} {'added p50':>10} {'added p99':>10} "
                  f"{'hop1 p50/p99':>14} {'hop2 p50/p99':>14} {'floor p50':>10} {'floor p99':>10} "
                  f"{'ttft p50':>9} {'ttft ovh p50':>12}  goal (c)")
            workers = {}
            try:
                for name, code in codes:
                    settings = KafkaSettings(bootstrap_servers=args.bootstrap_servers,
                                             topic_prefix=f"bench-{uuid.uuid4().hex[:6]}")
                    asyncio.run(create_topics(settings, partitions=4))
                    asyncio.run(log_append_time(settings, ("chunks", "results")))
                    workers[name] = (settings, start_workers(settings, model_dir, log_dir, min_step_ms, code))
                    # warm-up: workers join their groups, load, and compile their first steps
                    asyncio.run(run_load(settings, prompts, 2, 1, 4))
                for label, concurrency in [LOADS[name] for name in args.loads]:
                    for name, (settings, _) in workers.items():
                        started = time.perf_counter()
                        run = asyncio.run(run_load(settings, prompts, args.requests, concurrency, args.max_tokens))
                        rate = len(run.added) / (time.perf_counter() - started)
                        floor = asyncio.run(floor_run(floor_settings, len(run.added), rate))
                        floor_segments: list = []
                        observed = asyncio.run(floor_run(floor_settings, len(run.added), rate, floor_segments,
                                                         observed=True))
                        overhead = statistics.median(run.ttfts) - statistics.median(reference)
                        def meets(floor: list[float]) -> str:
                            return "met" if (pct(run.added, 0.5) <= pct(floor, 0.5) + 0.001
                                             and pct(run.added, 0.99) <= pct(floor, 0.99) + 0.005) else "not met"

                        print(f"{name:<9} {label:<22} {len(run.added):>7} {rate:>6.0f} {ms(pct(run.added, 0.5)):>10} "
                              f"{ms(pct(run.added, 0.99)):>10} {hops(run.hop1):>14} {hops(run.hop2):>14} "
                              f"{ms(pct(floor, 0.5)):>10} {ms(pct(floor, 0.99)):>10} "
                              f"{ms(statistics.median(run.ttfts)):>9} {ms(overhead):>12}  "
                              f"{meets(floor)}")
                        print(f"{'':<9} {'floor with a reader':<22} of its first topic, as the pipeline has (above): "
                              f"p50 {ms(pct(observed, 0.5))}, p99 {ms(pct(observed, 0.99))}; goal (c) against it: "
                              f"{meets(observed)}")
                        ours, bare = segment_means(run.segments), segment_means(floor_segments)
                        print(f"{'':<9} {'segments, mean ms':<22} sampled/sent → chunk log → result log → client: "
                              f"genpipe {' / '.join(f'{v * 1e3:.2f}' for v in ours)}, "
                              f"floor {' / '.join(f'{v * 1e3:.2f}' for v in bare)}, "
                              f"genpipe - floor {' / '.join(f'{(a - b) * 1e3:+.2f}' for a, b in zip(ours, bare))}")
            finally:
                for _, procs in workers.values():
                    stop_processes(procs)
    finally:
        stop_processes([relay_proc])


if __name__ == "__main__":
    main()
