"""The generate worker's CPU to take engine steps from its engine child, old code against new.

    python ops/bench/engine_read.py --reference REV [--contender REV] [--rounds 10] [--k 0 5]
        [--step-ms 2] [--requests 256] [--tokens 256]

Each side runs the real engine child process of its code (the synthetic engine: --step-ms
a step, every request in one batch, no model), whose steps come through the pipe and are
read as that code's worker reads them (a reader thread, or the event loop), and handed to
the real `GenerateHandler`; its chunk records go to ops/bench/paired.py's stand-in
publisher, which acknowledges at once (no broker). Timed: this process's CPU, every
thread, from the first request handed over to the last final chunk, per token; the
child's is not counted (on a GPU machine that is the model's work). Chunks hold at most
--chunk-tokens tokens (the publisher reports a lagging producer); how many a chunk holds
depends on timing, so the byte check is on what each request says: its token ids and
how it finished, which both sides must publish identically.

Sides, interleaving and the paired ratio are ops/bench/paired.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
from paired import Message, publishing, Publisher, compare, fixed_chunk_policy, use_code, worktree  # noqa: E402  (ops/bench/paired.py)


async def start_engine(step_s: float, max_batch: int):
    """This code's engine child and the worker's link to it, wired as its service does."""
    from workers.generate.engine_process import EngineProcess
    from workers.generate.service import EngineOutputs

    options = {"synthetic": dict(step_s=step_s, max_batch=max_batch, vocab_size=2000, max_model_len=4096,
                                 max_logprobs=20, tokens="hash")}
    outputs = EngineOutputs(asyncio.get_running_loop())
    if hasattr(EngineProcess, "read_steps"):  # read on the event loop
        outputs.engine = EngineProcess(options, outputs.on_step, max_steps_waiting=outputs.max_steps_waiting)
        await asyncio.to_thread(outputs.engine.start)
        await outputs.engine.read_steps()
    else:  # a reader thread
        outputs.engine = EngineProcess(options, outputs.deliver)
        await asyncio.to_thread(outputs.engine.start)
    return outputs


async def run_side(outputs, k: int, requests: int, tokens: int, chunk_tokens: int) -> dict:
    from aiokafka import TopicPartition

    from schemas import GenerateChunk, GenerateRequest, SamplingParams, decode_record, encode, headers_for
    from workers.generate.worker import GenerateHandler
    from workers.kafka.offsets import PartitionOffsets
    from workers.kafka.settings import KafkaSettings

    sink: list = []
    offsets = PartitionOffsets()
    policy = fixed_chunk_policy(chunk_tokens)
    handler = GenerateHandler(KafkaSettings(topic_prefix="b"), Publisher(sink, in_flight=10**12), offsets,
                              outputs.engine, max_running=requests, policy=policy)
    outputs.handler = handler
    reqs = [GenerateRequest(request_id=f"gen-{i}", prompt_token_ids=[1, 5, 6, 7],
                            sampling=SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=k if k else None))
            for i in range(requests)]
    messages = [Message("b.requests", i % 8, i // 8, encode(r), headers_for(r), r.request_id.encode())
                for i, r in enumerate(reqs)]
    start = time.process_time()
    for m in messages:  # as the consumer loop: the offset seen, then the handler
        offsets.tracker(TopicPartition(m.topic, m.partition)).seen(m.offset)
        await handler.handle(m)
    while handler.inflight or publishing(handler):
        await asyncio.sleep(0.005)
    cpu_s = time.process_time() - start
    said: dict[str, list] = {}
    for _, _, value, headers in sink:
        chunk = decode_record(value, headers, GenerateChunk)
        said.setdefault(chunk.request_id, []).extend(chunk.token_ids)
        if chunk.finish_reason is not None:
            said[chunk.request_id].append(chunk.finish_reason)
    digest = hashlib.sha256(repr(sorted(said.items())).encode()).hexdigest()
    return {"cpu_s": cpu_s, "digest": digest, "tokens": requests * tokens, "records": len(sink)}


async def serve(args) -> None:
    """One side, kept up: its engine child started once; per line on stdin (a workload:
    k), one timed run; a JSON line out."""
    import gc

    outputs = await start_engine(args.step_ms / 1000, args.requests)
    gc.freeze()  # as the worker does once up (workers/gc_tuning.py)
    warm: set[str] = set()
    try:
        while line := await asyncio.to_thread(sys.stdin.readline):
            k = int(line.strip().split("=")[1])
            if k not in warm:
                await run_side(outputs, k, args.requests, args.tokens, args.chunk_tokens)
                warm.add(k)
            print(json.dumps(await run_side(outputs, k, args.requests, args.tokens, args.chunk_tokens)), flush=True)
    finally:
        outputs.engine.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", metavar="REV", default="main", help="the code to compare with (git rev)")
    parser.add_argument("--contender", metavar="REV", help="the code to measure, if not this checkout")
    parser.add_argument("--rounds", type=int, default=10, help="timed runs per side and workload, interleaved")
    parser.add_argument("--requests", type=int, default=256, help="requests, all in one batch")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per request")
    parser.add_argument("--chunk-tokens", type=int, default=10)
    parser.add_argument("--step-ms", type=float, default=2.0, help="the synthetic engine's step time")
    parser.add_argument("--k", type=int, nargs="+", default=[0, 5], help="logprobs per position, a workload each")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        use_code()
        asyncio.run(serve(args))
        return 0
    ref = worktree(args.reference)
    new = worktree(args.contender) if args.contender else HERE.parents[2]
    print(f"reference {args.reference} ({ref}) vs {args.contender or 'this checkout'}; {args.requests} requests x "
          f"{args.tokens} tokens in one batch, {args.step_ms:g} ms steps, at most {args.chunk_tokens} tokens/chunk; "
          f"{args.rounds} runs a side, interleaved; this process's CPU, best run")
    print(f"{'workload':<9} {'ref us/tok':>10} {'new us/tok':>10} {'ratio':>6} {'paired':>7}  {'chunks (last run)':>18}  "
          f"what requests said")
    child_args = ["--requests", str(args.requests), "--tokens", str(args.tokens),
                  "--chunk-tokens", str(args.chunk_tokens), "--step-ms", str(args.step_ms)]
    def row(workload: str, r: dict) -> str:
        tokens, best = r["tokens"], r["best"]
        return (f"{workload:<9} {best['ref'] / tokens * 1e6:>10.2f} {best['new'] / tokens * 1e6:>10.2f} "
                f"{best['ref'] / best['new']:>5.2f}x {r['paired']:>6.2f}x  {r['records']:>18}")

    return compare(HERE, ref, new, child_args, [f"k={k}" for k in args.k], args.rounds, row)


if __name__ == "__main__":
    sys.exit(main())
