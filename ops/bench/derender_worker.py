"""The derender worker's CPU per result record and per token, old code against new.

    python ops/bench/derender_worker.py --reference REV [--contender REV] [--rounds 20] [--only chat:cjk:5 ...]
    python ops/bench/derender_worker.py --profile [--workload chat:cjk:5]

Everything the worker does for a chunk except the broker round trips: msgpack chunk bytes
(as generate writes them) go through the real `DerenderHandler.handle` (decode, state
machine, shaping, record size check, JSON encoding, headers, metrics) and its `tick`
(the producer batches), with a publisher that takes each record's key, value and headers
as aiokafka would and acknowledges it at once. Each side is a child process kept up, the
reference's code from a git worktree of REV (/tmp/genpipe-ref-<sha>), the contender's from
this checkout; their runs interleave (ABBA), each over the same records with a cold
correction cache. Printed: each side's best run (CPU time), their ratio, and the median
of the per-pair ratios (each pair ran back to back: the figure to trust on a busy box).

Workloads, streamed, ~10 tokens a chunk (the chunk-rate aim at batch 256): chat
(`top_logprobs = k`) and completion (`logprobs = k`, k + 1 candidates) over ASCII and
CJK/emoji text (byte pieces, so byte-fallback corrections and U+FFFD), and the synthetic
engine's ids (what ops/bench/throughput.py runs), at k = 0 and 5. Every record's topic,
key, value and headers are hashed: the two sides must publish identical bytes, or the
row says DIFFERENT (and the command exits 1).

--profile prints a cProfile of the contender on the CJK chat k=5 workload instead.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]

WORKLOADS = [(shape, text, k) for text in ("ascii", "cjk", "synthetic") for shape in ("chat", "completion")
             for k in (0, 5)]


# --- a child: one side, its runs timed ----------------------------------------------------

def build_messages(tables, shape: str, text: str, k: int, requests: int, tokens: int, chunk_tokens: int):
    """(topic, partition, offset, value, headers) of the chunk records, interleaved; a
    request's chunks on one of 8 partitions, as generate keys them."""
    sys.path.insert(0, str(HERE.parent))
    from derender import make_chunks  # noqa: E402  (this directory's ops/bench/derender.py)

    from schemas import encode, headers_for
    from schemas.records import OutputOptions

    if text == "synthetic":  # the synthetic engine's ids and rows (ops/bench/throughput.py's load)
        chunks = synthetic_chunks(tables.size, k, requests, tokens, chunk_tokens)
    else:
        chunks = make_chunks(tables, text, k + (shape == "completion"), requests, tokens, chunk_tokens)
    out, partitions, offsets = [], {}, [0] * 8
    for chunk in chunks:
        if chunk.seq == 0:
            chunk.output = OutputOptions(kind=shape, stream=True, top_logprobs=k)
        p = partitions.setdefault(chunk.request_id, len(partitions) % 8)
        out.append(("chunks", p, offsets[p], encode(chunk), headers_for(chunk)))
        offsets[p] += 1
    return out, sum(len(c.token_ids) for c in chunks)


def synthetic_chunks(vocab: int, k: int, requests: int, tokens: int, chunk_tokens: int):
    from schemas.records import GenerateChunk, GenerateLogProb, GenerateLogProbs, GenerateLogProbsContent
    from workers.generate.synthetic import synthetic_token

    per_request = []
    n = k + 1 if k else 0
    for r in range(requests):
        rid = f"syn-{r}"
        ids = [synthetic_token(rid, i, vocab) for i in range(tokens)]
        chunks = []
        for seq, start in enumerate(range(0, tokens, chunk_tokens)):
            part = ids[start:start + chunk_tokens]
            lp = None
            if n:
                lp = GenerateLogProbs(content=[GenerateLogProbsContent(
                    token_id=t, logprob=-0.5, rank=1,
                    top_logprobs=[GenerateLogProb(t2, -0.5 - j, j + 1)
                                  for j, t2 in enumerate([t, *((t + j) % vocab for j in range(1, n))])])
                    for t in part])
            chunk = GenerateChunk(request_id=rid, attempt="a", seq=seq, token_offset=start, token_ids=part,
                                  logprobs=lp, finish_reason="length" if start + chunk_tokens >= tokens else None,
                                  sampled_at_ns=1_700_000_000_000_000_000)
            if seq == 0:
                chunk.prompt_token_count = 4
                chunk.prompt_tail_ids = [1, 5, 6, 7]
            chunks.append(chunk)
        per_request.append(chunks)
    return [c[i] for i in range(max(map(len, per_request))) for c in per_request if i < len(c)]


