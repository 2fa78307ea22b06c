"""The latency part of ops/bench/gateway.py: the same streamed completions over HTTP and
through GenpipeClient at the same time; per token sampled -> arrival, paired, TTFT, intake."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import msgspec

from ops.bench.gateway_procs import GATEWAY_ID, bucket_pct, ms, pct, proc_stats, relay_buckets, wait_for
from ops.bench.sse import sse_post
from workers.kafka.settings import KafkaSettings

_decode = msgspec.json.decode


class Tap:
    """Reads the chunk topic (each token's sampled time) and the gateway's reply topic
    (when each result record could have been read by a Kafka client) in this process."""

    def __init__(self, settings: KafkaSettings, gateway_ids: list[str]):
        self.settings = settings
        self.gateway_ids = gateway_ids
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
        follows = [(self.settings.topic("chunks"), on_chunk), (self.settings.topic("requests"), on_request),
                   *((f"{self.settings.topic_prefix}.reply.{gid}", on_reply) for gid in self.gateway_ids)]
        ready = [asyncio.Event() for _ in follows]
        self.tasks = [asyncio.ensure_future(follow(self.settings, topic, handler, self.stop_event, ready=r,
                                                   poll_timeout_ms=5)) for (topic, handler), r in zip(follows, ready)]
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


def http_stats(runs, tap: Tap) -> dict:
    """Per token sampled -> SSE arrival, paired (reply record here -> SSE), TTFT, intake."""
    tok, paired, ttft, unmatched = [], [], [], 0
    for rid, sent, arrivals in runs:
        seqs = sorted(tap.sampled[rid])
        if len(seqs) != len(arrivals):  # one SSE event per result record per chunk, unless restarted
            unmatched += 1
            continue
        ttft.append((arrivals[0] - sent) / 1e9)
        for seq, now in zip(seqs, arrivals):
            tok.append((now - tap.sampled[rid][seq]) / 1e9)
            if (rid, seq) in tap.replied:
                paired.append((now - tap.replied[(rid, seq)]) / 1e9)
    return {"tok": tok, "paired": paired, "ttft": ttft, "unmatched": unmatched,
            "intake": [(tap.requested[r] - sent) / 1e9 for r, sent, _ in runs if r in tap.requested]}


async def latency_row(label: str, client, tap: Tap, gateways: list, concurrency: int, requests: int,
                      max_tokens: int) -> list[tuple]:
    """`concurrency` requests at a time through each gateway and through the Kafka client, all
    at once; one printed row per gateway; returns (added p50, p99, paired p50, p99) each."""
    http_runs: dict[str, list] = {name: [] for name, _, _ in gateways}
    kafka_runs: list = []

    async def http_slot(name: str, port: int, slot: int) -> None:
        for i in range(slot, requests, concurrency):
            http_runs[name].append(await http_request(port, i, max_tokens))

    async def kafka_slot(slot: int) -> None:
        for i in range(slot, requests, concurrency):
            kafka_runs.append(await kafka_request(client, i, max_tokens))

    cpu0 = {name: proc_stats(pid)[1] for name, _, pid in gateways}
    relay0 = {name: await relay_buckets(port) for name, port, _ in gateways}
    started = time.monotonic()
    await asyncio.gather(*(http_slot(name, port, s) for name, port, _ in gateways for s in range(concurrency)),
                         *(kafka_slot(s) for s in range(concurrency)))
    wall = time.monotonic() - started
    cpu = {name: (proc_stats(pid)[1] - cpu0[name]) / wall for name, _, pid in gateways}
    relay = {name: await relay_buckets(port) for name, port, _ in gateways}
    rids = [r for runs in (*http_runs.values(), kafka_runs) for r, _, _ in runs]
    await wait_for("every chunk read by the tap", lambda: tap.finished.issuperset(rids), 30)
    kafka_tok = [(now - tap.sampled[rid][seq]) / 1e9 for rid, _, got in kafka_runs for seq, now in got]
    kafka_ttft = [(got[0][1] - sent) / 1e9 for _, sent, got in kafka_runs]
    kafka_in = [(tap.requested[r] - sent) / 1e9 for r, sent, _ in kafka_runs if r in tap.requested]
    kp50, kp99 = pct(kafka_tok, .5), pct(kafka_tok, .99)
    out = []
    for name, _, _ in gateways:
        h = http_stats(http_runs[name], tap)
        r50, r99 = (bucket_pct(relay0[name], relay[name], q) for q in (.5, .99))
        hp50, hp99 = pct(h["tok"], .5), pct(h["tok"], .99)
        row = label if name == gateways[0][0] else f"  via {name}"
        print(f"{row:<24} {len(h['tok']):>6} {len(kafka_tok):>6} {ms(kp50):>9} {ms(hp50):>9} {ms(hp50 - kp50):>9} "
              f"{ms(kp99):>9} {ms(hp99):>9} {ms(hp99 - kp99):>9} {ms(pct(h['paired'], .5)):>9} "
              f"{ms(pct(h['paired'], .99)):>9} {ms(pct(kafka_ttft, .5)):>9} {ms(pct(h['ttft'], .5)):>9} "
              f"{ms(pct(kafka_in, .5)):>9} {ms(pct(h['intake'], .5)):>9} {ms(r50):>9} {ms(r99):>9} {cpu[name]:>6.0%}"
              + (f"  ({h['unmatched']} HTTP requests unmatched)" if h["unmatched"] else ""), flush=True)
        out.append((hp50 - kp50, hp99 - kp99, pct(h["paired"], .5), pct(h["paired"], .99), r50, r99))
    return out


async def part_latency(args, settings: KafkaSettings, gateways: list) -> None:
    """`gateways`: (name, port, pid), this tree's first."""
    from workers.client import GenpipeClient

    tap = Tap(settings, [f"{GATEWAY_ID}-compare" if i else GATEWAY_ID for i in range(len(gateways))])
    await tap.start()
    verdicts = []
    async with GenpipeClient(settings=settings, timeout_s=60) as client:
        await latency_row("warm-up", client, tap, gateways, 2, 8, 8)
        print(f"\n== latency: synthetic engine, step {args.step_ms:g} ms, {args.max_tokens} tokens per request; "
              f"HTTP and Kafka requests at the same time ==")
        print(f"{'load (per side)':<24} {'http n':>6} {'kafka n':>6} {'kafka p50':>9} {'http p50':>9} "
              f"{'added p50':>9} {'kafka p99':>9} {'http p99':>9} {'added p99':>9} {'pair p50':>9} "
              f"{'pair p99':>9} {'kTTFT p50':>9} {'hTTFT p50':>9} {'kIn p50':>9} {'hIn p50':>9} {'relay p50':>9} "
              f"{'relay p99':>9} {'gw CPU':>6}")
        for label, concurrency, requests in (("low (1 at a time)", 1, args.requests_low),
                                             (f"moderate ({args.concurrency} at once)", args.concurrency,
                                              args.requests_moderate)):
            added = (await latency_row(label, client, tap, gateways, concurrency, requests, args.max_tokens))[0]
            verdicts.append(f"{label}: " + ", ".join(
                f"{how} p50 {ms(p50)} ({'met' if p50 <= 1e-3 else 'NOT met'}) p99 {ms(p99)} "
                f"({'met' if p99 <= 5e-3 else 'NOT met'})" for how, p50, p99 in (
                    ("added", *added[:2]), ("paired", *added[2:4]), ("relay", *added[4:]))))
    await tap.close()
    print("goal (this tree's gateway adds p50 <= 1 ms, p99 <= 5 ms): " + "; ".join(verdicts))
    print("added = http − kafka (sampled → arrival here); pair = the same result record read here from the "
          "gateway's reply topic → its SSE event here; In = request sent → its record read here from the "
          "requests topic; relay = inside the gateway, a result record read → its SSE event handed to the HTTP "
          "server (its /metrics histogram, interpolated in a bucket); gw CPU = the gateway process, share of "
          "one core")
