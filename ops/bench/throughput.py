"""Throughput of the Kafka side at GPU-like rates, and what each stage costs per token.

Contender: a generate worker with the synthetic engine (`--engine synthetic`: no model,
a fixed step time, up to --max-batch requests a step) and a derender worker, as
processes, a real broker, and a reader of the results here. All requests are sent at
once, so the engine runs full batches from the first step; the records they
make are read as they come, while the requests are still being sent.
Reference, in the same run: the same synthetic engine alone on the same requests, in this
process (its tokens/s is what the pipeline is offered). Printed: tokens/s end to end (every token over
the whole run, from the first request sent to the last final result read) and its ratio to
the engine alone; the same between the polls that read the first 10% and 90% of the
results (`10-90%`: the rate once running, without the ramp-up while requests are still
being sent, nor the tail); CPU time per token of the generate worker, its engine child,
the derender and the broker (from /proc, over the whole run; the broker's when it listens
on this machine: `n/a` otherwise; every broker of the cluster that listens here, summed,
so a local cluster's replication is in it (`genpipe broker up --brokers 3`: topics of 3
replicas); with --each-alone, its part of each stage, not counting this process's read of
the chunks after the generate stage); chunk and result records and their
mean sizes; how old a result record is when read here (its timestamp -> read), p50/p99;
and, from the generate worker's metrics (code that has it), how long a chunk's oldest
token waited to be coalesced (`genpipe_chunk_hold_seconds`, p50/p99 interpolated in its
buckets as Prometheus's histogram_quantile does): the chunk age above is the newest
token's, which that wait does not show.

Goal (a)'s latency, with --each-alone: every token's time from its sampling to the chunk
log (the chunks topic keeps the broker's append time, `LogAppendTime`, in whole
milliseconds: this and the floor below read up to 1 ms low alike), token-weighted p50/p99. A chunk says when its newest token was sampled; the synthetic
engine gives every running request a token per step, so a chunk's earlier tokens are
placed evenly between the request's previous chunk's newest token and its own (a first
chunk's tokens all at its newest: a lower bound, and a first chunk holds one token). Beside
it, in the same run once the workers are stopped: the bare produce floor, a producer as
the workers make it (workers/kafka/clients.py) and nothing else of genpipe's, sending as
many records a second, of the same mean size, as the generate worker's chunks were, one
batch per partition every step, for as long as the generate stage ran (3-15 s: a 3 s floor
read one broker pause of some 30 ms as a p99 of several ms, and the bound with it): each
record's time from its send to its log append. Goal (a): that p99 at most 3 steps + the
floor's p99.

    python ops/bench/throughput.py [--bootstrap-servers 127.0.0.1:9092] [--step-ms 2]
        [--max-batch 256] [--requests 512] [--max-tokens 128] [--k 0 5 20] [--no-stream]
        [--kind completion chat] [--text synthetic ascii cjk] [--stop TEXT] [--each-alone] [--reply-topic]
        [--reference REV]

Workloads, one run each for every combination given: --k logprobs per position
(completions: `logprobs=k`; chat: `logprobs=true, top_logprobs=k`), --kind of result
(OpenAI completion or chat shapes), --text: `synthetic` (the synthetic engine's hashed
ids of the tiny vocabulary, whose text is mostly fragments and U+FFFD), `ascii` or `cjk`
(ops/bench/derender.py's texts: English, code and numbers; CJK and emoji, byte pieces
that the derender corrects), sent as the prompts of a generate worker run with
`--synthetic-tokens prompt`, so the output is that text over and over. --reply-topic:
the requests name a reply topic of the run's own, as the HTTP gateway's do, and the
results are read there. --stop TEXT: every request has these stop strings (with --text
ascii, `--stop '\\n'` ends most within a line): the derender ends a request at the first, and
asks generate to stop it (a cancel record each); generate makes its tokens all the same
when the derender runs after it (--each-alone), and the derender reads every chunk, those
past the stop too, so the per-token figures still divide by every token generated
(without --each-alone generate stops those requests early: compare codes, not runs).

--each-alone measures each stage at its own saturation (the issue's "this 2-core machine
cannot run the full rate at once"): the derender worker is stopped (SIGSTOP, well inside
its 30 s session) while the generate worker turns every request into chunks; nothing
here reads them meanwhile (a reader took CPU from the stage on 2 cores): once the worker's
metrics say it ended every request, the chunks are read from the log. Then the derender is
continued (SIGCONT) and turns that backlog into results. Two rows per load: `generate`
(tokens/s from the first request sent to the last final chunk's append, and between the
appends of the first 10% and 90% of the tokens, their ratio to the engine alone: goal (a);
ages: a chunk's newest token, from its sampling to the chunk log; before 2026-12-04 the
chunks were read during the stage and this was the time until read here) and `derender`
(tokens/s from SIGCONT to the last final result, its CPU per token alone with the broker:
goal (b)). Run the broker as Kafka's own scripts do for these (`GENPIPE_BROKER_JAVA_OPTS`,
BENCHMARKS.md): the local broker's default, a small heap with the serial collector, pauses
it ~20 ms about every second at these rates, and those pauses made the latency's p99. Keep
its data on tmpfs (`genpipe broker up --data-dir /dev/shm/broker-29592`): on this project's
VMs' disk the broker's own appends sometimes took 69-404 ms, in about a quarter of the
runs, on both codes alike, and none did in 16 runs on tmpfs (BENCHMARKS.md, "A poll's
records in slices").

With GENPIPE_GC_PROBE=DIR and PYTHONPATH=$PWD/ops/bench/gc_probe (an absolute path: a
reference's workers run in its worktree), each side's rows also give the garbage
collector's CPU in the generate worker, its engine child and the derender, µs per token,
from the end of their start-up (what workers/gc_tuning.py is about).

--reference REV also runs the workers of git revision REV (a worktree under /tmp) on the
same load right before each contender run (right after it with --this-first: alternate
the order across runs, as a box's speed drifts), and prints the ratio of each stage's CPU
per token, and with --each-alone of each token's p99 latency: what the changes since REV
bought, measured in one run (with --text ascii or cjk, REV must know `--synthetic-tokens`).

--engine model runs the real engine in place of the synthetic one: the generate worker
with `--model DIR --device D --dtype T`, the derender with `--tokenizer DIR`, and the
engine alone in this process on the same requests, each after a warm-up of a full batch
(the first kernels, and the CUDA graphs of a full batch's shapes, outside the timing);
the engine alone is freed before the workers start. A model of a realistic size with random weights
and a vocabulary the derender can read: ops/bench/random_model.py. Goal (a)'s bound then
uses the engine alone's mean step time (steps over the whole run, prefills included), not
--step-ms, and a chunk's earlier tokens are placed as above (a request gets a token every
step once its prompt is in: exact up to the steps' own spread). --text must be synthetic
(the model says what it says). On a machine with a GPU and no Java:
ops/device/throughput_gpu.sh.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from schemas.errors import ValidationError  # noqa: E402
from workers.kafka.settings import KafkaSettings  # noqa: E402
from soak import free_port  # noqa: E402  (ops/bench/soak.py)
from pipeline import log_append_time, pct  # noqa: E402  (ops/bench/pipeline.py)
from proc_cpu import broker_pids, children, collector_seconds, cpu_seconds  # noqa: E402
from worker_metrics import bucket_quantile, finished_requests, hold_buckets  # noqa: E402
from load_reading import (LoadFailed, generate_stage, produce_floor, read_result,  # noqa: E402
                          read_to_finals)


def engine_alone(args, k: int) -> tuple[float, float]:
    """Tokens/s of the engine stepping alone on the load's own requests (the offered rate:
    its logprobs cost the engine too), and its step time in seconds (the synthetic
    engine's nominal one; the model's mean over the run)."""
    if args.engine == "synthetic":
        from workers.generate.synthetic import SyntheticEngine

        engine = SyntheticEngine(step_s=args.step_ms / 1000, max_batch=args.max_batch,
                                 tokens="prompt" if args.prompts is not None else "hash")
    else:
        import gc

        import torch

        from workers.generate.engine import Engine

        engine = Engine(args.model, args.device, args.dtype, max_batch=args.max_batch,
                        max_model_len=args.max_model_len)
        step_through(engine, make_requests(args, k, warm_up_requests(args)))
        warmed = engine.steps
    produced, elapsed = step_through(engine, make_requests(args, k, args.requests))
    if args.engine == "synthetic":
        return produced / elapsed, args.step_ms / 1000
    steps = engine.steps - warmed
    del engine
    gc.collect()  # (the runner and its CUDA graphs refer to each other)
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()  # the worker's engine loads the model next
    return produced / elapsed, elapsed / max(steps, 1)


def warm_up_requests(args) -> int:
    """Requests run before the timed ones, alike in the engine alone and through the
    workers: with the model, a full batch (its first kernels, and the CUDA graphs of a
    full batch's shapes, captured before the timing starts on both sides)."""
    return args.max_batch if args.engine == "model" else 8


def step_through(engine, requests: list) -> tuple[int, float]:
    """Queue `requests` at once and step `engine` until all end: tokens made, seconds."""
    for request in requests:
        engine.add(request)
    start, produced = time.perf_counter(), 0
    while engine.has_work():
        produced += sum(len(o.token_ids) for o in engine.step())
    return produced, time.perf_counter() - start


def worktree(rev: str) -> Path:
    """A checkout of `rev` under /tmp (made once), to run the reference workers from."""
    root = Path(__file__).resolve().parents[2]
    sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", rev], check=True,
                         capture_output=True, text=True).stdout.strip()
    path = Path(tempfile.gettempdir()) / f"genpipe-ref-{sha}"
    if not path.exists():
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(path), sha], check=True,
                       capture_output=True)
    return path


