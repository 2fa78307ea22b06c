"""Records that join their partition's queued batch, against records that wait for it to leave.

`Publisher.publish_batch` (workers/kafka/publisher.py) hands each partition's records to
aiokafka as a batch. aiokafka's sender sends one produce request at a time to a broker,
so a partition's batch can still be queued when the next publish step comes. Before, that
step waited for the queued batch to leave (`_room_for`), and its records left one produce
round trip later. After a pause of the broker, every step then waited its turn. Now the
step's records join the queued batch while it has room (`_join_queued`).

Both sides run in this process against one broker, as the generate worker publishes: one
`publish_batch` per step (every --step-ms), --per-step records of --record-bytes spread
over 8 partitions, for --seconds. The reference is the same Publisher with the join turned
off (`_join_queued` returns 0): the code before the change. The sides alternate, ABBA,
for --rounds each. Printed per side: each record's time from its `publish_batch` call to
its log append (the topic keeps `LogAppendTime`, whole milliseconds, on both sides
alike), p50/p99/max; the batches the broker received (distinct futures); and this
process's CPU per record. The last line gives reference / join ratios.

    python ops/bench/publish_join.py [--bootstrap-servers 127.0.0.1:9092] [--rounds 4]
        [--seconds 3] [--step-ms 2] [--per-step 80] [--record-bytes 140]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline import log_append_time, pct  # noqa: E402  (ops/bench/pipeline.py)
from workers.kafka.settings import KafkaSettings  # noqa: E402

PARTITIONS = 8


async def one_side(settings: KafkaSettings, args, join: bool) -> dict:
    from workers.kafka.clients import make_producer
    from workers.kafka.publisher import Publisher
    from workers.kafka.records import Outgoing

    producer = make_producer(settings)
    await producer.start()
    publisher = Publisher(producer, settings.topic("dlq"))
    if not join:
        publisher._join_queued = lambda *_: 0  # the code before the change
    topic, value = settings.topic("chunks"), b"x" * args.record_bytes
    await publisher.partition_count(topic)
    sent: list[tuple[int, list]] = []
    try:
        for partition in range(PARTITIONS):  # (warm-up: connections, leaders)
            await (await publisher.publish_batch([Outgoing(topic, "w", value, partition=partition)]))[0]
        cpu, started, steps, turn = time.process_time(), time.perf_counter(), 0, 0
        while time.perf_counter() - started < args.seconds:
            steps += 1
            records = [Outgoing(topic, "k", value, partition=(turn + i) % PARTITIONS) for i in range(args.per_step)]
            turn += args.per_step
            at = time.time_ns()
            sent.append((at, await publisher.publish_batch(records)))
            await asyncio.sleep(max(0.0, started + steps * args.step_ms / 1000 - time.perf_counter()))
        await publisher.flush()
        cpu = time.process_time() - cpu
    finally:
        await producer.stop()
    latencies, batches = [], set()
    for at, futures in sent:
        for future in futures:
            batches.add(id(future))
            latencies.append(max(0.0, (future.result().timestamp * 1_000_000 - at) / 1e9))
    latencies.sort()
    return {"p50": pct(latencies, 0.5), "p99": pct(latencies, 0.99), "max": latencies[-1],
            "batches": len(batches), "records": len(latencies), "cpu_per_record": cpu / len(latencies)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap-servers", default="127.0.0.1:9092")
    parser.add_argument("--rounds", type=int, default=4, help="runs per side, ABBA")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--step-ms", type=float, default=2.0)
    parser.add_argument("--per-step", type=int, default=80, help="records per publish step (80 at 2 ms: 40k/s)")
    parser.add_argument("--record-bytes", type=int, default=140)
    args = parser.parse_args()

    from workers.broker.topics import create_topics

    settings = KafkaSettings(bootstrap_servers=args.bootstrap_servers, topic_prefix=f"join-{uuid.uuid4().hex[:6]}")
    asyncio.run(create_topics(settings, partitions=PARTITIONS))
    asyncio.run(log_append_time(settings, ("chunks",)))
    results: dict[bool, list[dict]] = {True: [], False: []}
    order = [False, True, True, False] * ((args.rounds + 1) // 2)
    for join in order[:2 * args.rounds]:
        row = asyncio.run(one_side(settings, args, join))
        results[join].append(row)
        print(f"{'join' if join else 'wait':<5} p50 {row['p50'] * 1e3:5.1f} ms  p99 {row['p99'] * 1e3:5.1f} ms  "
              f"max {row['max'] * 1e3:5.1f} ms  {row['batches']:>6} batches for {row['records']} records  "
              f"{row['cpu_per_record'] * 1e6:5.1f} µs CPU/record", flush=True)

    def median(join: bool, key: str) -> float:
        values = sorted(row[key] for row in results[join])
        return values[len(values) // 2]

    print("reference (wait) / join, medians over the rounds: " + ", ".join(
        f"{key} {median(False, key) / max(median(True, key), 1e-9):.2f}x"
        for key in ("p50", "p99", "max", "batches", "cpu_per_record")))


if __name__ == "__main__":
    main()
