"""The HTTP gateway against the Kafka client, side by side, and 1,000+ open streams (#12).

Real parts as processes: a broker (`genpipe broker up`, or `--bootstrap-servers`), a
generate worker with the synthetic engine (`--engine synthetic --step-ms S`), a derender
worker and `genpipe serve`. This process is the client of both paths.

  latency  The same streamed completions (prompt ids, temperature 0, EOS ignored), half
           over HTTP (the gateway, server-sent events) and half through `GenpipeClient`
           (Kafka, the results topic), at the same time, same load. Per token: its chunk's
           `sampled_at_ns` (read here from the chunk topic) -> its arrival here, SSE event
           or result record; p50/p99 both ways and the difference (the goal: the gateway
           adds p50 <= 1 ms, p99 <= 5 ms). Also, per HTTP token, paired: its result record
           read here from the gateway's reply topic -> its SSE event (what the gateway and
           the HTTP hop add to the same record). TTFT = request sent -> first token, both ways.
  streams  Ramp to `--streams` concurrent streamed requests (long max_tokens, slow step so
           they stay open; the generate worker's batch holds them all). All must be held
           open at once and complete with exactly max_tokens tokens (logprobs=0 lists each
           token: nothing lost or duplicated), one finish and one [DONE]. The gateway's RSS
           (before, at the peak, per stream), its CPU and open file descriptors.

The HTTP client is a bare asyncio one (ops/bench/sse.py), not httpx: its own CPU per event
is printed. The gateway is started with a soft RLIMIT_NOFILE of 1024 (a common default),
which `genpipe serve` raises to the hard limit itself; this process raises its own.

`--compare-gateway DIR` also starts the gateway of another source tree (`git archive` of an
older commit) beside this one and runs the streams part through each in turn: a
before/after of a gateway change in one run (CPU per token; RSS only in a first round).

    python ops/bench/gateway.py [--broker-port 29492 | --bootstrap-servers HOST:PORT] [--quick]
        [--streams 1000] [--stream-step-ms 500] [--stream-tokens 40] [--compare-gateway DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

from ops.bench.sse import sse_post  # noqa: E402
from workers.kafka.settings import KafkaSettings  # noqa: E402

LOG_DIR = Path(tempfile.mkdtemp(prefix="genpipe-gwbench-"))
GATEWAY_ID = "bench"
_decode = msgspec.json.decode


def raise_nofile() -> tuple[int, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return soft, hard


def pct(values, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}ms"


# --- processes ------------------------------------------------------------------------------

def spawn(name: str, args: list[str], nofile: tuple[int, int | None] | None = None,
          root: Path = ROOT) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(root)}  # the worktree's code, not an installed copy

    def limit() -> None:
        if nofile is not None:  # (soft, hard or None: keep the hard limit)
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1] if nofile[1] is None else nofile[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile[0], hard))
    log = open(LOG_DIR / f"{name}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "workers.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                            cwd=root, env=env, start_new_session=True, preexec_fn=limit)


def kafka_args(settings: KafkaSettings) -> list[str]:
    return ["--bootstrap-servers", settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix]


def start_generate(settings: KafkaSettings, step_ms: float, max_batch: int, name: str) -> subprocess.Popen:
    return spawn(name, ["generate-worker", "--engine", "synthetic", "--engine-in", "thread", "--step-ms",
                        str(step_ms), "--max-batch", str(max_batch), "--grace-period", "5", "--log-level", "INFO",
                        *kafka_args(settings)])


async def wait_for(what: str, condition, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{what}: the process exited ({proc.returncode}); logs in {LOG_DIR}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not happen within {timeout:.0f} s; logs in {LOG_DIR}")
        await asyncio.sleep(0.05)


def log_has(name: str, text: str) -> bool:
    return text.encode() in (LOG_DIR / f"{name}.log").read_bytes()


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        proc.wait(60)


def proc_stats(pid: int) -> tuple[int, float, int]:
    """(RSS bytes, CPU seconds user+system, open file descriptors) of a process."""
    rss = next(int(line.split()[1]) * 1024 for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:"))
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return rss, cpu, len(os.listdir(f"/proc/{pid}/fd"))


async def http_ok(port: int, path: str) -> bool:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.write(b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path.encode())
    line = await reader.readline()
    writer.close()
    return line.split()[1:2] == [b"200"]


# --- latency --------------------------------------------------------------------------------

class Tap:
    """Reads the chunk topic (each token's sampled time) and the gateway's reply topic
    (when each result record could have been read by a Kafka client) in this process."""

    def __init__(self, settings: KafkaSettings):
        self.settings = settings
        self.sampled: dict[str, dict[int, int]] = defaultdict(dict)  # rid -> seq -> sampled_at_ns
        self.replied: dict[tuple[str, int], int] = {}  # (rid, seq) -> arrival ns
        self.finished: set[str] = set()  # requests whose final chunk was read
        self.requested: dict[str, int] = {}  # rid -> when its request record was read here (ns)

    async def start(self) -> None:
        from schemas import GenerateChunk
        from workers.kafka.follow import follow
        from workers.kafka.records import decode_message

        def on_chunk(message) -> None:
            chunk = decode_message(message, GenerateChunk)
            self.sampled[chunk.request_id][chunk.seq] = chunk.sampled_at_ns
            if chunk.finish_reason is not None:
                self.finished.add(chunk.request_id)

        def on_reply(message) -> None:
            seq = dict(message.headers).get("genpipe-seq")
            if message.key is not None and seq is not None:
                self.replied.setdefault((message.key.decode(), int(seq)), time.time_ns())

        def on_request(message) -> None:
            self.requested.setdefault(message.key.decode(), time.time_ns())

        self.stop_event = asyncio.Event()
        ready = [asyncio.Event(), asyncio.Event(), asyncio.Event()]
        self.tasks = [asyncio.ensure_future(follow(self.settings, self.settings.topic("chunks"), on_chunk,
                                                   self.stop_event, ready=ready[0], poll_timeout_ms=5)),
                      asyncio.ensure_future(follow(self.settings, f"{self.settings.topic_prefix}.reply.{GATEWAY_ID}",
                                                   on_reply, self.stop_event, ready=ready[1], poll_timeout_ms=5)),
                      asyncio.ensure_future(follow(self.settings, self.settings.topic("requests"), on_request,
                                                   self.stop_event, ready=ready[2], poll_timeout_ms=5))]
        await asyncio.gather(*(r.wait() for r in ready))

    async def close(self) -> None:
        self.stop_event.set()
        await asyncio.gather(*self.tasks)


def prompt(i: int) -> list[int]:
    return [1, 5 + i % 50, 6, 7 + i % 13]


async def http_request(port: int, i: int, max_tokens: int) -> tuple[str, int, list[int]]:
    """One streamed completion over HTTP: (genpipe request id, sent ns, arrival ns per event)."""
    arrivals: list[int] = []
    ids: list[str] = []

    def on_event(event: bytes, now: int) -> None:
        if event.startswith(b"data: {"):
            if not ids:
                ids.append(_decode(event[6:])["id"].split("-", 1)[1])  # "cmpl-<request id>"
            arrivals.append(now)
    body = msgspec.json.encode({"prompt": prompt(i), "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True, "stream": True})
    sent = time.time_ns()
    await sse_post("127.0.0.1", port, "/v1/completions", body, on_event)
    return ids[0], sent, arrivals


async def kafka_request(client, i: int, max_tokens: int) -> tuple[str, int, list[tuple[int, int]]]:
    """The same through GenpipeClient: (request id, sent ns, (seq, arrival ns) per record)."""
    from workers.client import make_request

    request = make_request(prompt(i), max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True)
    got: list[tuple[int, int]] = []
    sent = time.time_ns()
    async for record in client.records(request):
        got.append((record.seq, time.time_ns()))
    return request.request_id, sent, got


async def latency_row(label: str, settings: KafkaSettings, client, tap: Tap, port: int, gw_pid: int,
                      concurrency: int, requests: int, max_tokens: int) -> None:
    http_runs, kafka_runs = [], []

    async def http_slot(slot: int) -> None:
        for i in range(slot, requests, concurrency):
            http_runs.append(await http_request(port, i, max_tokens))

    async def kafka_slot(slot: int) -> None:
        for i in range(slot, requests, concurrency):
            kafka_runs.append(await kafka_request(client, i, max_tokens))

    _, cpu0, _ = proc_stats(gw_pid)
    started = time.monotonic()
    await asyncio.gather(*(http_slot(s) for s in range(concurrency)), *(kafka_slot(s) for s in range(concurrency)))
    wall = time.monotonic() - started
    _, cpu1, _ = proc_stats(gw_pid)
    rids = [r for r, _, _ in http_runs + kafka_runs]
    await wait_for("every chunk read by the tap", lambda: tap.finished.issuperset(rids), 30)
    http_tok, kafka_tok, paired, http_ttft, kafka_ttft, unmatched = [], [], [], [], [], 0
    intake = {side: [(tap.requested[r] - sent) / 1e9 for r, sent, _ in runs if r in tap.requested]
              for side, runs in (("http", http_runs), ("kafka", kafka_runs))}
    for rid, sent, arrivals in http_runs:
        seqs = sorted(tap.sampled[rid])
        if len(seqs) != len(arrivals):  # one SSE event per result record per chunk, unless restarted
            unmatched += 1
            continue
        http_ttft.append((arrivals[0] - sent) / 1e9)
        for seq, now in zip(seqs, arrivals):
            http_tok.append((now - tap.sampled[rid][seq]) / 1e9)
            if (rid, seq) in tap.replied:
                paired.append((now - tap.replied[(rid, seq)]) / 1e9)
    for rid, sent, got in kafka_runs:
        kafka_ttft.append((got[0][1] - sent) / 1e9)
        kafka_tok.extend((now - tap.sampled[rid][seq]) / 1e9 for seq, now in got)
    hp50, hp99, kp50, kp99 = pct(http_tok, .5), pct(http_tok, .99), pct(kafka_tok, .5), pct(kafka_tok, .99)
    print(f"{label:<24} {len(http_tok):>6} {len(kafka_tok):>6} {ms(kp50):>9} {ms(hp50):>9} {ms(hp50 - kp50):>9} "
          f"{ms(kp99):>9} {ms(hp99):>9} {ms(hp99 - kp99):>9} {ms(pct(paired, .5)):>9} {ms(pct(paired, .99)):>9} "
          f"{ms(pct(kafka_ttft, .5)):>9} {ms(pct(http_ttft, .5)):>9} {ms(pct(intake['kafka'], .5)):>9} "
          f"{ms(pct(intake['http'], .5)):>9} {(cpu1 - cpu0) / wall:>6.0%}"
          + (f"  ({unmatched} HTTP requests unmatched)" if unmatched else ""), flush=True)
    return hp50 - kp50, hp99 - kp99, pct(paired, .5), pct(paired, .99)


async def part_latency(args, settings: KafkaSettings, port: int, gw_pid: int) -> None:
    from workers.client import GenpipeClient

    tap = Tap(settings)
    await tap.start()
    verdicts = []
    async with GenpipeClient(settings=settings, timeout_s=60) as client:
        await latency_row("warm-up", settings, client, tap, port, gw_pid, 2, 8, 8)
        print(f"\n== latency: synthetic engine, step {args.step_ms:g} ms, {args.max_tokens} tokens per request; "
              f"HTTP and Kafka requests at the same time ==")
        print(f"{'load (per side)':<24} {'http n':>6} {'kafka n':>6} {'kafka p50':>9} {'http p50':>9} "
              f"{'added p50':>9} {'kafka p99':>9} {'http p99':>9} {'added p99':>9} {'pair p50':>9} "
              f"{'pair p99':>9} {'kTTFT p50':>9} {'hTTFT p50':>9} {'kIn p50':>9} {'hIn p50':>9} {'gw CPU':>6}")
        for label, concurrency, requests in ((f"low (1 at a time)", 1, args.requests_low),
                                             (f"moderate ({args.concurrency} at once)", args.concurrency,
                                              args.requests_moderate)):
            added = await latency_row(label, settings, client, tap, port, gw_pid, concurrency, requests,
                                      args.max_tokens)
            verdicts.append(f"{label}: " + ", ".join(
                f"{how} p50 {ms(p50)} ({'met' if p50 <= 1e-3 else 'NOT met'}) p99 {ms(p99)} "
                f"({'met' if p99 <= 5e-3 else 'NOT met'})" for how, p50, p99 in (("added", *added[:2]),
                                                                                 ("paired", *added[2:]))))
    await tap.close()
    print("goal (the gateway adds p50 <= 1 ms, p99 <= 5 ms): " + "; ".join(verdicts))
    print("added = http − kafka (sampled → arrival here); pair = the same result record read here from the "
          "gateway's reply topic → its SSE event here; In = request sent → its record read here from the "
          "requests topic; gw CPU = the gateway process, share of one core")


# --- many open streams ----------------------------------------------------------------------

class Stream:
    __slots__ = ("opened", "first", "closed", "tokens", "finishes", "done", "usage", "error")

    def __init__(self):
        self.opened = self.first = self.closed = None
        self.tokens, self.finishes, self.done, self.usage, self.error = 0, 0, 0, None, None

    def on_event(self, event: bytes, now: int) -> None:
        if event == b"data: [DONE]":
            self.done += 1
            return
        if not event.startswith(b"data: "):
            return  # a keep-alive comment
        item = _decode(event[6:])
        if "error" in item:
            self.error = item["error"]
            return
        if item.get("usage"):
            self.usage = item["usage"]["completion_tokens"]
        for choice in item["choices"]:
            self.first = self.first or now
            self.tokens += len(choice["logprobs"]["tokens"])
            self.finishes += choice["finish_reason"] is not None


async def part_streams(args, port: int, gw_pid: int) -> float:
    n, tokens = args.streams, args.stream_tokens
    streams = [Stream() for _ in range(n)]
    body = msgspec.json.encode({"prompt": [1, 5, 6, 7], "max_tokens": tokens, "temperature": 0, "logprobs": 0,
                                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    samples = []  # (time, rss, cpu, fds, open streams)

    def open_now() -> int:
        return sum(1 for s in streams if s.opened is not None and s.closed is None)

    async def sample() -> None:
        while True:
            samples.append((time.monotonic(), *proc_stats(gw_pid), open_now()))
            await asyncio.sleep(0.25)

    async def one(s: Stream) -> None:
        try:
            await sse_post("127.0.0.1", port, "/v1/completions", body, s.on_event,
                           on_headers=lambda now: setattr(s, "opened", now))
        except Exception as exc:
            s.error = repr(exc)
        except asyncio.CancelledError:
            s.error = "not finished in time"
        s.closed = time.time_ns()

    rss0, cpu0, fds0 = proc_stats(gw_pid)
    me0 = resource.getrusage(resource.RUSAGE_SELF)
    sampler = asyncio.ensure_future(sample())
    started = time.monotonic()
    tasks = []
    for i in range(n):  # the ramp: --ramp streams/s
        tasks.append(asyncio.ensure_future(one(streams[i])))
        delay = started + (i + 1) / args.ramp - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
    _, pending = await asyncio.wait(tasks, timeout=args.stream_tokens * args.stream_step_ms / 1000 + 60)
    for task in pending:  # e.g. a connection the gateway never accepted (out of file descriptors)
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.monotonic() - started
    sampler.cancel()
    rss1, cpu1, fds1 = proc_stats(gw_pid)
    me1 = resource.getrusage(resource.RUSAGE_SELF)
    # the most streams open at once: a sweep over (open, close) of every stream
    edges = sorted([(s.opened, 1) for s in streams if s.opened] + [(s.closed, -1) for s in streams if s.opened])
    peak = running = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    at_peak = max(samples, key=lambda x: (x[4], x[1]))
    peak_rss = max(x[1] for x in samples)
    held = [x for x in samples if x[4] >= 0.95 * n]
    held_cpu = (held[-1][2] - held[0][2]) / (held[-1][0] - held[0][0]) if len(held) > 1 else float("nan")
    complete = sum(1 for s in streams if s.error is None and s.done == 1 and s.finishes == 1 and s.tokens == tokens
                   and s.usage == tokens)
    lost = sum(1 for s in streams if s.tokens < tokens or s.done == 0)
    dup = sum(1 for s in streams if s.tokens > tokens or s.done > 1 or s.finishes > 1)
    errors = [s.error for s in streams if s.error is not None]
    events = sum(s.tokens for s in streams)  # one token per event unless the worker coalesced
    me_cpu = (me1.ru_utime + me1.ru_stime) - (me0.ru_utime + me0.ru_stime)
    print(f"\n== streams: {n} streamed completions of {tokens} tokens (logprobs 0), ramp {args.ramp:g}/s, "
          f"synthetic step {args.stream_step_ms:g} ms, batch {n} ==")
    print(f"held open at once: {peak} of {n} (sampled peak {at_peak[4]}); complete {complete}, lost {lost}, "
          f"duplicated {dup}, errors {len(errors)}" + (f" (first: {errors[0]})" if errors else ""))
    print(f"gateway RSS: before {rss0 / 2**20:.1f} MiB, peak {peak_rss / 2**20:.1f} MiB (at {at_peak[4]} open: "
          f"{at_peak[1] / 2**20:.1f} MiB), after {rss1 / 2**20:.1f} MiB; per stream "
          f"{(at_peak[1] - rss0) / max(1, at_peak[4]) / 1024:.1f} KiB")
    print(f"gateway CPU: {(cpu1 - cpu0) / wall:.0%} of a core over the part ({wall:.1f} s), {held_cpu:.0%} while "
          f"≥95% held; {(cpu1 - cpu0) / max(1, events) * 1e6:.0f} µs per token; open fds {fds0} → peak "
          f"{max(x[3] for x in samples)} → {fds1}")
    print(f"this process (client, bare asyncio): {me_cpu:.1f} CPU s, {me_cpu / max(1, events) * 1e6:.0f} µs per "
          f"token received; time to first token p50 {pct([(s.first - s.opened) / 1e9 for s in streams if s.first], .5) * 1e3:.0f} ms")
    if complete != n:
        raise SystemExit(f"{n - complete} streams did not complete exactly (logs in {LOG_DIR})")
    return (cpu1 - cpu0) / max(1, events)


# --- main -----------------------------------------------------------------------------------

async def run(args, settings: KafkaSettings) -> None:
    from workers.broker.topics import create_topics

    await create_topics(settings, partitions=4)
    port = args.port
    generate = start_generate(settings, args.step_ms, 64, "generate-latency")
    derender = spawn("derender", ["derender-worker", "--log-level", "INFO", *kafka_args(settings)])
    serve = ["serve", "--log-level", "warning", "--max-in-flight", str(args.streams + 64), *kafka_args(settings)]
    gateway = spawn("gateway", [*serve, "--port", str(port), "--gateway-id", GATEWAY_ID], nofile=args.gateway_nofile)
    gateways = [("this tree", port, gateway)]
    if args.compare_gateway:  # the same gateway from another source tree (e.g. `git archive` of an older commit)
        gateways.append(("--compare-gateway", port + 1, spawn(
            "gateway-compare", [*serve, "--port", str(port + 1), "--gateway-id", f"{GATEWAY_ID}-compare"],
            nofile=args.gateway_nofile, root=Path(args.compare_gateway).resolve())))
    procs = [generate, derender, *(g for _, _, g in gateways)]
    try:
        await wait_for("generate worker ready", lambda: log_has("generate-latency", "worker ready"), 120, generate)
        await wait_for("derender worker ready", lambda: log_has("derender", "worker ready"), 120, derender)
        for _, gw_port, gw in gateways:
            deadline = time.monotonic() + 120
            while not await http_ok(gw_port, "/health"):
                if gw.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the gateway did not become healthy; logs in {LOG_DIR}")
                await asyncio.sleep(0.1)
            limits = open(f"/proc/{gw.pid}/limits").read()
            nofile = next(line for line in limits.splitlines() if line.startswith("Max open files")).split()[3:5]
            print(f"gateway pid {gw.pid} (port {gw_port}): started with RLIMIT_NOFILE soft/hard "
                  f"{args.gateway_nofile[0]}/{args.gateway_nofile[1] or 'unchanged'}, now {nofile[0]}/{nofile[1]}")
        if "latency" in args.parts:
            await part_latency(args, settings, port, gateway.pid)
        if "streams" in args.parts:
            stop([generate])  # a worker whose batch holds every stream, paced slowly
            generate = start_generate(settings, args.stream_step_ms, args.streams, "generate-streams")
            procs.append(generate)
            await wait_for("generate worker ready", lambda: log_has("generate-streams", "worker ready"), 120, generate)
            costs = {}
            for label, gw_port, gw in gateways * args.rounds:
                print(f"\n-- gateway: {label} --", end="")
                costs.setdefault(label, []).append(await part_streams(args, gw_port, gw.pid))
            if args.compare_gateway:
                mine, other = costs["this tree"], costs["--compare-gateway"]
                print(f"\ngateway CPU per token, --compare-gateway / this tree, per round: "
                      + ", ".join(f"{b * 1e6:.0f} / {a * 1e6:.0f} µs = {b / a:.2f}x" for a, b in zip(mine, other)))
    finally:
        stop(procs)
        print(f"(logs: {LOG_DIR})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap-servers", help="an existing broker (default: start one on --broker-port)")
    parser.add_argument("--broker-port", type=int, default=29492, help="controller on the next port")
    parser.add_argument("--port", type=int, default=18471, help="the gateway's HTTP port")
    parser.add_argument("--parts", nargs="+", default=["latency", "streams"], choices=["latency", "streams"])
    parser.add_argument("--gateway-nofile", type=lambda t: tuple(int(x) for x in t.split(",")) + (None,) * (
        "," not in t), default=(1024, None), metavar="SOFT[,HARD]",
                        help="the gateway's RLIMIT_NOFILE at start (default: soft 1024, a common default; "
                             "`genpipe serve` raises it to the hard limit; a hard limit of 1024 shows what "
                             "happens when it cannot)")
    parser.add_argument("--compare-gateway", metavar="DIR",
                        help="also run the streams part through a gateway from this source tree, in turn")
    parser.add_argument("--rounds", type=int, default=1, help="streams part: rounds (per gateway)")
    parser.add_argument("--quick", action="store_true", help="small counts: a smoke run in about a minute")
    parser.add_argument("--step-ms", type=float, default=20.0, help="synthetic step, latency part")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request, latency part")
    parser.add_argument("--requests-low", type=int, default=48, help="requests per side, one at a time")
    parser.add_argument("--requests-moderate", type=int, default=192, help="requests per side, --concurrency at once")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--stream-tokens", type=int, default=40)
    parser.add_argument("--stream-step-ms", type=float, default=500.0)
    parser.add_argument("--ramp", type=float, default=200.0, help="new streams per second")
    args = parser.parse_args()
    if args.quick:
        args.requests_low, args.requests_moderate, args.max_tokens = 8, 32, 16
        args.streams, args.stream_tokens, args.stream_step_ms = 200, 10, 200.0
    soft, hard = raise_nofile()
    print(f"this process: RLIMIT_NOFILE soft {soft} -> {hard}")
    broker = None
    if args.bootstrap_servers is None:
        broker = ["broker", "--port", str(args.broker_port), "--data-dir", str(Path(tempfile.gettempdir())
                                                                              / f"gwbench-broker-{args.broker_port}")]
        subprocess.run([sys.executable, "-m", "workers.cli", broker[0], "up", *broker[1:], "--controller-port",
                        str(args.broker_port + 1)], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        args.bootstrap_servers = f"127.0.0.1:{args.broker_port}"
    settings = KafkaSettings(bootstrap_servers=args.bootstrap_servers, topic_prefix=f"gw-{uuid.uuid4().hex[:6]}")
    try:
        asyncio.run(run(args, settings))
    finally:
        if broker is not None:
            subprocess.run([sys.executable, "-m", "workers.cli", broker[0], "down", *broker[1:]], cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})


if __name__ == "__main__":
    main()
