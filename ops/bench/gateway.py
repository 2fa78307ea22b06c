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
           Relay: the gateway's own `genpipe_gateway_relay_seconds` histogram (a result
           record read by its client -> its SSE event handed to the HTTP server), scraped
           from /metrics before and after each load: what the gateway adds, measured inside
           it, free of this process's own scheduling.
  streams  Ramp to `--streams` concurrent streamed requests (long max_tokens, slow step so
           they stay open; the generate worker's batch holds them all). All must be held
           open at once and complete with exactly max_tokens tokens (logprobs=0 lists each
           token: nothing lost or duplicated), one finish and one [DONE]. The gateway's RSS
           (before, at the peak, per stream), its CPU and open file descriptors.

The HTTP client is a bare asyncio one (ops/bench/sse.py), not httpx: its own CPU per event
is printed. The gateway is started with a soft RLIMIT_NOFILE of 1024 (a common default),
which `genpipe serve` raises to the hard limit itself; this process raises its own.

`--compare-gateway DIR` also starts the gateway of another source tree (`git archive` of an
older commit) beside this one: a before/after of a gateway change in one run. The latency
part then sends a third side of requests through it at the same time (its own rows):
compare the two HTTP rows with each other; at 16 at once per side this process saturates
(on 2 cores) and its own Kafka side looks slower than HTTP, so use a run without
`--compare-gateway` for the goal. The streams part runs through each gateway in turn (CPU
per token; RSS only in a first round).

    python ops/bench/gateway.py [--broker-port 29492 | --bootstrap-servers HOST:PORT] [--quick]
        [--streams 1000] [--stream-step-ms 500] [--stream-tokens 40] [--compare-gateway DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ops.bench.gateway_latency import part_latency  # noqa: E402
from ops.bench.gateway_procs import (GATEWAY_ID, LOG_DIR, add_broker_arguments, bench_broker,  # noqa: E402
                                     http_ok, kafka_args, log_has, raise_nofile, spawn, start_generate, stop,
                                     wait_for)
from ops.bench.gateway_streams import part_streams  # noqa: E402
from workers.kafka.settings import KafkaSettings  # noqa: E402


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
            await part_latency(args, settings, [(name, p, gw.pid) for name, p, gw in gateways])
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
                print("\ngateway CPU per token, --compare-gateway / this tree, per round: "
                      + ", ".join(f"{b * 1e6:.0f} / {a * 1e6:.0f} µs = {b / a:.2f}x" for a, b in zip(mine, other)))
    finally:
        stop(procs)
        print(f"(logs: {LOG_DIR})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_broker_arguments(parser, 29492)
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
    with bench_broker(args.bootstrap_servers, args.broker_port, "gwbench-broker") as bootstrap_servers:
        settings = KafkaSettings(bootstrap_servers=bootstrap_servers, topic_prefix=f"gw-{uuid.uuid4().hex[:6]}")
        asyncio.run(run(args, settings))


if __name__ == "__main__":
    main()