def start_workers(settings: KafkaSettings, args, log_dir: Path, code: Path | None = None,
                  metrics_port: int = 0) -> dict[str, subprocess.Popen]:
    """The generate and derender workers, from this checkout or from `code` (a worktree);
    the generate worker serves its metrics on `metrics_port` (0: none)."""
    common = ["--bootstrap-servers", settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix,
              "--log-level", "WARNING"]
    # (a reference's own code first; anything already on PYTHONPATH, such as
    # ops/bench/gc_probe, after it)
    env = (dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")])))
           if code is not None else None)
    procs = {}
    der = ["derender-worker"]
    if args.engine == "synthetic":
        gen = ["generate-worker", "--engine", "synthetic", "--step-ms", str(args.step_ms)]
    else:
        gen = ["generate-worker", "--engine", "model", "--model", args.model, "--device", args.device,
               "--dtype", args.dtype, *(["--max-model-len", str(args.max_model_len)] if args.max_model_len else [])]
        der += ["--tokenizer", args.model]
    gen += ["--max-batch", str(args.max_batch)]
    if metrics_port:
        gen += ["--metrics-port", str(metrics_port)]
    if args.prompts is not None:  # a text's ids as the prompts: the output repeats them
        gen += ["--synthetic-tokens", "prompt"]
    gen += shlex.split(args.generate_args)
    for name, extra in (("generate", gen),
                        ("derender", der)):
        log = open(log_dir / f"{name}.log", "wb")
        procs[name] = subprocess.Popen([sys.executable, "-m", "workers.cli", *extra, *common], stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True, cwd=code, env=env)
    return procs


