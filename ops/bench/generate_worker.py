"""The generate worker's CPU per token and per chunk, old code against new, with no broker.

    python ops/bench/generate_worker.py --reference REV [--contender REV] [--rounds 20] [--k 0 5]

Everything the worker's process does for a token except the broker round trips and the
engine itself: the engine's steps as its child sends them on the pipe (msgpack bytes of
`Step`, made once per side, before the timed runs: the synthetic engine, every request
in every step; in code with a token holder on the engine's side, what the holder hands
on, made the same way, each a 2 ms step) are decoded as the worker's pipe reader does and
handed to what it hands them to, the real `EngineOutputs.on_step` (the step's metrics)
and `GenerateHandler.on_outputs`, which turns them into chunk records (in older code the
chunk policy too; `GenerateChunk` structs, msgpack encoding, record size check, headers,
metrics) and publishes them through the real `Publisher.publish_batch` into aiokafka's
own `BatchBuilder`s, which a stand-in producer acknowledges at once (no network, no
sender task). The requests come first, through the real `handle` (decode, validation,
admission, offsets; --prompt-tokens ids each, validated as the engine process's `add`
would). Chunks hold exactly --chunk-tokens tokens (the publisher reports a lagging
producer, so the policy coalesces to its token cap: independent of timing, so both sides
publish the same chunks).

Sides, interleaving, the paired ratio and the byte check are ops/bench/paired.py's: every
chunk record's topic, key, headers and value (its attempt id and sampled time blanked:
random and clock) are hashed, and the two sides must publish identical records.
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
STEP_S = 0.002  # each step's time, as the engine reports it (the metrics observe it)
sys.path.insert(0, str(HERE.parent))
from paired import Message, publishing, compare, engine_pipe, fixed_chunk_policy, use_code, worktree  # noqa: E402  (ops/bench/paired.py)


# --- a child: one side, its runs timed ----------------------------------------------------

class Engine:
    """The handler's view of the engine process (EngineProcess): requests are validated
    against the synthetic engine's limits and sent (encoded) to the child; here the steps
    were made beforehand, so nothing is sent."""

    failure = None

    def __init__(self):
        from schemas.validation import validate_request
        from workers.generate.engine_thread import engine_limits
        from workers.generate.synthetic import SyntheticEngine

        self._encode, _, self._add, _ = engine_pipe()
        self._validate, self._limits = validate_request, engine_limits(SyntheticEngine())

    def validate(self, request) -> None:
        self._validate(request, **self._limits)

    def add(self, request, *, validated: bool = False, tier: int = 0) -> None:  # (before `validated`: False)
        if not validated:
            self.validate(request)
        self._encode(self._add(request))

    def abort(self, request_id: str, reason: str = "abort") -> None:
        pass

    def tune(self, lagging: bool, stretch: float) -> None:  # (the holder ran when the steps were made)
        pass


class Producer:
    """What `Publisher` uses of an AIOKafkaProducer, with aiokafka's own batch builder: a
    sent batch is acknowledged at once and its records (topic, key, value, headers) kept."""

    def __init__(self, sink: list):
        from types import SimpleNamespace

        from aiokafka.producer.message_accumulator import BatchBuilder

        class Batch(BatchBuilder):
            def __init__(self):
                super().__init__(256 * 1024, 0, is_transactional=0)  # the workers' max_batch_size
                self.kept = []

            def append(self, *, timestamp, key, value, headers=()):
                appended = super().append(timestamp=timestamp, key=key, value=value, headers=headers)
                if appended is not None:
                    self.kept.append((key, value, headers))
                return appended

        self.sink, self.create_batch = sink, Batch
        # (no broker to describe a topic's max.message.bytes: no node, no limits; every
        # topic known, and tracked when the publisher asks: workers/kafka/topic_metadata.py)
        self.client = SimpleNamespace(cluster=SimpleNamespace(partitions_for_topic=lambda topic: set(range(8))),
                                      get_random_node=lambda: None, add_topic=lambda topic: None)

    async def send_batch(self, batch, topic: str, partition: int):
        self.sink.extend((topic, key, value, headers) for key, value, headers in batch.kept)
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


def build(k: int, requests: int, tokens: int, prompt_tokens: int, chunk_tokens: int):
    """The request records, and the engine's steps as pipe bytes: as the engine process
    sends them, so in code with a token holder on the engine's side (workers/generate/
    token_holder.py) what it hands on, with the side's chunk policy and a lagging producer."""
    from schemas import GenerateRequest, SamplingParams, encode, headers_for
    from workers.generate.synthetic import SyntheticEngine

    try:
        from workers.generate.token_holder import TokenHolder
    except ImportError:  # code from before the holder: the worker takes every token
        holder = None
    else:
        holder = TokenHolder(fixed_chunk_policy(chunk_tokens))
        holder.tune(lagging=True, stretch=1.0)

    prompt = [1] + [5 + (7 * j) % 1900 for j in range(prompt_tokens - 1)]
    reqs = [GenerateRequest(request_id=f"gen-{i}", prompt_token_ids=prompt,
                            sampling=SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=k if k else None))
            for i in range(requests)]
    messages = [("b.requests", i % 8, i // 8, encode(r), headers_for(r), r.request_id.encode())
                for i, r in enumerate(reqs)]
    engine = SyntheticEngine(step_s=0.0, max_batch=requests)
    for r in reqs:
        engine.add(r)
    pipe_encode, _, _, Step = engine_pipe()
    steps = []
    while engine.has_work():
        step = engine.step()
        if holder is not None:
            step = holder.step(step, time.monotonic())
        if step:
            steps.append(pipe_encode(Step(step, STEP_S)))
    return messages, steps, requests * tokens


async def run_side(messages, steps, chunk_tokens: int):
    from aiokafka import TopicPartition

    from workers.generate.service import EngineOutputs
    from workers.generate.worker import GenerateHandler
    from workers.kafka.offsets import PartitionOffsets
    from workers.kafka.settings import KafkaSettings

    sink: list = []
    offsets = PartitionOffsets()
    policy = fixed_chunk_policy(chunk_tokens)
    from workers.kafka.publisher import Publisher

    publisher = Publisher(Producer(sink), "b.dlq")
    publisher.in_flight = 10**12  # a lagging producer, whatever is acknowledged: see above
    handler = GenerateHandler(KafkaSettings(topic_prefix="b"), publisher, offsets,
                              Engine(), max_running=len(messages), policy=policy)
    reader = EngineOutputs(asyncio.get_running_loop())  # what the pipe reader hands each step to
    reader.engine, reader.handler = handler.engine, handler
    msgs = [Message(*m) for m in messages]
    _, decode, _, _ = engine_pipe()
    start = time.process_time()
    for m in msgs:  # as the consumer loop: the offset seen, then the handler
        offsets.tracker(TopicPartition(m.topic, m.partition)).seen(m.offset)
        await handler.handle(m)
    for data in steps:
        step = decode(data)  # the pipe reader's decode and handling (the step's metrics, the handler), on the loop
        reader.on_step(step.outputs, step.step_s)
        while publishing(handler):  # the step's publish task
            await asyncio.sleep(0)
    return time.process_time() - start, sink


def digest(sink) -> str:
    from schemas import GenerateChunk
    from schemas.codec import decode_record, encode

    h = hashlib.sha256()
    for topic, key, value, headers in sink:
        chunk = decode_record(value, headers, GenerateChunk)
        chunk.attempt, chunk.sampled_at_ns = "", 0
        h.update(repr((topic, key, encode(chunk), headers)).encode())
    return h.hexdigest()


def serve(args) -> None:
    """One side, kept up: per line on stdin (a workload: k), one timed run; a JSON line out."""
    import gc

    loaded: dict[str, tuple] = {}
    gc.freeze()  # as the worker does once up (workers/gc_tuning.py)
    for line in sys.stdin:
        workload = line.strip()
        if workload not in loaded:
            loaded[workload] = build(int(workload.split("=")[1]), args.requests, args.tokens, args.prompt_tokens,
                                     args.chunk_tokens)
            gc.freeze()
            asyncio.run(run_side(*loaded[workload][:2], args.chunk_tokens))  # warm-up
        messages, steps, tokens = loaded[workload]
        t, sink = asyncio.run(run_side(messages, steps, args.chunk_tokens))
        print(json.dumps({"cpu_s": t, "digest": digest(sink), "tokens": tokens, "records": len(sink)}), flush=True)


# --- the parent: both sides, alternating ---------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", metavar="REV", default="main", help="the code to compare with (git rev)")
    parser.add_argument("--contender", metavar="REV", help="the code to measure, if not this checkout (a worktree "
                        "too: what one commit bought is --reference C^ --contender C)")
    parser.add_argument("--rounds", type=int, default=20, help="timed runs per side and workload, interleaved")
    parser.add_argument("--requests", type=int, default=256, help="requests, all in one batch")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--chunk-tokens", type=int, default=10)
    parser.add_argument("--prompt-tokens", type=int, default=4, help="prompt ids per request (validated on the way)")
    parser.add_argument("--k", type=int, nargs="+", default=[0, 5], help="logprobs per position, a workload each")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        use_code()
        serve(args)
        return 0
    ref = worktree(args.reference)
    new = worktree(args.contender) if args.contender else HERE.parents[2]
    print(f"reference {args.reference} ({ref}) vs {args.contender or 'this checkout'}; {args.requests} requests x "
          f"{args.tokens} tokens in one batch, {args.prompt_tokens} prompt ids each, {args.chunk_tokens} tokens/chunk; {args.rounds} runs a side, "
          f"interleaved; CPU time, best run")
    print(f"{'workload':<9} {'chunks':>7} {'ref us/chunk':>12} {'new us/chunk':>12} {'ref us/tok':>10} "
          f"{'new us/tok':>10} {'ratio':>6} {'paired':>7}  chunks")
    child_args = ["--requests", str(args.requests), "--tokens", str(args.tokens),
                  "--chunk-tokens", str(args.chunk_tokens), "--prompt-tokens", str(args.prompt_tokens)]
    def row(workload: str, r: dict) -> str:
        records, tokens, best = r["records"], r["tokens"], r["best"]
        return (f"{workload:<9} {records:>7} {best['ref'] / records * 1e6:>12.1f} "
                f"{best['new'] / records * 1e6:>12.1f} {best['ref'] / tokens * 1e6:>10.2f} "
                f"{best['new'] / tokens * 1e6:>10.2f} {best['ref'] / best['new']:>5.2f}x {r['paired']:>6.2f}x")

    return compare(HERE, ref, new, child_args, [f"k={k}" for k in args.k], args.rounds, row)


if __name__ == "__main__":
    sys.exit(main())
