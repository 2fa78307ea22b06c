"""Soak: steady mixed load for many minutes; does any worker's memory or state grow?

Contender: a generate worker (its engine child included) and a derender worker, as
processes, under a steady mix of requests from the client library: chat and completion,
streamed or not, logprobs, stop strings, a share cancelled mid-stream, a share invalid
(error results).
Reference, in the same run: each process's own RSS at the end of the warm-up; the ratio
printed is RSS at the end / RSS after warm-up (goal: < 1.05), and the derender's open
request state (`genpipe_in_flight_requests`, from its metrics endpoint) must be back
to 0 once the load stops.

It also measures, in fresh processes, where a generate worker's memory goes for the
1.3M-parameter tiny model: the interpreter, `import torch`, `import transformers`, the
loaded model.

    python ops/bench/soak.py [--bootstrap-servers 127.0.0.1:9092] [--minutes 10] \
        [--rate 5] [--warmup-s 60]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from workers.kafka.settings import KafkaSettings  # noqa: E402

WORDS = "the cat sat on a warm mat while rain fell over the quiet town and 中文 café 🙂".split()


def rss_kib(pid: int, tree: bool = True) -> int:
    """Resident set of a process and (`tree`) all its descendants (the engine child), KiB."""
    total = 0
    for p in [pid, *(descendants(pid) if tree else [])]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*") if Path(f"/proc/{p}/task").exists() else []:
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                kids = []
            out.extend(kids)
            todo.extend(kids)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(port: int, name: str, worker: str) -> float | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(f'{name}{{worker="{worker}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return None


def start_worker(kind: str, args: list[str], settings: KafkaSettings, log_dir: Path, metrics_port: int):
    log = open(log_dir / f"{kind}.log", "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "workers.cli", f"{kind}-worker", *args, "--bootstrap-servers",
         settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix, "--metrics-port", str(metrics_port),
         "--log-level", "WARNING"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


async def load(settings: KafkaSettings, model_dir: str, rate: float, seconds: float, stats: dict, seed: int) -> None:
    """`rate` requests/s for `seconds`, each one awaited to its end (bounded concurrency)."""
    from workers.client import GenpipeClient, GenpipeError, make_request, render_chat, render_prompt

    rng = random.Random(seed)
    prompts = [render_prompt(model_dir, " ".join(rng.choices(WORDS, k=rng.randrange(2, 12)))) for _ in range(40)]
    chats = [render_chat(model_dir, [{"role": "user", "content": " ".join(rng.choices(WORDS, k=6))}]) for _ in range(20)]

    async def one(i: int, client) -> None:
        roll = rng.random()
        chat = roll < 0.5
        kwargs = dict(kind="chat" if chat else "completion", max_tokens=rng.randrange(4, 40),
                      temperature=rng.choice([0.0, 0.8]), seed=i, stream=rng.random() < 0.6,
                      ignore_eos=rng.random() < 0.5)
        if rng.random() < 0.3:
            kwargs.update(logprobs=True, top_logprobs=rng.randrange(0, 5)) if chat else kwargs.update(logprobs=rng.randrange(0, 5))
        if rng.random() < 0.2:
            kwargs["stop"] = [rng.choice(WORDS)]
        ids = rng.choice(chats if chat else prompts)
        request = make_request(ids, **kwargs)
        kind = "ok"
        if rng.random() < 0.05:
            request.sampling.max_tokens, kind = 0, "invalid"  # must be >= 1: an error result
        try:
            if kind == "ok" and request.output.stream and rng.random() < 0.1:
                kind = "cancelled"
                async for _ in client.stream(request):
                    await client.cancel(request.request_id)
                    break
            else:
                await client.complete(request)
        except GenpipeError:
            stats["errors"] = stats.get("errors", 0) + 1
        stats[kind] = stats.get(kind, 0) + 1

    async with GenpipeClient(settings=settings, timeout_s=120) as client:
        tasks: set[asyncio.Task] = set()
        started = time.monotonic()
        i = 0
        while time.monotonic() - started < seconds:
            task = asyncio.ensure_future(one(i, client))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
            await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
        await asyncio.gather(*tasks, return_exceptions=True)
    stats["sent"] = i


def where_memory_goes(model_dir: str) -> list[tuple[str, int]]:
    """RSS (KiB) of fresh interpreters at each step of a generate worker's start."""
    steps = [("python", "pass"),
             ("+ import torch", "import torch"),
             ("+ import transformers", "import torch, transformers"),
             ("+ the tiny model loaded (Engine)", f"from workers.generate.engine import Engine; Engine({model_dir!r})")]
    out = []
    for label, code in steps:
        probe = (f"{code}\nfor l in open('/proc/self/status'):\n    "
                 f"l.startswith('VmRSS:') and print(l.split()[1])")
        res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[2])
        out.append((label, int(res.stdout.split()[-1]) if res.stdout.split() else -1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap-servers", default=os.environ.get("GENPIPE_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    parser.add_argument("--minutes", type=float, default=10.0, help="load after the warm-up (default %(default)s)")
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=5.0, help="requests per second (default %(default)s)")
    parser.add_argument("--sample-s", type=float, default=30.0, help="RSS sample interval")
    args = parser.parse_args()

    from workers.broker.topics import create_topics
    from workers.models.tinymodel import default_model_dir

    model_dir = str(default_model_dir("spm"))
    settings = KafkaSettings(bootstrap_servers=args.bootstrap_servers, topic_prefix=f"soak-{uuid.uuid4().hex[:6]}")
    asyncio.run(create_topics(settings, partitions=4))
    log_dir = Path(tempfile.mkdtemp(prefix="genpipe-soak-"))
    ports = {"generate": free_port(), "derender": free_port()}
    procs = {"generate": start_worker("generate", ["--model", model_dir], settings, log_dir, ports["generate"]),
             "derender": start_worker("derender", ["--tokenizer", model_dir], settings, log_dir, ports["derender"])}
    stats: dict = {}
    samples: list[tuple[float, dict[str, int], float | None]] = []
    try:
        async def run() -> None:
            total = args.warmup_s + args.minutes * 60
            runner = asyncio.ensure_future(load(settings, model_dir, args.rate, total, stats, seed=7))
            started = time.monotonic()
            while not runner.done():
                await asyncio.wait([runner], timeout=args.sample_s)
                t = time.monotonic() - started
                if t >= args.warmup_s or runner.done():
                    samples.append((t, {k: rss_kib(p.pid) for k, p in procs.items()},
                                    metric(ports["derender"], "genpipe_in_flight_requests", "derender")))
                    print(f"{t:7.0f} s  generate {samples[-1][1]['generate'] / 1024:7.1f} MiB  derender "
                          f"{samples[-1][1]['derender'] / 1024:6.1f} MiB  derender open requests {samples[-1][2]}",
                          flush=True)
            await runner

        asyncio.run(run())
        # Idle: the derender's open-request state must drain to zero.
        deadline = time.monotonic() + 60
        idle = metric(ports["derender"], "genpipe_in_flight_requests", "derender")
        while idle and time.monotonic() < deadline:
            time.sleep(0.5)  # polling a gauge: the condition is checked, not assumed
            idle = metric(ports["derender"], "genpipe_in_flight_requests", "derender")
        final = {k: rss_kib(p.pid) for k, p in procs.items()}
        alone = rss_kib(procs["generate"].pid, tree=False)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            p.wait(60)

    print(f"\nload: {stats}  ({args.rate:g} req/s for {args.minutes:g} min after a {args.warmup_s:g} s warm-up)")
    first = samples[0][1]
    print(f"{'process':<10} {'after warm-up':>14} {'end of load':>12} {'idle':>10} {'end/warm-up':>12}")
    for k in procs:
        end = samples[-1][1][k]
        print(f"{k:<10} {first[k] / 1024:>11.1f} MiB {end / 1024:>8.1f} MiB {final[k] / 1024:>6.1f} MiB "
              f"{end / first[k]:>12.3f}")
    print(f"derender open requests once idle: {idle} (goal 0)")
    print(f"generate worker process alone {alone / 1024:.1f} MiB, its engine child "
          f"{(final['generate'] - alone) / 1024:.1f} MiB")
    print("\nwhere a generate worker's memory goes (fresh processes, RSS):")
    for label, kib in where_memory_goes(model_dir):
        print(f"  {label:<36} {kib / 1024:8.1f} MiB")
    print(f"(worker logs: {log_dir})")


if __name__ == "__main__":
    main()
