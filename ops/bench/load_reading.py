"""Reading a throughput load back from Kafka: the results as they come (their ages and
the sustained rate), the generate stage's chunks once it is over (each token's time from
its sampling to the chunk log), and the bare produce floor that goal (a)'s bound adds.
ops/bench/throughput.py's docstring says what each figure means."""

from __future__ import annotations

import asyncio
import time

import msgspec

from pipeline import pct  # (ops/bench/pipeline.py: this directory is on sys.path)
from workers.kafka.settings import KafkaSettings


class LoadFailed(Exception):
    """Requests of a load ended with error results: its figures would not be throughput."""


class _ChunkEnd(msgspec.Struct):
    """What the reader needs of a chunk record (a partial decode: the rest is skipped)."""
    request_id: str
    token_ids: list[int] = []  # (left out of a final chunk with no tokens)
    sampled_at_ns: int = 0
    finish_reason: str | None = None
    error: dict | None = None


def sustained(progress: list[tuple[float, int]]) -> float:
    """Units per second between the polls that read the first 10% and 90% of them: the
    rate once running, without the ramp-up (requests still being sent) and the tail."""
    total = progress[-1][1]
    t10, u10 = next(p for p in progress if p[1] >= total * 0.1)
    t90, u90 = next(p for p in progress if p[1] >= total * 0.9)
    return (u90 - u10) / (t90 - t10) if t90 > t10 else float("nan")


async def read_to_finals(consumer, wanted: set[str], what: str, read) -> tuple[float, list[float], int, int, float]:
    """Read until every request in `wanted` has its final record; `read(record)` says
    (request id if final else None, age in seconds, whether the final is an error, units:
    a chunk's tokens, 1 for a result). Returns when the last final was read
    (perf_counter), the ages, records, bytes and the sustained units per second."""
    from workers.kafka.follow import batches

    started, count, size, units = time.perf_counter(), 0, 0, 0
    progress: list[tuple[float, int]] = []
    ages: list[float] = []
    done: set[str] = set()
    failed: list[str] = []
    async for records in batches(consumer):
        for record in records:
            count += 1
            size += len(record.value)
            final, age, error, n = read(record)
            units += n
            ages.append(age)
            if final is not None:
                done.add(final)
                if error:  # an error result: not throughput
                    failed.append(record.value[:300].decode("utf-8", "replace"))
        progress.append((time.perf_counter(), units))
        if wanted <= done:
            break
        if time.perf_counter() - started > 600:
            raise RuntimeError(f"only {len(done)} of {len(wanted)} requests had their final {what} in 600 s")
    if failed:
        raise LoadFailed(f"{len(failed)} of {len(wanted)} requests ended with an error, e.g. {failed[0]}")
    ages.sort()
    return time.perf_counter(), ages, count, size, sustained(progress)


def read_result(record) -> tuple[str | None, float, bool, int]:
    from schemas.headers import HEADER_FINAL

    age = max(0.0, (time.time_ns() - record.timestamp * 1_000_000) / 1e9)
    if HEADER_FINAL in dict(record.headers or ()):
        return record.key.decode(), age, record.value.startswith(b'{"error"'), 1
    return None, age, False, 1


_chunk_end = msgspec.msgpack.Decoder(_ChunkEnd)