class Message:
    __slots__ = ("topic", "partition", "offset", "key", "value", "headers", "timestamp")

    def __init__(self, topic, partition, offset, value, headers):
        self.topic, self.partition, self.offset, self.value, self.headers = topic, partition, offset, value, headers
        self.key, self.timestamp = None, 0


class Publisher:
    """Takes what aiokafka's batch append takes (key, value, headers); acks at once."""

    max_record_bytes = 1_000_000
    in_flight = 0

    def __init__(self, sink):
        self.sink = sink

    async def partition_count(self, topic):
        return 8

    def _take(self, record):
        self.sink.append((record.topic, record.key.encode(), record.kafka_value(), record.kafka_headers()))
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    async def publish(self, record):
        return self._take(record)

    async def publish_batch(self, records):
        """A future per record, shared by the records of one partition (as one producer
        batch per partition is acknowledged at once)."""
        futures, by_partition = [], {}
        for r in records:
            future = self._take(r)
            futures.append(by_partition.setdefault((r.topic, r.partition), future))
        return futures

    async def flush(self):
        pass


async def run_side(messages, tables, per_poll: int = 200):
    from workers.derender.state import Derenderer
    from workers.derender.worker import DerenderHandler
    from workers.kafka.offsets import PartitionOffsets
    from workers.kafka.settings import KafkaSettings

    sink: list = []
    handler = DerenderHandler(KafkaSettings(topic_prefix="b"), Publisher(sink), PartitionOffsets(),
                              Derenderer(tables))
    msgs = [Message("b.chunks", p, o, v, h) for _, p, o, v, h in messages]
    start = time.process_time()
    for i in range(0, len(msgs), per_poll):  # as the consumer loop: a poll's records, then tick
        for m in msgs[i:i + per_poll]:
            await handler.handle(m)
        await handler.tick()
        await asyncio.sleep(0)  # the acks' callbacks
    return time.process_time() - start, sink


def serve(args) -> None:
    """One side, kept up: per line on stdin (a workload), one timed run; a JSON line out."""
    import gc

    from workers.derender.vocab import VocabTables
    from workers.models.tinymodel import build_tokenizer

    tables = VocabTables(build_tokenizer("spm"))
    loaded: dict[str, tuple] = {}
    gc.freeze()  # as the worker does once up (workers/gc_tuning.py)
    for line in sys.stdin:
        workload = line.strip()
        if workload not in loaded:
            shape, text, k = workload.split(":")
            loaded[workload] = build_messages(tables, shape, text, int(k), args.requests, args.tokens,
                                              args.chunk_tokens)
            gc.freeze()
            asyncio.run(run_side(loaded[workload][0], tables))  # warm-up
        messages, tokens = loaded[workload]
        t, sink = asyncio.run(run_side(messages, tables))
        h = hashlib.sha256()
        for topic, key, value, headers in sink:
            h.update(repr((topic, key, value, headers)).encode())
        print(json.dumps({"cpu_s": t, "digest": h.hexdigest(), "tokens": tokens,
                          "records": sum(1 for r in sink if r[0] == "b.results")}), flush=True)


def profile(args) -> None:
    import cProfile
    import pstats

    from workers.derender.vocab import VocabTables
    from workers.models.tinymodel import build_tokenizer

    tables = VocabTables(build_tokenizer("spm"))
    shape, text, k = (args.workload or "chat:cjk:5").split(":")
    messages, _ = build_messages(tables, shape, text, int(k), args.requests, args.tokens, args.chunk_tokens)
    asyncio.run(run_side(messages, tables))
    prof = cProfile.Profile()
    prof.enable()
    asyncio.run(run_side(messages, tables))
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


