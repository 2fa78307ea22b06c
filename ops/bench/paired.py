"""Old code against new, in child processes whose timed runs interleave: the shared part of
the in-process worker benchmarks (ops/bench/derender_worker.py, ops/bench/generate_worker.py).

Each side is a child process kept up (`<script> --serve ...`), running the code of a
checkout (this one, or a git worktree of a revision); per line on its stdin (a workload)
it does one timed run and prints a JSON line with at least `cpu_s` and `digest` (a hash
of everything it published). Runs alternate ABBA, so neither side always goes first.
The figure to trust on a busy machine is the median of the per-pair ratios: each pair
ran back to back, under the same load. Also here: the fakes those children share (a
consumed record, a publisher that acknowledges at once).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worktree(rev: str) -> Path:
    """A checkout of `rev` under /tmp, made once: ops/bench/throughput.py's, shared."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from ops.bench.throughput import worktree as checkout

    return checkout(rev)


class Side:
    """A `--serve` child of `script` running the code at `code`."""

    def __init__(self, script: Path, code: Path, args: list[str]):
        env = dict(os.environ, PYTHONPATH=str(code), GENPIPE_BENCH_CODE=str(code))
        self.proc = subprocess.Popen([sys.executable, str(script), "--serve", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=str(code))

    def run(self, workload: str) -> dict:
        self.proc.stdin.write(workload + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench child exited (code {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def interleaved(sides: dict[str, Side], workload: str, rounds: int) -> dict:
    """`rounds` timed runs of `workload` on each side ("ref" and "new"), ABBA. Returns the
    last run's own fields, the best CPU time of each side, the median of the pairs' ratios
    (ref / new), and whether every run of both sides published the same bytes."""
    times: dict[str, list[float]] = {"ref": [], "new": []}
    digests: dict[str, set] = {"ref": set(), "new": set()}
    for i in range(rounds):
        for side in (("ref", "new") if i % 2 == 0 else ("new", "ref")):
            last = sides[side].run(workload)
            times[side].append(last["cpu_s"])
            digests[side].add(last["digest"])
    pairs = sorted(a / b for a, b in zip(times["ref"], times["new"]))
    return {**last, "best": {side: min(t) for side, t in times.items()}, "paired": pairs[len(pairs) // 2],
            "identical": digests["ref"] == digests["new"] and len(digests["new"]) == 1}


def compare(script: Path, ref: Path, new: Path, child_args: list[str], workloads: list[str], rounds: int,
            row, may_differ: bool = False) -> int:
    """The parent's part: both sides of `script` kept up, each workload run `rounds` times
    a side (`interleaved`), and a line printed per workload: `row(workload, result)`.
    Returns the exit code: 1 if any workload's sides published different bytes, unless
    `may_differ` (a change that alters the output on purpose: the line says so)."""
    sides = {"ref": Side(script, ref, child_args), "new": Side(script, new, child_args)}
    same = True
    try:
        for workload in workloads:
            result = interleaved(sides, workload, rounds)
            same &= result["identical"]
            print(row(workload, result) + ("  identical" if result["identical"] else
                                           "  different (allowed)" if may_differ else "  DIFFERENT"), flush=True)
    finally:
        for side in sides.values():
            side.close()
    return 0 if same or may_differ else 1


def engine_pipe():
    """The side's engine pipe: (encode, decode_from_child, Add, Step). In
    workers/generate/engine_pipe.py; in engine_process.py in code older than 2026-12-04."""
    try:
        from workers.generate import engine_pipe as pipe

        return pipe.encode, pipe.decode_from_child, pipe.Add, pipe.Step
    except ImportError:
        from workers.generate import engine_process as old

        return old._encode, old._decode_from_child, old.Add, old.Step


def use_code() -> str:
    """In a child: put its checkout's packages first and check they are the ones imported."""
    code = os.environ.get("GENPIPE_BENCH_CODE", str(ROOT))
    sys.path.insert(0, code)
    import schemas
    import workers

    assert all(Path(m.__file__).resolve().is_relative_to(Path(code).resolve()) for m in (schemas, workers))
    return code


def fixed_chunk_policy(chunk_tokens: int):
    """The side's own ChunkPolicy, cutting chunks at exactly `chunk_tokens` when its
    publisher reports a lagging producer: sizes independent of timing (never stretched
    by how far behind the side is, in code that stretches), so both sides publish the
    same chunks and what is compared is the code's cost, not its policy."""
    from workers.generate.chunks import ChunkPolicy

    fixed = {"saturated_stretch": 1.0} if "saturated_stretch" in ChunkPolicy.__dataclass_fields__ else {}
    return ChunkPolicy(max_tokens=chunk_tokens, max_delay_s=1e9, lag_threshold=1, **fixed)


def publishing(handler) -> set:
    """The generate handler's publish steps under way, in this code and older code."""
    steps = getattr(handler, "steps", None)
    return steps.under_way if steps is not None else handler._publishing


class Message:
    """A consumed record, as the workers' handlers read it."""

    __slots__ = ("topic", "partition", "offset", "key", "value", "headers", "timestamp")

    def __init__(self, topic, partition, offset, value, headers, key=None):
        self.topic, self.partition, self.offset, self.value, self.headers = topic, partition, offset, value, headers
        self.key, self.timestamp = key, 0


class Publisher:
    """Takes what aiokafka's batch append takes (key, value, headers); acks at once.
    `in_flight` is what the handler sees as unacknowledged records."""

    max_record_bytes = 1_000_000

    def __init__(self, sink: list, in_flight: int = 0):
        self.sink = sink
        self.in_flight = in_flight

    def fits(self, record) -> bool:
        return record.size() <= self.max_record_bytes

    async def partition_count(self, topic):
        return 8

    def known_partitions(self, topic):
        return 8

    def record_limit(self, topic):
        return self.max_record_bytes  # (every topic takes the worker's limit)

    def _take(self, record):
        self.sink.append((record.topic, record.key.encode(), record.kafka_value(), record.kafka_headers()))
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    async def publish(self, record):
        return self._take(record)

    async def publish_batch(self, records, own_topics=None):
        """A future per record, shared by the records of one partition (as one producer
        batch per partition is acknowledged at once). (`own_topics`: nothing fails here.)"""
        futures, by_partition = [], {}
        for r in records:
            future = self._take(r)
            futures.append(by_partition.setdefault((r.topic, r.partition), future))
        return futures

    async def flush(self):
        pass

    async def fail_records_of_deleted_topics(self):
        """(The derender's tick asks every turn; nothing here is ever deleted.)"""
        return []