class ChunkReader:
    """The generate stage's chunk records, read from the log once the stage is over (see
    `generate_stage`): every token's time from its sampling to the chunk log (`to_log`,
    seconds; the record's timestamp is the broker's append time: throughput.py's docstring), the newest
    token's (`newest`), tokens by append time (`logged`), and the finals."""

    def __init__(self, wanted: set[str]):
        self.wanted = wanted
        self.to_log: list[float] = []
        self.newest: list[float] = []
        self.logged: list[tuple[int, int]] = []  # (append time ms, tokens)
        self.finals: set[str] = set()
        self.failed: list[str] = []
        self.records = 0
        self._newest: dict[str, int] = {}  # request id -> its last chunk's newest token (sampled_at_ns)

    def __call__(self, record) -> None:
        chunk = _chunk_end.decode(record.value)
        if chunk.request_id not in self.wanted:
            return  # (the warm-up's)
        self.records += 1
        n, logged = len(chunk.token_ids), record.timestamp * 1_000_000
        if n:
            newest = chunk.sampled_at_ns
            last = self._newest.get(chunk.request_id)
            step = (newest - last) / n if last is not None else 0.0
            self.to_log.extend(max(0.0, (logged - newest + step * (n - 1 - i)) / 1e9) for i in range(n))
            self.newest.append(max(0.0, (logged - newest) / 1e9))
            self._newest[chunk.request_id] = newest
            self.logged.append((record.timestamp, n))
        if chunk.finish_reason is not None:
            self.finals.add(chunk.request_id)
            if chunk.finish_reason == "error":
                self.failed.append(f"{chunk.request_id}: {chunk.error}")


async def generate_stage(settings: KafkaSettings, wanted: set[str], started_ns: int) -> dict:
    """The generate stage's figures (--each-alone), from its chunks read once every
    request's final chunk is out (nothing here reads while the stage runs: a reader here
    took CPU from it on a 2-core box, and a chunk's time to the log does not need one)."""
    from workers.kafka.clients import make_consumer
    from workers.kafka.follow import assign_all, batches

    consumer = make_consumer(settings, group_id=None, auto_offset_reset="earliest")
    await consumer.start()
    reader, deadline = ChunkReader(wanted), time.monotonic() + 120
    try:
        await assign_all(consumer, settings.topic("chunks"), started_ns // 1_000_000)
        async for records in batches(consumer):
            for record in records:
                reader(record)
            if wanted <= reader.finals:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(reader.finals)} of {len(wanted)} final chunks in the log")
    finally:
        await consumer.stop()
    if reader.failed:
        raise LoadFailed(f"{len(reader.failed)} of {len(wanted)} requests ended with an error, e.g. {reader.failed[0]}")
    reader.logged.sort()
    progress, units = [], 0
    for ms, n in reader.logged:
        units += n
        progress.append((ms / 1000, units))
    return {"gen_elapsed": (reader.logged[-1][0] * 1_000_000 - started_ns) / 1e9, "gen_sustained": sustained(progress),
            "chunks_read": reader.records, "chunk_p50": pct(reader.newest, 0.5), "chunk_p99": pct(reader.newest, 0.99),
            "to_log": (pct(reader.to_log, 0.5), pct(reader.to_log, 0.99))}


async def produce_floor(settings: KafkaSettings, per_s: float, record_bytes: int, step_s: float,
                        seconds: float = 3.0, partitions: int = 8) -> list[float]:
    """The bare produce floor (throughput.py's docstring): `per_s` records of `record_bytes` a second to
    the floor's chunks topic, one batch per partition every `step_s`; each record's
    send -> log append, seconds, sorted."""
    from workers.kafka.clients import make_producer

    topic = settings.topic("chunks")
    producer = make_producer(settings)
    await producer.start()
    value, sent, owed, turn, steps = b"x" * record_bytes, [], 0.0, 0, 0
    try:
        for partition in range(partitions):  # (warm-up: leaders elected, connections made)
            await producer.send_and_wait(topic, value, partition=partition)
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            steps += 1
            owed += per_s * step_s
            count, owed = int(owed), owed - int(owed)
            counts = [count // partitions + (1 if (p - turn) % partitions < count % partitions else 0)
                      for p in range(partitions)]
            turn += count
            at = time.time_ns()
            for partition, n in enumerate(counts):
                if n:
                    batch = producer.create_batch()
                    for _ in range(n):
                        batch.append(key=None, value=value, timestamp=None)
                    batch.close()
                    sent.append((await producer.send_batch(batch, topic, partition=partition), at, n))
            await asyncio.sleep(max(0.0, started + steps * step_s - time.perf_counter()))  # (the next step)
        latencies = []
        for future, at, n in sent:
            logged = (await future).timestamp * 1_000_000
            latencies += [max(0.0, (logged - at) / 1e9)] * n
    finally:
        await producer.stop()
    return sorted(latencies)
