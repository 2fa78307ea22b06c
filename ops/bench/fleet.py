"""A fleet of generate workers: priorities under a bulk backlog, and what scale events cost.

Synthetic-engine generate workers (`--engine synthetic --engine-in thread`) as processes,
a real broker, and a reader of the chunk topic here (no derender: what is measured is
who runs what when; the chunks say it, by attempt). Each part runs the contender and
today's reference in the same run and prints both:

  mixed  A bulk backlog (default 5,000 requests) plus interactive requests at ~2/s.
         Reference: the backlog on <prefix>.requests at the interactive priority (one
         FIFO). Contender: the backlog on <prefix>.requests.bulk at priority 10. Also
         interactive alone (its TTFT p99 is the goal's yardstick) and bulk alone (its
         tokens/s). TTFT = request sent -> its first chunk read here.
  scale  Steady load; the fleet goes 2 -> 3 -> 4 -> 2 workers (the last step a SIGTERM,
         graceful). Per event: requests in flight, requests restarted (a new attempt
         began), and the share of partitions that had to move. Reference: --assignor
         roundrobin (aiokafka's default, nothing kept).
  kill   Steady load on 3 workers; one is killed with SIGKILL. Restarted requests, and
         how many of them had been making progress on a surviving worker (must be 0).
         The group notices the dead worker after the session timeout (30 s).

Everything sent must finish exactly once (lost / duplicated finals are printed).

    python ops/bench/fleet.py [--bootstrap-servers 127.0.0.1:9092] [--parts mixed scale kill]
        [--bulk 5000] [--step-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from schemas import GenerateChunk, GenerateRequest, SamplingParams, encode, headers_for  # noqa: E402
from workers.kafka.settings import KafkaSettings  # noqa: E402

LOG_DIR = Path(tempfile.mkdtemp(prefix="genpipe-fleet-"))


# --- workers ------------------------------------------------------------------------------

def start_worker(settings: KafkaSettings, args, name: str, assignor: str, max_batch: int) -> subprocess.Popen:
    log = open(LOG_DIR / f"{settings.topic_prefix}-{name}.log", "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "generate-worker", "--engine", "synthetic", "--engine-in", "thread",
         "--step-ms", str(args.step_ms), "--max-batch", str(max_batch), "--assignor", assignor,
         "--grace-period", "30", "--log-level", "INFO", "--bootstrap-servers", settings.bootstrap_servers,
         "--topic-prefix", settings.topic_prefix], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


async def members(settings: KafkaSettings) -> int:
    """Members of the generate group once it is stable (no rebalance under way), else -1."""
    from aiokafka.errors import KafkaError

    from workers.kafka.groups import group_states

    group = f"{settings.topic_prefix}-generate"
    try:
        state, n = (await group_states(settings, [group]))[group]
    except (KafkaError, asyncio.TimeoutError):  # a fresh broker: no group coordinator yet
        return -1
    return n if state == "Stable" or n == 0 else -1


async def wait_members(settings: KafkaSettings, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while await members(settings) != n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the group never had {n} members (logs: {LOG_DIR})")
        await asyncio.sleep(0.2)


def stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)


# --- load and observation -------------------------------------------------------------------

@dataclass
class Seen:
    sent_at: float = 0.0
    partition: int | None = None
    first_chunk_at: float | None = None
    attempts: dict[str, float] = field(default_factory=dict)  # attempt -> its first chunk
    last_chunk_at: dict[str, float] = field(default_factory=dict)
    finals: int = 0


class Observer:
    """Reads the chunk topic; remembers, per request, when what happened."""

    def __init__(self, settings: KafkaSettings):
        self.settings = settings
        self.seen: dict[str, Seen] = defaultdict(Seen)
        self._task = None

    async def start(self) -> None:
        from workers.kafka.clients import make_consumer
        from workers.kafka.follow import assign_all

        self.consumer = make_consumer(self.settings, group_id=None, auto_offset_reset="earliest",
                                      fetch_max_wait_ms=10)
        await self.consumer.start()
        await assign_all(self.consumer, self.settings.topic("chunks"), None)
        self._task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        from workers.kafka.records import decode_message

        while True:
            batch = await self.consumer.getmany(timeout_ms=50)
            now = time.monotonic()
            for records in batch.values():
                for record in records:
                    chunk = decode_message(record, GenerateChunk)
                    s = self.seen[chunk.request_id]
                    if s.first_chunk_at is None:
                        s.first_chunk_at = now
                    s.attempts.setdefault(chunk.attempt, now)
                    s.last_chunk_at[chunk.attempt] = now
                    s.finals += chunk.finish_reason is not None

    async def wait_done(self, ids, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.seen[i].finals for i in ids):
            if time.monotonic() > deadline:
                missing = sum(1 for i in ids if not self.seen[i].finals)
                raise RuntimeError(f"{missing} requests without a final chunk after {timeout:.0f} s")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self._task.cancel()
        await self.consumer.stop()

    def in_flight(self, ids, at: float) -> list[str]:
        return [i for i in ids if self.seen[i].sent_at <= at and not self._finished_before(i, at)]

    def _finished_before(self, rid: str, at: float) -> bool:
        s = self.seen[rid]
        return s.finals > 0 and max(s.last_chunk_at.values()) <= at

    def restarted_between(self, ids, start: float, end: float) -> list[str]:
        """Requests whose second (or later) attempt began in [start, end)."""
        return [i for i in ids if any(start <= t < end for t in sorted(self.seen[i].attempts.values())[1:])]

    def check(self, ids) -> tuple[int, int]:
        """(lost, duplicated): requests with no final chunk, with more than one."""
        return (sum(1 for i in ids if self.seen[i].finals == 0), sum(1 for i in ids if self.seen[i].finals > 1))


class Sender:
    def __init__(self, settings: KafkaSettings, observer: Observer):
        self.settings, self.observer = settings, observer
        self.sent: list[str] = []

    async def start(self) -> None:
        from workers.kafka.clients import make_producer

        self.producer = make_producer(self.settings, linger_ms=5)
        await self.producer.start()

    async def send(self, rid: str, max_tokens: int, *, role="requests", priority=0, partition=None) -> None:
        r = GenerateRequest(request_id=rid, prompt_token_ids=[1, 5, 6, 7], priority=priority,
                            sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        self.observer.seen[rid].sent_at = time.monotonic()
        self.observer.seen[rid].partition = partition
        await self.producer.send(self.settings.topic(role), encode(r), key=rid.encode(), headers=headers_for(r),
                                 partition=partition)
        self.sent.append(rid)

    async def steady(self, rate: float, max_tokens: int, until: asyncio.Event, partitions: int) -> None:
        """`rate` requests/s, round robin over the partitions (so each partition has load)."""
        n, start = 0, time.monotonic()
        while not until.is_set():
            await self.send(f"s-{n}", max_tokens, partition=n % partitions)
            n += 1
            delay = start + n / rate - time.monotonic()
            if delay > 0:
                try:
                    await asyncio.wait_for(until.wait(), delay)
                except asyncio.TimeoutError:
                    pass

    async def stop(self) -> None:
        await self.producer.flush()
        await self.producer.stop()


async def deployment(args, partitions: int):
    from workers.broker.topics import create_topics

    settings = KafkaSettings(bootstrap_servers=args.bootstrap_servers, topic_prefix=f"fl-{uuid.uuid4().hex[:6]}")
    await create_topics(settings, partitions=partitions)
    observer = Observer(settings)
    await observer.start()
    sender = Sender(settings, observer)
    await sender.start()
    return settings, observer, sender


async def end_load(until: asyncio.Event, load: asyncio.Future, sender: Sender, observer: Observer) -> None:
    """Stop sending; wait until everything sent has finished."""
    until.set()
    await load
    await sender.producer.flush()
    await observer.wait_done(sender.sent)


async def teardown(procs, sender: Sender, observer: Observer) -> None:
    for p in procs:
        stop(p)
    for p in procs:
        p.wait(60)
    await sender.stop()
    await observer.stop()


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))] if values else float("nan")


# --- the parts ------------------------------------------------------------------------------

async def mixed_run(args, layout: str) -> dict:
    """layout: "alone" (interactive only), "bulk-alone", "fifo" (reference), "priority"."""
    settings, observer, sender = await deployment(args, 8)
    procs = [start_worker(settings, args, f"w{i}", "sticky", args.max_batch) for i in range(2)]
    try:
        await wait_members(settings, 2)
        bulk = []
        if layout != "alone":
            role, priority = ("requests.bulk", 10) if layout in ("priority", "bulk-alone") else ("requests", 0)
            for i in range(args.bulk):  # lengths vary (half to 1.5x), as real ones do
                length = max(1, args.max_tokens // 2 + (i * 7) % (args.max_tokens + 1))
                await sender.send(f"bulk-{i}", length, role=role, priority=priority)
                bulk.append(f"bulk-{i}")
            await sender.producer.flush()
        started = time.monotonic()
        interactive = []
        if layout != "bulk-alone":
            n = 0
            while True:  # ~2/s, for as long as the backlog lasts (at least 10 s)
                await sender.send(f"chat-{n}", args.max_tokens)
                interactive.append(f"chat-{n}")
                n += 1
                await asyncio.sleep(0.5)
                done = all(observer.seen[b].finals for b in bulk)
                if time.monotonic() - started > 10 and done:
                    break
        await observer.wait_done(bulk + interactive)
        bulk_s = max((max(observer.seen[b].last_chunk_at.values()) for b in bulk), default=started) - started
        bulk_tokens = sum(max(1, args.max_tokens // 2 + (i * 7) % (args.max_tokens + 1)) for i in range(len(bulk)))
        ttft = [observer.seen[i].first_chunk_at - observer.seen[i].sent_at for i in interactive]
        lost, dup = observer.check(bulk + interactive)
        return {"ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99), "n": len(interactive),
                "bulk_tok_s": bulk_tokens / bulk_s if bulk else 0.0, "lost": lost, "dup": dup}
    finally:
        await teardown(procs, sender, observer)


async def part_mixed(args) -> None:
    print(f"\n== mixed: {args.bulk} bulk requests + interactive at 2/s, 2 workers, batch {args.max_batch}, "
          f"step {args.step_ms:g} ms, {args.max_tokens} tokens each ==")
    print(f"{'run':<34} {'chat n':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'bulk tok/s':>10} {'lost':>5} {'finals>1':>8}")
    rows = {}
    for layout, label in (("alone", "interactive alone"), ("bulk-alone", "bulk alone (bulk topic)"),
                          ("fifo", "reference: one topic, one priority"),
                          ("priority", "contender: bulk topic, priority 10")):
        r = rows[layout] = await mixed_run(args, layout)
        print(f"{label:<34} {r['n']:>6} {r['ttft_p50'] * 1000:>7.0f}ms {r['ttft_p99'] * 1000:>7.0f}ms "
              f"{r['bulk_tok_s']:>10,.0f} {r['lost']:>5} {r['dup']:>8}")
    print(f"TTFT p99 with the backlog / alone: contender {rows['priority']['ttft_p99'] / rows['alone']['ttft_p99']:.2f}x "
          f"(goal <= 2x), reference {rows['fifo']['ttft_p99'] / rows['alone']['ttft_p99']:.2f}x; bulk tok/s "
          f"with interactive / alone: {rows['priority']['bulk_tok_s'] / rows['bulk-alone']['bulk_tok_s']:.2f}x "
          f"(goal >= 0.9x)")


async def part_scale(args, assignor: str) -> None:
    settings, observer, sender = await deployment(args, 12)
    procs = [start_worker(settings, args, f"w{i}", assignor, 16) for i in range(2)]
    until = asyncio.Event()
    events = []
    try:
        await wait_members(settings, 2)
        load = asyncio.ensure_future(sender.steady(args.rate, 100, until, 12))
        await asyncio.sleep(8)  # steady state (a load phase of fixed length, not a wait on a race)
        for n, label, moved in ((3, "2 -> 3 (join)", 4), (4, "3 -> 4 (join)", 3)):
            events.append((label, time.monotonic(), moved))
            procs.append(start_worker(settings, args, f"w{n - 1}", assignor, 16))
            await wait_members(settings, n)
            await asyncio.sleep(8)
        events.append(("4 -> 2 (SIGTERM x2)", time.monotonic(), 6))
        for p in procs[2:]:
            stop(p)
        await wait_members(settings, 2)
        await asyncio.sleep(8)
        await end_load(until, load, sender, observer)
    finally:
        await teardown(procs, sender, observer)
    ends = [t for _, t, _ in events[1:]] + [time.monotonic()]
    for (label, at, moved), end in zip(events, ends):
        flying = observer.in_flight(sender.sent, at)
        restarted = observer.restarted_between(sender.sent, at, end)
        hit = {observer.seen[r].partition for r in restarted}
        print(f"{assignor:<10} {label:<20} {len(flying):>9} {len(restarted):>9} "
              f"{len(restarted) / max(1, len(flying)):>8.0%} {len(hit):>10} of 12 {moved:>9} of 12")
    lost, dup = observer.check(sender.sent)
    print(f"{assignor:<10} {len(sender.sent)} requests: lost {lost}, duplicated finals {dup}")


async def part_kill(args, assignor: str) -> None:
    settings, observer, sender = await deployment(args, 12)
    procs = [start_worker(settings, args, f"w{i}", assignor, 16) for i in range(3)]
    until = asyncio.Event()
    try:
        await wait_members(settings, 3)
        load = asyncio.ensure_future(sender.steady(args.rate, 100, until, 12))
        await asyncio.sleep(8)
        killed_at = time.monotonic()
        stop(procs[0], signal.SIGKILL)
        await wait_members(settings, 2, timeout=120)  # after the session timeout
        rebalanced_at = time.monotonic()
        await asyncio.sleep(8)
        await end_load(until, load, sender, observer)
    finally:
        await teardown(procs, sender, observer)
    flying = observer.in_flight(sender.sent, killed_at)
    restarted = observer.restarted_between(sender.sent, killed_at, time.monotonic())
    # A request that got chunks of its first attempt well after the kill ran on a survivor.
    survivors = [r for r in restarted
                 if min(observer.seen[r].last_chunk_at.values()) > killed_at + 1.0]
    lost, dup = observer.check(sender.sent)
    print(f"{assignor:<10} {len(flying):>9} {len(restarted):>9} {len(restarted) / max(1, len(flying)):>8.0%} "
          f"{len(survivors):>22} {rebalanced_at - killed_at:>10.1f}s   lost {lost}, duplicated finals {dup}")


async def main_async(args) -> None:
    if "mixed" in args.parts:
        await part_mixed(args)
    if "scale" in args.parts:
        print(f"\n== scale: steady {args.rate:g} requests/s x 100 tokens, 12 partitions, batch 16 ==")
        print(f"{'assignor':<10} {'event':<20} {'in flight':>9} {'restarted':>9} {'share':>8} "
              f"{'partitions with restarts':>16} {'must move':>12}")
        for assignor in ("sticky", "roundrobin"):
            await part_scale(args, assignor)
    if "kill" in args.parts:
        print(f"\n== kill: 3 workers, one SIGKILLed, steady {args.rate:g} requests/s ==")
        print(f"{'assignor':<10} {'in flight':>9} {'restarted':>9} {'share':>8} "
              f"{'restarted on survivors':>22} {'rebalanced':>11}")
        for assignor in ("sticky", "roundrobin"):
            await part_kill(args, assignor)
    print(f"\n(worker logs: {LOG_DIR})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap-servers", default=os.environ.get("GENPIPE_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    parser.add_argument("--parts", nargs="+", default=["mixed", "scale", "kill"], choices=["mixed", "scale", "kill"])
    parser.add_argument("--bulk", type=int, default=5000, help="bulk backlog, requests (mixed)")
    parser.add_argument("--step-ms", type=float, default=20.0, help="synthetic engine step")
    parser.add_argument("--max-batch", type=int, default=64, help="batch of each worker (mixed)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per request (mixed)")
    parser.add_argument("--rate", type=float, default=10.0, help="requests/s of the steady load (scale, kill)")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
