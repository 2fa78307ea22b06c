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
import sys
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE.parent))
from paired import Message, Publisher, compare, use_code, worktree  # noqa: E402  (ops/bench/paired.py)

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
        chunks = synthetic_chunks(tables.size, k + (shape == "completion") if k else 0, requests, tokens,
                                  chunk_tokens)
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


def synthetic_chunks(vocab: int, candidates: int, requests: int, tokens: int, chunk_tokens: int):
    """The synthetic engine's chunks with `candidates` entries a position (generate's count:
    k for chat, k + 1 for a completion; 0: no logprobs). Chat's used to carry k + 1 too."""
    from schemas.records import GenerateChunk, GenerateLogProb, GenerateLogProbs, GenerateLogProbsContent
    from workers.generate.synthetic import synthetic_token

    per_request = []
    n = candidates
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


async def run_side(messages, tables, per_poll: int = 200):
    from aiokafka import TopicPartition

    from workers.derender.state import Derenderer
    from workers.derender.worker import DerenderHandler
    from workers.kafka.offsets import PartitionOffsets
    from workers.kafka.settings import KafkaSettings

    sink: list = []
    offsets = PartitionOffsets()
    handler = DerenderHandler(KafkaSettings(topic_prefix="b"), Publisher(sink), offsets, Derenderer(tables))
    msgs = [Message("b.chunks", p, o, v, h) for _, p, o, v, h in messages]
    start = time.process_time()
    for i in range(0, len(msgs), per_poll):  # as the consumer loop: a poll's records, then tick
        for m in msgs[i:i + per_poll]:
            offsets.tracker(TopicPartition(m.topic, m.partition)).seen(m.offset)  # (the loop's tracker: holds count)
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
    import gc
    import pstats

    from workers.derender.vocab import VocabTables
    from workers.models.tinymodel import build_tokenizer

    tables = VocabTables(build_tokenizer("spm"))
    shape, text, k = (args.workload or "chat:cjk:5").split(":")
    messages, _ = build_messages(tables, shape, text, int(k), args.requests, args.tokens, args.chunk_tokens)
    asyncio.run(run_side(messages, tables))
    gc.freeze()  # as `serve`: else collections of this process's own records show up in random lines
    prof = cProfile.Profile()
    prof.enable()
    asyncio.run(run_side(messages, tables))
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


# --- the parent: both sides, alternating ---------------------------------------------------

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
        use_code()  # the packages of the side's code, before ops/bench/derender.py puts ROOT first
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
    child_args = ["--requests", str(args.requests), "--tokens", str(args.tokens),
                  "--chunk-tokens", str(args.chunk_tokens)]
    def row(workload: str, r: dict) -> str:
        records, tokens, best = r["records"], r["tokens"], r["best"]
        return (f"{workload:<23} {records:>7} {best['ref'] / records * 1e6:>10.1f} {best['new'] / records * 1e6:>10.1f} "
                f"{best['ref'] / tokens * 1e6:>10.2f} {best['new'] / tokens * 1e6:>10.2f} "
                f"{best['ref'] / best['new']:>5.2f}x {r['paired']:>6.2f}x")

    return compare(HERE, ref, new, child_args, workloads, args.rounds, row)


if __name__ == "__main__":
    sys.exit(main())
