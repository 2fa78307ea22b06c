"""The derender's cancels in its producer batches, against cancels sent one by one.

A request that matches a stop string ends in the derender, which asks generate to stop it
with a record on the cancel topic. Those cancels went out one `Publisher.publish` each (a
`producer.send`), while the turn's results went out as one producer batch per partition
(`publish_batch`). Now a cancel names its key's partition (the one the producer's
partitioner would pick: workers/derender/worker.py `_outgoing`) and goes in the turn's
batches with the results.

Both sides run in this process against one broker, as the derender publishes: every
--turn-ms a turn of --results results of --result-bytes (over 8 partitions) and --cancels
cancels, for --seconds. The reference sends the cancels one by one after the results'
batches (the code before the change), the contender puts them in the same
`publish_batch`. Each side's records are acknowledged before its CPU time stops. The sides
alternate, ABBA, for --rounds each. Printed per side: this process's CPU per turn and the
producer batches the broker received; then the reference / batched ratio of the CPU per
turn, and the CPU each cancel cost more when sent alone (the difference per cancel), as
medians over the rounds. Through the whole pipeline the difference was not measurable on
our 2-core VMs (BENCHMARKS.md, "Cancels in the derender's batches").

    python ops/bench/cancel_publish.py [--bootstrap-servers 127.0.0.1:9092] [--rounds 4]
        [--seconds 3] [--turn-ms 2] [--results 40] [--cancels 8] [--result-bytes 220]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from workers.kafka.settings import KafkaSettings  # noqa: E402

PARTITIONS = 8


async def one_side(settings: KafkaSettings, args, batched: bool) -> dict:
    from schemas import JSON, MSGPACK, Cancel
    from workers.kafka.clients import make_producer
    from workers.kafka.publisher import Publisher
    from workers.kafka.records import Outgoing
    from workers.kafka.topic_metadata import key_partition

    producer = make_producer(settings)
    await producer.start()
    publisher = Publisher(producer, settings.topic("dlq"))
    results_topic, cancel_topic = settings.topic("results"), settings.topic("cancel")
    own = (results_topic, cancel_topic)
    value = b"x" * args.result_bytes
    count = await publisher.partition_count(cancel_topic)
    await publisher.partition_count(results_topic)
    futures: list = []
    try:
        warm = [Outgoing(results_topic, "w", value, JSON, partition=p) for p in range(PARTITIONS)]
        warm += [Outgoing(cancel_topic, "w", Cancel(request_id="w", reason="warm"), MSGPACK, partition=p)
                 for p in range(count)]
        await asyncio.gather(*set(await publisher.publish_batch(warm, own_topics=own)))  # connections, leaders
        cpu, started, turns = time.process_time(), time.perf_counter(), 0
        while time.perf_counter() - started < args.seconds:
            turns += 1
            records = [Outgoing(results_topic, f"r{turns}-{i}", value, JSON, partition=i % PARTITIONS)
                       for i in range(args.results)]
            rids = [uuid.uuid4().hex for _ in range(args.cancels)]
            if batched:
                records += [Outgoing(cancel_topic, rid, Cancel(request_id=rid, reason="stop string matched"),
                                     MSGPACK, partition=key_partition(rid, count)) for rid in rids]
                futures += await publisher.publish_batch(records, own_topics=own)
            else:
                futures += await publisher.publish_batch(records, own_topics=own)
                for rid in rids:
                    futures.append(await publisher.publish(Outgoing(
                        cancel_topic, rid, Cancel(request_id=rid, reason="stop string matched"), MSGPACK)))
            await asyncio.sleep(max(0.0, started + turns * args.turn_ms / 1000 - time.perf_counter()))
        await publisher.flush()
        cpu = time.process_time() - cpu
    finally:
        await producer.stop()
    assert all(f.done() and not f.cancelled() and f.exception() is None for f in futures)
    return {"cpu_per_turn": cpu / turns, "turns": turns, "batches": len({id(f) for f in futures})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap-servers", default="127.0.0.1:9092")
    parser.add_argument("--rounds", type=int, default=4, help="runs per side, ABBA")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--turn-ms", type=float, default=2.0, help="a derender loop turn's publish, every so often")
    parser.add_argument("--results", type=int, default=40, help="results per turn (40 at 2 ms: 20k/s)")
    parser.add_argument("--cancels", type=int, default=8, help="cancels per turn (requests ended by a stop string)")
    parser.add_argument("--result-bytes", type=int, default=220)
    args = parser.parse_args()
    if args.cancels < 1:
        parser.error("--cancels must be at least 1")

    from workers.broker.topics import create_topics

    settings = KafkaSettings(bootstrap_servers=args.bootstrap_servers, topic_prefix=f"cancels-{uuid.uuid4().hex[:6]}")
    asyncio.run(create_topics(settings, partitions=PARTITIONS))
    rows: dict[bool, list[dict]] = {True: [], False: []}
    order = [False, True, True, False] * ((args.rounds + 1) // 2)
    for batched in order[:2 * args.rounds]:
        row = asyncio.run(one_side(settings, args, batched))
        rows[batched].append(row)
        print(f"{'batched' if batched else 'alone':<8} {row['cpu_per_turn'] * 1e6:7.1f} µs CPU/turn over "
              f"{row['turns']} turns, {row['batches']} producer batches", flush=True)

    def median(values: list[float]) -> float:
        values = sorted(values)
        return values[len(values) // 2]

    alone = median([r["cpu_per_turn"] for r in rows[False]])
    together = median([r["cpu_per_turn"] for r in rows[True]])
    print(f"reference (alone) / batched, CPU per turn, medians over the rounds: {alone / together:.2f}x; "
          f"a cancel sent alone cost {(alone - together) / args.cancels * 1e6:.1f} µs more")


if __name__ == "__main__":
    main()
