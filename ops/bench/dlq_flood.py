"""A flood of unreadable requests through a generate worker: this checkout against a reference.

    python ops/bench/dlq_flood.py [--bootstrap-servers 127.0.0.1:9092] [--reference REV] [--rounds 2]
        [--records 50000] [--partitions 4]

Each run gets topics of its own and a generate worker of one side (`python -m workers.cli
generate-worker --engine synthetic`, the reference's from a git worktree of REV,
/tmp/genpipe-ref-<sha>); once the worker's group is stable, --records records that are
not requests go to the requests topic as fast as one producer sends them: half invalid
msgpack, half JSON without a readable request_id, so every one is copied to the DLQ. A
run ends when the group's committed offsets reach the end of every partition. Printed per
run: the worker's CPU over the flood (/proc) per record, the wall time from the first
record sent to the last commit, the lines the worker logged, and the DLQ's record count,
which must equal --records (else the run says LOST and the command exits 1). Then the
medians' ratio reference / this. The sides alternate, ABBA.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE.parent))

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition  # noqa: E402
from aiokafka.admin import AIOKafkaAdminClient  # noqa: E402
from aiokafka.errors import KafkaError  # noqa: E402

from proc_cpu import cpu_seconds  # noqa: E402  (ops/bench/proc_cpu.py)
from workers.kafka.settings import KafkaSettings  # noqa: E402

STABLE_WAIT_S = 60.0
FLOOD_WAIT_S = 600.0


def flood_value(i: int) -> tuple[bytes, list]:
    """Record i of the flood: invalid msgpack, or JSON whose request_id is not a string."""
    if i % 2:
        return b"\xc1 not msgpack", [("content-type", b"application/x-msgpack")]
    return b'{"request_id": %d, "prompt_token_ids": [1]}' % i, [("content-type", b"application/json")]


async def wait_until(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        await asyncio.sleep(0.05)


async def one_run(settings: KafkaSettings, code: Path, args) -> dict:
    subprocess.run([sys.executable, "-m", "workers.cli", "topics", "create", "--bootstrap-servers",
                    settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix, "--partitions",
                    str(args.partitions)], cwd=code, env=dict(os.environ, PYTHONPATH=str(code)), check=True,
                   stdout=subprocess.DEVNULL)
    log = tempfile.TemporaryFile()
    worker = subprocess.Popen([sys.executable, "-m", "workers.cli", "generate-worker", "--engine", "synthetic",
                               "--bootstrap-servers", settings.bootstrap_servers, "--topic-prefix",
                               settings.topic_prefix, "--metrics-port", "0"],
                              cwd=code, env=dict(os.environ, PYTHONPATH=str(code)), stdout=log, stderr=log)
    group = f"{settings.topic_prefix}-generate"
    source = [TopicPartition(settings.topic("requests"), p) for p in range(args.partitions)]
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers)
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers, linger_ms=5)
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers)
    await admin.start()
    await producer.start()
    await consumer.start()
    try:
        async def stable():
            if worker.poll() is not None:
                raise RuntimeError(f"the worker exited with {worker.returncode}")
            try:
                described = await admin.describe_consumer_groups([group])
            except KafkaError:  # (a broker just started: no group coordinator yet)
                return False
            return described[0].groups[0][2] == "Stable"

        await wait_until(stable, STABLE_WAIT_S, "the worker's group stable")
        lines_before = _lines(log)
        cpu_before = cpu_seconds(worker.pid)
        started = time.perf_counter()
        for i in range(args.records):
            value, headers = flood_value(i)
            await producer.send(source[0].topic, value, key=b"k%d" % i, headers=headers)
        await producer.flush()
        ends = await consumer.end_offsets(source)

        async def committed():
            offsets = await admin.list_consumer_group_offsets(group, partitions=source)
            return all(offsets.get(tp) is not None and offsets[tp].offset >= ends[tp] for tp in source)

        await wait_until(committed, FLOOD_WAIT_S, "the group's commits past the flood")
        wall = time.perf_counter() - started
        cpu = cpu_seconds(worker.pid) - cpu_before
        lines = _lines(log) - lines_before
        dlq = await consumer.end_offsets([TopicPartition(settings.topic("dlq"), p) for p in range(args.partitions)])
    finally:
        worker.terminate()
        worker.wait(60)
        await consumer.stop()
        await producer.stop()
        await admin.close()
    return {"cpu": cpu, "wall": wall, "lines": lines, "dlq": sum(dlq.values())}


def _lines(log) -> int:
    log.seek(0)
    return log.read().count(b"\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap-servers", default=os.environ.get("GENPIPE_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    parser.add_argument("--reference", metavar="REV", default="main", help="the code to compare with (git rev)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side, ABBA")
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--partitions", type=int, default=4)
    args = parser.parse_args()

    from paired import worktree  # noqa: E402  (ops/bench/paired.py)

    reference = worktree(args.reference)
    rows: dict[str, list[dict]] = {"reference": [], "this": []}
    lost = False
    order = ["reference", "this", "this", "reference"] * ((args.rounds + 1) // 2)
    print(f"{args.records} unreadable records per run, {args.partitions} partitions; reference {args.reference}")
    for side in order[:2 * args.rounds]:
        settings = KafkaSettings(bootstrap_servers=args.bootstrap_servers,
                                 topic_prefix=f"flood-{uuid.uuid4().hex[:6]}")
        row = asyncio.run(one_run(settings, reference if side == "reference" else ROOT, args))
        rows[side].append(row)
        lost |= row["dlq"] != args.records
        print(f"{side:<9} CPU {row['cpu']:6.2f} s = {row['cpu'] / args.records * 1e6:5.1f} µs per record, "
              f"wall {row['wall']:6.2f} s, {row['lines']} log lines, DLQ {row['dlq']}"
              f"{'' if row['dlq'] == args.records else ' LOST'}", flush=True)

    def median(side: str, key: str) -> float:
        values = sorted(row[key] for row in rows[side])
        return values[len(values) // 2]

    print(f"reference / this, medians: CPU {median('reference', 'cpu') / median('this', 'cpu'):.2f}x, "
          f"wall {median('reference', 'wall') / median('this', 'wall'):.2f}x")
    if lost:
        sys.exit(1)


if __name__ == "__main__":
    main()
