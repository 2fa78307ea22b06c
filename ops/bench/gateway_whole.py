"""What a non-streamed answer costs when the gateway asks for it streamed (#11).

A non-streamed choice whose logprobs may not fit one result record is asked for streamed
and assembled by the gateway (`answer_may_outgrow`, workers/results.py). The rule
guesses high, so some answers that would have fit one record come as a record per chunk:
this measures what that costs, the same requests answered both ways in one run.

Real parts as processes: a broker (`genpipe broker up`, or `--bootstrap-servers`), a
generate worker on the synthetic engine, a derender worker, and two gateways on the same
workers: "one record" (the default --max-record-bytes: the answers fit, nothing is
switched) and "streamed inside" (--max-record-bytes low enough that every request of the
workload is switched; the derender's own limit stays the default, so both sides get the
same answers). Phases alternate between the two, `--rounds` each, so that the shared
derender's CPU is counted per side: per request, the gateway's and the derender's CPU
(/proc), its latency (sent -> whole answer read), and the answer's size.

    python ops/bench/gateway_whole.py [--broker-port 29472 | --bootstrap-servers HOST:PORT]
        [--requests 64] [--concurrency 8] [--max-tokens 128] [--logprobs 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ops.bench.gateway_procs import (LOG_DIR, add_broker_arguments, bench_broker, http_ok,  # noqa: E402
                                     kafka_args, log_has, pct, proc_stats, spawn, start_generate, stop,
                                     wait_for)
from workers.kafka.settings import KafkaSettings  # noqa: E402

SIDES = ("one record", "streamed inside")


async def post(port: int, body: bytes) -> tuple[int, bytes]:
    """POST /v1/completions; (status, body) once the whole answer is read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        response = await reader.read()
    finally:
        writer.close()
    head, _, payload = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), payload


async def phase(args, port: int, gateway_pid: int, derender_pid: int) -> dict:
    bodies = [json.dumps({"model": "genpipe-tiny", "prompt": [5 + i % 50, 6, 7], "max_tokens": args.max_tokens,
                          "ignore_eos": True, "logprobs": args.logprobs}).encode() for i in range(args.requests)]
    latencies, sizes = [], []
    slots = asyncio.Semaphore(args.concurrency)

    async def one(body: bytes) -> None:
        async with slots:
            started = time.perf_counter()
            status, payload = await post(port, body)
            latencies.append(time.perf_counter() - started)
            answer = json.loads(payload)
            if status != 200 or len(answer["choices"][0]["logprobs"]["tokens"]) != args.max_tokens:
                raise SystemExit(f"a bad answer ({status}): {payload[:300]!r}")
            sizes.append(len(payload))

    gateway_cpu, derender_cpu = proc_stats(gateway_pid)[1], proc_stats(derender_pid)[1]
    await asyncio.gather(*(one(b) for b in bodies))
    return {"gateway_ms": (proc_stats(gateway_pid)[1] - gateway_cpu) / args.requests * 1e3,
            "derender_ms": (proc_stats(derender_pid)[1] - derender_cpu) / args.requests * 1e3,
            "p50_ms": pct(latencies, 0.5) * 1e3, "p99_ms": pct(latencies, 0.99) * 1e3,
            "bytes": sum(sizes) / len(sizes)}


async def run(args, settings: KafkaSettings) -> None:
    from workers.broker.topics import create_topics

    from workers.client import make_request
    from workers.results import answer_may_outgrow
    from workers.kafka.settings import MAX_RECORD_BYTES

    workload = make_request([5, 6, 7], max_tokens=args.max_tokens, logprobs=args.logprobs)
    if answer_may_outgrow(workload, MAX_RECORD_BYTES) or not answer_may_outgrow(workload, args.switch_below):
        raise SystemExit(f"the workload must be switched by one gateway only: raise --max-tokens or --logprobs, "
                         f"or lower --switch-below ({args.switch_below})")
    await create_topics(settings, partitions=2)
    generate = start_generate(settings, args.step_ms, 64, "generate-whole")
    derender = spawn("derender", ["derender-worker", "--log-level", "INFO", *kafka_args(settings)])
    gateways = {}
    for i, (side, limit) in enumerate(zip(SIDES, (None, args.switch_below))):
        extra = [] if limit is None else ["--max-record-bytes", str(limit)]
        gateways[side] = (args.port + i, spawn(f"gateway-{i}", [
            "serve", "--log-level", "warning", "--port", str(args.port + i), "--gateway-id", f"whole{i}",
            *extra, *kafka_args(settings)]))
    procs = [generate, derender, *(g for _, g in gateways.values())]
    try:
        await wait_for("generate worker ready", lambda: log_has("generate-whole", "worker ready"), 120, generate)
        await wait_for("derender worker ready", lambda: log_has("derender", "worker ready"), 120, derender)
        for port, gateway in gateways.values():
            deadline = time.monotonic() + 120
            while not await http_ok(port, "/health"):
                if gateway.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"a gateway did not become healthy; logs in {LOG_DIR}")
                await asyncio.sleep(0.1)
        side_rows = {side: [] for side in SIDES}
        for side in SIDES:  # a warm-up phase each, not counted
            await phase(args, gateways[side][0], gateways[side][1].pid, derender.pid)
        for r in range(args.rounds):
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                row = await phase(args, gateways[side][0], gateways[side][1].pid, derender.pid)
                side_rows[side].append(row)
                print(f"round {r + 1} {side:>15}: gateway {row['gateway_ms']:.2f} ms CPU/request, derender "
                      f"{row['derender_ms']:.2f}, latency p50 {row['p50_ms']:.1f} ms p99 {row['p99_ms']:.1f}, "
                      f"answer {row['bytes'] / 1e3:.1f} kB", flush=True)
        print(f"\n{args.requests} requests a phase, {args.concurrency} at once, {args.max_tokens} tokens, "
              f"logprobs {args.logprobs}; best of {args.rounds} (streamed inside / one record):")
        for key, what in (("gateway_ms", "gateway CPU per request"), ("derender_ms", "derender CPU per request"),
                          ("p50_ms", "latency p50")):
            one, inside = (min(row[key] for row in side_rows[side]) for side in SIDES)
            print(f"  {what}: {one:.2f} -> {inside:.2f} ms = {inside / one:.2f}x")
    finally:
        stop(procs)
        print(f"(logs: {LOG_DIR})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_broker_arguments(parser, 29472)
    parser.add_argument("--port", type=int, default=18491, help="the gateways' HTTP ports: this and the next")
    parser.add_argument("--requests", type=int, default=64, help="non-streamed requests a phase")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--logprobs", type=int, default=5, help="a completion's logprobs (top k)")
    parser.add_argument("--step-ms", type=float, default=5.0, help="the synthetic engine's step")
    parser.add_argument("--switch-below", type=int, default=20_000,
                        help="the streamed-inside gateway's --max-record-bytes (low enough to switch every request)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with bench_broker(args.bootstrap_servers, args.broker_port, "gwwhole-broker") as bootstrap_servers:
        settings = KafkaSettings(bootstrap_servers=bootstrap_servers, topic_prefix=f"gw-{uuid.uuid4().hex[:6]}")
        asyncio.run(run(args, settings))


if __name__ == "__main__":
    main()