def text_prompts(text: str, count: int, tokens: int) -> list[list[int]]:
    """`count` distinct prompts of ~`tokens` ids of the tiny spm tokenizer (the derender's
    default), from ops/bench/derender.py's workload texts, each ending on a whole character."""
    import random

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from derender import workload_ids  # noqa: E402  (this directory's ops/bench/derender.py)

    from workers.derender.vocab import VocabTables
    from workers.models.tinymodel import build_tokenizer

    tables, rng = VocabTables(build_tokenizer("spm")), random.Random(0)
    return [workload_ids(tables, text, rng, tokens) for _ in range(count)]


def make_requests(args, k: int, count: int, reply_topic: str | None = None) -> list:
    from workers.client import make_request

    logprobs = {} if not k else ({"logprobs": True, "top_logprobs": k} if args.kind == "chat" else {"logprobs": k})
    return [make_request(args.prompts[i % len(args.prompts)] if args.prompts else [1, 5, 6, 7], kind=args.kind,
                         max_tokens=args.max_tokens, ignore_eos=True, stream=not args.no_stream,
                         reply_topic=reply_topic, stop=args.stop, **logprobs)
            for i in range(count)]


def reply_topic(settings: KafkaSettings, args) -> str | None:
    """--reply-topic: the run's own reply topic (as a gateway's), else None (the results topic)."""
    return f"{settings.topic_prefix}.reply.bench" if args.reply_topic else None