# --- the parent: both sides, alternating ---------------------------------------------------

def worktree(rev: str) -> Path:
    """A checkout of `rev` under /tmp, made once: ops/bench/throughput.py's, shared."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from ops.bench.throughput import worktree as checkout

    return checkout(rev)


class Side:
    """A `--serve` child running the code at `code`."""

    def __init__(self, code: Path, args):
        cmd = [sys.executable, str(HERE), "--serve", "--requests", str(args.requests), "--tokens", str(args.tokens),
               "--chunk-tokens", str(args.chunk_tokens)]
        env = dict(os.environ, PYTHONPATH=str(code), GENPIPE_BENCH_CODE=str(code))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=str(code))

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", metavar="REV", default="main", help="the code to compare with (git rev)")
    parser.add_argument("--contender", metavar="REV", help="the code to measure, if not this checkout (a worktree "
                        "too: what one commit bought is --reference C^ --contender C)")
    parser.add_argument("--rounds", type=int, default=20, help="timed runs per side and workload, interleaved")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per request")
    parser.add_argument("--chunk-tokens", type=int, default=10)
    parser.add_argument("--only", nargs="*", help="workloads as shape:text:k (default: all)")
    parser.add_argument("--quick", action="store_true", help="2 rounds, 16 requests")
    parser.add_argument("--profile", action="store_true", help="cProfile the contender (see above)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help="--profile: the workload (shape:text:k)")
    args = parser.parse_args(argv)
    if args.serve or args.profile:
        code = os.environ.get("GENPIPE_BENCH_CODE", str(ROOT))
        sys.path.insert(0, code)
        import schemas
        import workers  # the packages of `code`, before ops/bench/derender.py puts ROOT first

        assert all(Path(m.__file__).resolve().is_relative_to(Path(code).resolve()) for m in (schemas, workers))
        (serve if args.serve else profile)(args)
        return 0
    if args.quick:
        args.rounds, args.requests = 4, 16
    ref = worktree(args.reference)
    workloads = args.only or [f"{s}:{t}:{k}" for s, t, k in WORKLOADS]
    print(f"reference {args.reference} ({ref}) vs {args.contender or 'this checkout'}; "
          f"{args.requests} requests x {args.tokens} tokens, "
          f"{args.chunk_tokens} tokens/chunk, streamed; {args.rounds} runs a side, interleaved; CPU time, best run")
    print(f"{'workload':<23} {'records':>7} {'ref us/rec':>10} {'new us/rec':>10} {'ref us/tok':>10} "
          f"{'new us/tok':>10} {'ratio':>6} {'paired':>7}  bytes")
    new = worktree(args.contender) if args.contender else ROOT
    sides = {"ref": Side(ref, args), "new": Side(new, args)}
    same = True
    try:
        for w in workloads:
            times: dict[str, list[float]] = {"ref": [], "new": []}
            digests: dict[str, set] = {"ref": set(), "new": set()}
            for i in range(args.rounds):
                for side in (("ref", "new") if i % 2 == 0 else ("new", "ref")):  # ABBA: no order bias
                    r = sides[side].run(w)
                    times[side].append(r["cpu_s"])
                    digests[side].add(r["digest"])
            records, tokens = r["records"], r["tokens"]
            equal = digests["ref"] == digests["new"] and len(digests["new"]) == 1
            same &= equal
            best = {side: min(t) for side, t in times.items()}
            # the median of the per-pair ratios: each pair ran back to back, under the same load
            pairs = sorted(a / b for a, b in zip(times["ref"], times["new"]))
            print(f"{w:<23} {records:>7} {best['ref'] / records * 1e6:>10.1f} {best['new'] / records * 1e6:>10.1f} "
                  f"{best['ref'] / tokens * 1e6:>10.2f} {best['new'] / tokens * 1e6:>10.2f} "
                  f"{best['ref'] / best['new']:>5.2f}x {pairs[len(pairs) // 2]:>6.2f}x  "
                  f"{'identical' if equal else 'DIFFERENT'}", flush=True)
    finally:
        for side in sides.values():
            side.close()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
