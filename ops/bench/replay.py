"""`genpipe replay --to-topic` of this checkout against a reference revision's.

    python ops/bench/replay.py [--bootstrap-servers 127.0.0.1:9092] [--reference REV] [--rounds 3]
        [--requests 2048] [--tokens 128] [--chunk-tokens 10] [--k 0] [--text ascii]

A chunk log is written once (ops/bench/derender.py's workload: streamed chat requests of
--text, --k top logprobs, --chunk-tokens tokens a chunk, over 8 partitions); then each
side replays all of it into a fresh topic of its own, as a process (`python -m
workers.cli replay --from 0 --to-topic T`, the reference's from a git worktree of REV,
/tmp/genpipe-ref-<sha>). The sides alternate, ABBA. Printed per run: its wall time and
CPU time (the process's, start-up included: the same on both sides), results, and then
the medians' ratios reference / this and the CPU per result each side took. Both sides'
topics are read back: they must hold the same records (key, value, headers) in the same
order on every partition, or the run says DIFFERENT and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import resource
import subprocess
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE.parent))

from workers.kafka.settings import KafkaSettings  # noqa: E402

PARTITIONS = 8


async def write_chunks(settings: KafkaSettings, args) -> int:
    """The chunk log, once; how many chunks."""
    from derender import make_chunks  # noqa: E402  (this directory's ops/bench/derender.py)

    from schemas import encode, headers_for
    from workers.broker.topics import create_topics
    from workers.derender.vocab import VocabTables
    from workers.kafka.clients import make_producer
    from workers.models.tinymodel import build_tokenizer

    await create_topics(settings, partitions=PARTITIONS)
    chunks = make_chunks(VocabTables(build_tokenizer("spm")), args.text, args.k, args.requests, args.tokens,
                         args.chunk_tokens)
    producer = make_producer(settings)
    await producer.start()
    try:
        partition_of: dict[str, int] = {}
        for chunk in chunks:
            partition = partition_of.setdefault(chunk.request_id, len(partition_of) % PARTITIONS)
            await producer.send(settings.topic("chunks"), encode(chunk), key=chunk.request_id.encode(),
                                headers=headers_for(chunk), partition=partition)
        await producer.flush()
    finally:
        await producer.stop()
    return len(chunks)


async def new_topic(settings: KafkaSettings, name: str) -> None:
    from aiokafka.admin import NewTopic

    from workers.kafka.clients import make_admin

    admin = make_admin(settings)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, PARTITIONS, 1)])
    finally:
        await admin.close()


async def digest(settings: KafkaSettings, topic: str, records: int) -> tuple[int, str]:
    """How many records `topic` holds (read until `records`, or 10 s without more), and a
    hash of each partition's records in order."""
    from workers.kafka.clients import make_consumer
    from workers.kafka.follow import assign_all

    consumer = make_consumer(settings, group_id=None, auto_offset_reset="earliest")
    await consumer.start()
    hashes = {p: hashlib.sha256() for p in range(PARTITIONS)}
    seen, idle_since = 0, time.monotonic()
    try:
        await assign_all(consumer, topic, 0)  # (from the start)
        while seen < records and time.monotonic() - idle_since < 10:
            for tp, messages in (await consumer.getmany(timeout_ms=200)).items():
                for m in messages:
                    hashes[tp.partition].update(repr((m.key, m.value, sorted(m.headers))).encode())
                    seen += 1
                    idle_since = time.monotonic()
    finally:
        await consumer.stop()
    return seen, hashlib.sha256(b"".join(h.digest() for h in hashes.values())).hexdigest()[:16]


def run_replay(settings: KafkaSettings, code: Path, topic: str) -> tuple[float, float]:
    """One `genpipe replay` of the whole chunk log into `topic`: (wall s, CPU s)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "workers.cli", "replay", "--bootstrap-servers",
                    settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix, "--from", "0",
                    "--to-topic", topic], cwd=code, env=dict(os.environ, PYTHONPATH=str(code)), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap-servers", default=os.environ.get("GENPIPE_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    parser.add_argument("--reference", metavar="REV", default="main", help="the code to compare with (git rev)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per side, ABBA")
    parser.add_argument("--requests", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--chunk-tokens", type=int, default=10)
    parser.add_argument("--k", type=int, default=0, help="top logprobs per position")
    parser.add_argument("--text", choices=("ascii", "cjk"), default="ascii")
    args = parser.parse_args()

    from paired import worktree  # noqa: E402  (ops/bench/paired.py)

    reference = worktree(args.reference)
    settings = KafkaSettings(bootstrap_servers=args.bootstrap_servers, topic_prefix=f"replay-{uuid.uuid4().hex[:6]}")
    chunks = asyncio.run(write_chunks(settings, args))
    print(f"{chunks} chunks of {args.requests} requests x {args.tokens} tokens ({args.text}, k = {args.k}); "
          f"reference {args.reference}")
    rows: dict[str, list[tuple[float, float]]] = {"reference": [], "this": []}
    digests: dict[str, set] = {"reference": set(), "this": set()}
    order = ["reference", "this", "this", "reference"] * ((args.rounds + 1) // 2)
    for run, side in enumerate(order[:2 * args.rounds]):
        topic = f"{settings.topic_prefix}.out-{run}"
        asyncio.run(new_topic(settings, topic))
        wall, cpu = run_replay(settings, reference if side == "reference" else ROOT, topic)
        records, digest_ = asyncio.run(digest(settings, topic, chunks))
        rows[side].append((wall, cpu))
        digests[side].add((records, digest_))
        print(f"{side:<9} wall {wall:6.2f} s  CPU {cpu:6.2f} s  {records} results  ({digest_})", flush=True)

    def median(side: str, i: int) -> float:
        values = sorted(row[i] for row in rows[side])
        return values[len(values) // 2]

    results = next(iter(digests["this"]))[0]
    print(f"reference / this, medians: wall {median('reference', 0) / median('this', 0):.2f}x, "
          f"CPU {median('reference', 1) / median('this', 1):.2f}x; CPU per result "
          f"{median('reference', 1) / results * 1e6:.1f} / {median('this', 1) / results * 1e6:.1f} µs")
    if len(digests["this"] | digests["reference"]) != 1:
        print(f"DIFFERENT: {digests}")
        sys.exit(1)


if __name__ == "__main__":
    main()