async def run_load(settings: KafkaSettings, args, k: int, between=None, metrics_port: int = 0,
                   generated=None) -> dict:
    """Send every request at once; read results until each has its final one. With
    `between` (--each-alone), wait until the generate worker (metrics on `metrics_port`)
    has ended every request, call `generated()`, take the stage's figures from the chunk log
    (`generate_stage`), then call `between()` (which continues the stopped derender) and
    read the results."""
    from schemas import encode, headers_for
    from workers.kafka.clients import make_consumer, make_producer
    from workers.kafka.follow import assign_all

    results = make_consumer(settings, group_id=None, auto_offset_reset="latest")
    await results.start()
    reply = reply_topic(settings, args)
    await assign_all(results, reply or settings.topic("results"), None)
    producer = make_producer(settings)
    await producer.start()
    requests = make_requests(args, k, args.requests, reply)
    wanted = {r.request_id for r in requests}
    out = {"tokens": args.requests * args.max_tokens}
    # Results are read while the requests are still being sent: read after the sending,
    # the records made meanwhile (~1 s of them at 12,288 requests) were old when read
    # because this process was busy, and made the age's p99.
    reading = (asyncio.ensure_future(read_to_finals(results, wanted, "result", read_result))
               if between is None else None)
    ended_before = finished_requests(metrics_port) if between is not None else 0
    started, started_ns = time.perf_counter(), time.time_ns()
    try:
        for r in requests:
            await producer.send(settings.topic("requests"), encode(r), key=r.request_id.encode(),
                                headers=headers_for(r))
        await producer.flush()
        if between is not None:
            deadline = time.monotonic() + 600
            while finished_requests(metrics_port) < ended_before + len(requests):
                if time.monotonic() > deadline:
                    raise RuntimeError("the generate worker did not end every request in 600 s")
                # (once a second: a scrape takes the worker's GIL for its registry, and its time
                # is not what is measured: the stage ends at its last final's append, read from the log)
                await asyncio.sleep(1.0)
            if generated is not None:
                generated()  # (before this process reads the chunks: not the pipeline's work)
            out.update(await generate_stage(settings, wanted, started_ns))
            between()
            started = time.perf_counter()
            reading = asyncio.ensure_future(read_to_finals(results, wanted, "result", read_result))
        done, ages, out["results"], out["result_bytes"], per_s = await reading
        out["sustained"] = per_s * out["tokens"] / max(out["results"], 1)  # results/s as tokens/s
    finally:
        if reading is not None:
            reading.cancel()
        await producer.stop()
        await results.stop()
    out.update(elapsed=done - started, p50=ages[len(ages) // 2], p99=ages[int(len(ages) * 0.99)])
    return out


async def timed_topics(settings: KafkaSettings, reply: str | None = None) -> None:
    """A run's topics, 8 partitions each, the chunks topic with the broker's append time;
    `reply`, a reply topic like them."""
    from workers.broker.topics import create_topics

    await create_topics(settings, partitions=8)
    await log_append_time(settings, ("chunks",))
    if reply:
        from tests.kafka_helpers import create_topic

        await create_topic(settings, reply, partitions=8)


async def drop_topics(*every: KafkaSettings, also: tuple[str, ...] = ()) -> None:
    """Delete a run's topics: a broker holding every earlier run's (~100 partitions a run)
    grew slower, and runs late in a session paused more (a stage's latency p99 read 40-70 ms
    against 10-25 on a fresh broker, same code)."""
    from aiokafka.admin import AIOKafkaAdminClient

    from workers.kafka.settings import TOPIC_ROLES

    admin = AIOKafkaAdminClient(**every[0].client_kwargs())
    await admin.start()
    try:
        await admin.delete_topics([settings.topic(role) for settings in every for role in TOPIC_ROLES] + list(also))
    finally:
        await admin.close()


async def chunk_stats(settings: KafkaSettings) -> tuple[int, int]:
    from tests.kafka_helpers import read_to_end

    records = await read_to_end(settings, settings.topic("chunks"))
    return len(records), sum(len(r.value) for r in records)


async def while_running(procs: dict[str, subprocess.Popen], work, log_dir: Path):
    """`work` (a coroutine), given up with an error as soon as a worker process exits: the
    results a dead worker owed would be waited for forever."""
    task = asyncio.ensure_future(work)
    while True:
        await asyncio.wait([task], timeout=1.0)
        if task.done():
            return task.result()
        exited = {name: proc.returncode for name, proc in procs.items() if proc.poll() is not None}
        if exited:
            task.cancel()
            await asyncio.wait([task])  # its readers and producer closed
            raise RuntimeError(f"worker exited during the load (exit codes {exited}); logs in {log_dir}")


def measure(args, k: int, log_dir: Path, code: Path | None) -> dict:
    """One run of the workers (this checkout, or `code`) on a fresh topic prefix."""
    settings = KafkaSettings(bootstrap_servers=args.bootstrap_servers, topic_prefix=f"tp-{uuid.uuid4().hex[:6]}")
    asyncio.run(timed_topics(settings, reply_topic(settings, args)))  # (goal (a): each token's time to the chunk log)
    metrics_port = free_port()
    procs = start_workers(settings, args, log_dir, code, metrics_port)
    try:
        deadline = time.monotonic() + 120
        while not children(procs["generate"].pid):
            time.sleep(0.2)  # polling for the engine child to exist; readiness is the warm-up below
            if time.monotonic() > deadline:
                raise RuntimeError("the generate worker's engine child did not start")
        warm_up = argparse.Namespace(**{**vars(args), "requests": warm_up_requests(args)})
        asyncio.run(while_running(procs, run_load(settings, warm_up, k), log_dir))
        engine_pid = children(procs["generate"].pid)[0]
        pids = {"gen": procs["generate"].pid, "engine": engine_pid, "der": procs["derender"].pid}
        held_before = hold_buckets(metrics_port)  # (after the warm-up: this load's chunks only)
        # The brokers' CPU too, those that run here: with --each-alone, "broker" is the
        # generate stage's (requests in, chunks in) and "broker_der" the derender's (chunks
        # out, results in and out); without, "broker" is the whole run's.
        brokers = broker_pids(settings)

        def broker_cpu() -> float:
            return sum(cpu_seconds(pid) for pid in brokers)

        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        if brokers:
            before["broker"] = broker_cpu()
        after: dict[str, float] = {}  # --each-alone: generate's CPU, taken when its stage ends

        def generated():  # every request ended: the brokers' part of the generate stage
            if brokers:
                after["broker"] = before["broker_der"] = broker_cpu()

        def between():  # the generate stage is over: its CPU, then the derender's turn
            after.update((name, cpu_seconds(pids[name])) for name in ("gen", "engine"))
            before["der"] = cpu_seconds(pids["der"])
            os.kill(pids["der"], signal.SIGCONT)

        if args.each_alone:
            os.kill(pids["der"], signal.SIGSTOP)
        run = asyncio.run(while_running(procs, run_load(settings, args, k, between if args.each_alone else None,
                                                        metrics_port, generated), log_dir))
        after = {name: cpu_seconds(pid) for name, pid in pids.items()} | after
        if brokers:
            after["broker_der" if args.each_alone else "broker"] = broker_cpu()
        held_after = hold_buckets(metrics_port)
        ended = time.time()
        collector = {name: collector_seconds(pid, ended) for name, pid in pids.items()}
        chunks, chunk_bytes = asyncio.run(chunk_stats(settings))
    finally:
        for proc in procs.values():
            try:
                os.killpg(proc.pid, signal.SIGCONT)  # (a stopped process would not see the TERM)
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass  # it exited, and all its group with it
        for proc in procs.values():
            proc.wait(60)
    floor = None
    if args.each_alone:  # the workers are gone: the floor has the broker to itself
        floor_settings = KafkaSettings(bootstrap_servers=args.bootstrap_servers,
                                       topic_prefix=f"tpfloor-{uuid.uuid4().hex[:6]}")
        asyncio.run(timed_topics(floor_settings))
        per_s, size = run["chunks_read"] / run["gen_elapsed"], chunk_bytes // max(chunks, 1)
        seconds = min(15.0, max(3.0, run["gen_elapsed"]))  # (as long as the stage it is the floor of)
        latencies = asyncio.run(produce_floor(floor_settings, per_s, size, args.step_s, seconds))
        floor = (per_s, size, pct(latencies, 0.5), pct(latencies, 0.99))
        asyncio.run(drop_topics(floor_settings))
    asyncio.run(drop_topics(settings, also=tuple(filter(None, [reply_topic(settings, args)]))))
    tokens = run["tokens"]
    hold = ((bucket_quantile(0.5, held_before, held_after), bucket_quantile(0.99, held_before, held_after))
            if held_before is not None and held_after is not None else (None, None))
    return {**run, "per": {name: (after[name] - before[name]) / tokens * 1e6 for name in before},
            "rate": tokens / run["elapsed"], "chunks": chunks, "chunk_bytes": chunk_bytes, "hold": hold,
            "collector": collector, "floor": floor}


def print_row(code: str, k: int, args, row: dict, offered: float) -> None:
    """One row per load (two with --each-alone: the generate stage, then the derender's)."""
    per = row["per"]
    load = f"{code:<9} {args.kind:<10} {args.text:<9} {k:>3} {str(not args.no_stream):>6}"
    chunks = f"{row['chunks']:>8} {row['chunk_bytes'] / max(row['chunks'], 1):>8.0f}"
    results = f"{row['results']:>8} {row['result_bytes'] / max(row['results'], 1):>8.0f}"
    ages = f"{row['p50'] * 1000:>6.0f}ms {row['p99'] * 1000:>6.0f}ms"

    def rates(whole: float, steady: float, ratio: bool = True) -> str:
        return (f"{whole:>9,.0f} {(f'{whole / offered:.2f}' if ratio else ''):>6} {steady:>9,.0f} "
                f"{(f'{steady / offered:.2f}' if ratio else ''):>6}")

    if any(seconds is not None for seconds in row["collector"].values()):
        print(f"    {code}: the garbage collector's CPU (ops/bench/gc_probe), µs per token: " + ", ".join(
            f"{name} " + (f"{seconds / row['tokens'] * 1e6:.2f}" if seconds is not None else "n/a (never froze)")
            for name, seconds in row["collector"].items()))
    hold_p50, hold_p99 = row["hold"]
    if hold_p50 is not None:
        print(f"    {code}: a chunk's oldest token held in the generate worker (genpipe_chunk_hold_seconds) "
              f"p50 {hold_p50 * 1000:.1f} ms, p99 {hold_p99 * 1000:.1f} ms")
    if row.get("floor") is not None:
        (p50, p99), (per_s, size, floor_p50, floor_p99) = row["to_log"], row["floor"]
        bound = 3 * args.step_s + floor_p99
        print(f"    {code}: each token, sampled -> chunk log: p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms; "
              f"bare produce floor ({per_s:,.0f} records/s of {size} B): p50 {floor_p50 * 1000:.1f} ms, "
              f"p99 {floor_p99 * 1000:.1f} ms; goal (a), p99 <= 3 steps + floor p99 = {bound * 1000:.1f} ms: "
              f"{'met' if p99 <= bound else 'not met'}")
    def broker(name: str) -> str:
        return f"{per[name]:>13.1f}" if name in per else f"{'n/a':>13}"

    if args.each_alone:
        print(f"{load} {'generate':>9} {rates(row['tokens'] / row['gen_elapsed'], row['gen_sustained'])} "
              f"{per['gen']:>10.1f} {per['engine']:>13.1f} {'':>15} {broker('broker')} {chunks} {'':>17} "
              f"{row['chunk_p50'] * 1000:>6.0f}ms {row['chunk_p99'] * 1000:>6.0f}ms")
        print(f"{load} {'derender':>9} {rates(row['rate'], row['sustained'], ratio=False)} {'':>10} {'':>13} "
              f"{per['der']:>15.1f} {broker('broker_der')} {'':>17} {results} {ages}")
        return
    print(f"{load} {rates(row['rate'], row['sustained'])} {per['gen']:>10.1f} {per['engine']:>13.1f} "
          f"{per['der']:>15.1f} {broker('broker')} {chunks} {results} {ages}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap-servers", default=os.environ.get("GENPIPE_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    parser.add_argument("--engine", choices=("synthetic", "model"), default="synthetic",
                        help="the synthetic engine (default) or --model's (see above)")
    parser.add_argument("--step-ms", type=float, default=2.0, help="the synthetic engine's step (default 2)")
    parser.add_argument("--model", help="with --engine model: the model directory (with its tokenizer)")
    parser.add_argument("--device", default="cpu", help="with --engine model: cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="with --engine model (default float32)")
    parser.add_argument("--max-model-len", type=int, help="with --engine model (default: the model's)")
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, nargs="+", default=[0, 5], help="logprobs per position, one run each")
    parser.add_argument("--kind", nargs="+", choices=("completion", "chat"), default=["completion"],
                        help="result shape, one run each (default completion)")
    parser.add_argument("--text", nargs="+", choices=("synthetic", "ascii", "cjk"), default=["synthetic"],
                        help="what the output says, one run each (default synthetic; see above)")
    parser.add_argument("--no-stream", action="store_true")
    parser.add_argument("--stop", nargs="+", default=[], metavar="TEXT",
                        type=lambda text: codecs.decode(text, "unicode_escape"),
                        help="stop strings for every request (backslash escapes as in Python: '\\n'); see above")
    parser.add_argument("--reply-topic", action="store_true",
                        help="the requests name a reply topic of the run's own (as the HTTP gateway's do), read "
                             "instead of the results topic")
    parser.add_argument("--each-alone", action="store_true",
                        help="each stage at its own saturation: generate first, then the derender (see above)")
    parser.add_argument("--reference", metavar="REV", help="also run the workers of this git revision (see above)")
    parser.add_argument("--this-first", action="store_true",
                        help="with --reference: run this checkout's workers first (the reference runs first by "
                             "default; alternate the two across runs, as a box's speed drifts)")
    parser.add_argument("--generate-args", default="", metavar="ARGS",
                        help="more generate-worker options, for both codes, e.g. '--max-chunk-rate 0' (the chunk "
                             "policy's trade-offs: docs/design.md §4)")
    args = parser.parse_args()
    if args.engine == "model" and not args.model:
        parser.error("--engine model needs --model DIR (ops/bench/random_model.py writes one)")
    if args.engine == "model" and args.text != ["synthetic"]:
        parser.error("--text ascii/cjk need the synthetic engine (--engine model outputs what the model samples)")

    engine = (f"synthetic engine, step {args.step_ms:g} ms" if args.engine == "synthetic"
              else f"model {args.model} on {args.device} ({args.dtype})")
    print(f"{engine}, batch {args.max_batch}, {args.requests} requests x {args.max_tokens} tokens; "
          f"ratios are to the engine alone on each load's requests (printed before its rows)"
          + (f"; generate-worker {args.generate_args}" if args.generate_args else "")
          + (f"; stop {args.stop!r}" if args.stop else ""))
    stage = f" {'stage':>9}" if args.each_alone else ""
    print(f"{'code':<9} {'kind':<10} {'text':<9} {'k':>3} {'stream':>6}{stage} {'tok/s':>9} {'ratio':>6} "
          f"{'10-90%':>9} {'ratio':>6} {'gen us/tok':>10} {'engine us/tok':>13} {'derender us/tok':>15} "
          f"{'broker us/tok':>13} "
          f"{'chunks':>8} {'B/chunk':>8} {'results':>8} {'B/result':>8} {'age p50':>8} {'age p99':>8}")
    log_dir = Path(tempfile.mkdtemp(prefix="genpipe-throughput-"))
    reference = worktree(args.reference) if args.reference else None
    for text in args.text:
        prompts = None if text == "synthetic" else text_prompts(text, 64, args.max_tokens)
        for kind in args.kind:
            for k in args.k:
                load = argparse.Namespace(**{**vars(args), "kind": kind, "text": text, "prompts": prompts})
                try:
                    offered, load.step_s = engine_alone(load, k)
                except ValidationError as exc:  # a k over the engine's max_logprobs
                    print(f"{'':<9} {kind:<10} {text:<9} {k:>3} not measured: the engine refuses it ({exc})")
                    continue
                print(f"    engine alone: {offered:,.0f} tok/s, {load.step_s * 1000:.2f} ms per step")
                sides = [(f"{args.reference[:9]}", reference)] if reference is not None else []
                sides.insert(0 if args.this_first else len(sides), ("this", None))
                rows = {}
                try:
                    for code, checkout in sides:
                        rows[code] = measure(load, k, log_dir, checkout)
                        print_row(code, k, load, rows[code], offered)
                except LoadFailed as exc:  # e.g. a k over the workers' --max-logprobs
                    print(f"{'':<9} {kind:<10} {text:<9} {k:>3} not measured: {exc}")
                    continue
                if reference is not None:
                    row, before = rows["this"], rows[args.reference[:9]]
                    latency = (f"; each token's p99 reference / this {before['to_log'][1] / max(row['to_log'][1], 1e-9):.2f}x"
                               if "to_log" in row else "")
                    print("    CPU per token, reference / this: " + ", ".join(
                        f"{name} {before['per'][name] / max(row['per'][name], 1e-9):.2f}x"
                        for name in ("gen", "engine", "der")) + f"; tok/s this / reference {row['rate'] / before['rate']:.2f}x"
                        + latency)
    print(f"(worker logs: {log_dir}; chunk counts include the warm-up's requests)")


if __name__ == "__main__":
    main()
