"""The workers' CPU per token on uvloop against Python's asyncio loop, in one run.

    python ops/bench/event_loop.py --bootstrap-servers 127.0.0.1:9092 [--rounds 8] [--k 0 5]
        [--stages generate derender] [--step-ms 2] [--requests 256] [--tokens 256] [--chunk-tokens 10]

The workers run on uvloop by default (`--event-loop`, workers/worker_commands.py); this
measures what that buys. Each side is a child process of this checkout on its own loop
(`asyncio` or `uvloop`), kept up, running two stages in turn:

- generate: the real engine child (the synthetic engine: --step-ms a step, every request
  in one batch, no model), whose steps come through the pipe and are read on the event
  loop as the worker reads them, the real `GenerateHandler` (chunks of at most
  --chunk-tokens tokens, cut there while the producer has unacknowledged records, as a
  saturated worker's are) and the real `Publisher` with an aiokafka producer, which
  publishes every chunk to a real broker and waits for its acknowledgement. Timed from the
  first request handed over to the last final chunk acknowledged; the engine child's CPU
  is not counted (on a GPU machine that is the model's work), nor the request consumer
  (a request is 256 tokens of work here). Checked: what every request said (its token
  ids and how it ended), identical on both sides.
- derender: the real derender worker's loop (`workers.kafka.runtime.serve`: producer,
  consumer loop, `DerenderHandler`) over chunk records put on the broker once before the
  runs (ops/bench/derender_worker.py's: streamed completions of the synthetic engine's
  ids), read from the start in a new consumer group each run. Timed from its partitions
  being assigned to every result acknowledged. Checked: the number of results.

CPU is the side's own process, every thread, per token. Sides alternate ABBA
(ops/bench/paired.py): on a shared 2-core box a stage's CPU per token drifts by
0.8-1.3x between minutes (BENCHMARKS.md), and the median of back-to-back pairs is the
figure that survives it.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(ROOT))
from engine_read import start_engine  # noqa: E402  (ops/bench/engine_read.py)
from paired import Message, publishing, Side, fixed_chunk_policy, interleaved  # noqa: E402  (ops/bench/paired.py)


async def run_generate(outputs, publisher, settings, k: int, requests: int, tokens: int, chunk_tokens: int) -> dict:
    """The generate stage (see above): one batch of `requests`, timed to the last ack."""
    from aiokafka import TopicPartition

    from schemas import GenerateRequest, SamplingParams, encode, headers_for
    from workers.generate.worker import GenerateHandler
    from workers.kafka.offsets import PartitionOffsets

    offsets = PartitionOffsets()
    handler = GenerateHandler(settings, publisher, offsets, outputs.engine, max_running=requests,
                              policy=fixed_chunk_policy(chunk_tokens))
    outputs.handler = handler
    sent: list = []  # what the requests said, from the records handed to the producer
    take = handler.chunks.take

    def taking(state, final, max_tokens):
        records, message = take(state, final, max_tokens)
        for r in records:
            sent.append((r.key, tuple(r.value.token_ids), r.value.finish_reason))
        return records, message
    handler.chunks.take = taking
    reqs = [GenerateRequest(request_id=f"r-{i}", prompt_token_ids=[1, 5, 6, 7],
                            sampling=SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=k if k else None))
            for i in range(requests)]
    messages = [Message(settings.topic("requests"), i % 8, i // 8, encode(r), headers_for(r), r.request_id.encode())
                for i, r in enumerate(reqs)]
    start = time.process_time()
    for m in messages:  # as the consumer loop: the offset seen, then the handler
        offsets.tracker(TopicPartition(m.topic, m.partition)).seen(m.offset)
        await handler.handle(m)
    while handler.inflight or publishing(handler) or publisher.in_flight:
        await asyncio.sleep(0.005)  # the last acknowledgements (the condition, polled)
    cpu_s = time.process_time() - start
    said: dict[str, list] = {}
    for key, ids, finish in sent:
        said.setdefault(key, []).extend(ids)
        if finish is not None:
            said[key].append(finish)
    digest = hashlib.sha256(repr(sorted(said.items())).encode()).hexdigest()
    return {"cpu_s": cpu_s, "digest": digest, "tokens": requests * tokens, "records": len(sent),
            "failed": publisher.failed}


async def run_derender(derenderer, settings, records: int, tokens: int) -> dict:
    """The real derender worker's loop (`serve`: its producer, consumer loop and handler)
    over the `records` chunk records of `settings`' chunk topic, from the start, in a new
    consumer group; timed from its partitions being assigned to every result acknowledged."""
    from workers.derender.worker import DerenderHandler
    from workers.kafka.runtime import serve as serve_worker

    derenderer.reset()  # the same request ids every run: forget the last run's
    stop, handlers, marks = asyncio.Event(), [], {}

    def make_handler(publisher, offsets):
        handlers.append(DerenderHandler(settings, publisher, offsets, derenderer))
        return handlers[0]

    async def until_done():
        while not handlers or "start" not in marks:
            await asyncio.sleep(0.005)
        handler = handlers[0]
        while derenderer.stats.results < marks["results"] + records or handler._pending \
                or handler.publisher.in_flight:
            await asyncio.sleep(0.005)  # the condition, polled
        marks["cpu_s"] = time.process_time() - marks["start"]
        stop.set()

    marks["results"] = derenderer.stats.results
    done = asyncio.ensure_future(until_done())
    await serve_worker(settings, topic=settings.topic("chunks"), group_id=f"{settings.topic_prefix}-{uuid.uuid4().hex[:8]}",
                       make_handler=make_handler, stop=stop, grace_s=10, worker="derender",
                       on_ready=lambda: marks.setdefault("start", time.process_time()),
                       uses=[settings.topic("results"), settings.topic("cancel")])
    await done
    handler = handlers[0]
    return {"cpu_s": marks["cpu_s"], "digest": str(derenderer.stats.results - marks["results"]), "tokens": tokens,
            "records": records, "failed": handler.publisher.failed}


async def serve(args) -> None:
    """One side on its loop, kept up: per line on stdin (a workload: "generate k=N" or
    "derender k=N"), one timed run; a JSON line out."""
    import gc

    from workers.derender.state import Derenderer
    from workers.kafka.clients import make_producer
    from workers.kafka.publisher import Publisher
    from workers.kafka.settings import KafkaSettings
    from workers.models.tinymodel import default_model_dir

    settings = KafkaSettings(bootstrap_servers=args.bootstrap_servers, topic_prefix=args.prefix)
    outputs = await start_engine(args.step_ms / 1000, args.requests)
    producer = make_producer(settings)
    await producer.start()
    publisher = Publisher(producer, settings.topic("dlq"))
    gc.freeze()  # as the worker does once up (workers/gc_tuning.py)
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    derenderer = Derenderer(str(default_model_dir("spm")))
    warm: set[str] = set()
    try:
        while line := await asyncio.to_thread(sys.stdin.readline):
            stage, k = line.split()[0], int(line.split()[1].split("=")[1])
            for _ in range(1 if line in warm else 2):  # the first run of a workload warms up
                if stage == "generate":
                    result = await run_generate(outputs, publisher, settings, k, args.requests, args.tokens,
                                            args.chunk_tokens)
                else:
                    chunks = KafkaSettings(bootstrap_servers=args.bootstrap_servers, topic_prefix=f"{args.prefix}-d{k}")
                    records = args.requests * -(-args.tokens // args.chunk_tokens)  # as fill_chunks makes them
                    result = await run_derender(derenderer, chunks, records, args.requests * args.tokens)
            warm.add(line)
            print(json.dumps({**result, "loop": loop}), flush=True)
    finally:
        outputs.engine.stop()
        await producer.stop()


def fill_chunks(bootstrap_servers: str, prefix: str, k: int, requests: int, tokens: int, chunk_tokens: int) -> None:
    """The derender stage's input: ops/bench/derender_worker.py's chunk records (completions
    of the synthetic engine's ids, streamed), on `prefix`'s topics, once."""
    from derender_worker import build_messages  # noqa: E402  (ops/bench/derender_worker.py)

    from workers.broker.topics import create_topics
    from workers.derender.vocab import VocabTables
    from workers.kafka.clients import make_producer
    from workers.kafka.settings import KafkaSettings
    from workers.models.tinymodel import build_tokenizer

    settings = KafkaSettings(bootstrap_servers=bootstrap_servers, topic_prefix=prefix)
    messages, _ = build_messages(VocabTables(build_tokenizer("spm")), "completion", "synthetic", k, requests, tokens,
                                 chunk_tokens)

    async def produce():
        await create_topics(settings, partitions=8)
        producer = make_producer(settings)
        await producer.start()
        try:
            for _, partition, _, value, headers in messages:
                await producer.send(settings.topic("chunks"), value, partition=partition, headers=headers)
            await producer.flush()
        finally:
            await producer.stop()
    asyncio.run(produce())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap-servers", default="127.0.0.1:9092")
    parser.add_argument("--rounds", type=int, default=8, help="timed runs per side and workload, interleaved")
    parser.add_argument("--requests", type=int, default=256, help="requests, all in one batch")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per request")
    parser.add_argument("--chunk-tokens", type=int, default=10)
    parser.add_argument("--step-ms", type=float, default=2.0, help="the synthetic engine's step time")
    parser.add_argument("--k", type=int, nargs="+", default=[0, 5], help="logprobs per position, a workload each")
    parser.add_argument("--stages", nargs="+", choices=["generate", "derender"], default=["generate", "derender"])
    parser.add_argument("--serve", choices=["asyncio", "uvloop"], help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        from workers.worker_commands import event_loop_factory

        with asyncio.Runner(loop_factory=event_loop_factory(args.serve)) as runner:
            runner.run(serve(args))
        return 0
    from workers.broker.topics import create_topics
    from workers.kafka.settings import KafkaSettings

    prefix = f"evl-{uuid.uuid4().hex[:6]}"
    asyncio.run(create_topics(KafkaSettings(bootstrap_servers=args.bootstrap_servers, topic_prefix=prefix),
                              partitions=8))
    if "derender" in args.stages:
        for k in args.k:
            fill_chunks(args.bootstrap_servers, f"{prefix}-d{k}", k, args.requests, args.tokens, args.chunk_tokens)
    print(f"{args.requests} requests x {args.tokens} tokens, {args.chunk_tokens} tokens/chunk, {args.step_ms:g} ms "
          f"steps, broker {args.bootstrap_servers} (topics {prefix}*); {args.rounds} runs a side, interleaved; "
          f"the side's own CPU, best run")
    print(f"{'workload':<13} {'asyncio us/tok':>14} {'uvloop us/tok':>13} {'ratio':>6} {'paired':>7}  "
          f"{'records':>8}  what requests said")
    common = ["--bootstrap-servers", args.bootstrap_servers, "--prefix", prefix, "--requests", str(args.requests),
              "--tokens", str(args.tokens), "--chunk-tokens", str(args.chunk_tokens), "--step-ms", str(args.step_ms)]
    # paired.py's "ref" is the reference side: Python's loop; "new" is uvloop
    sides = {"ref": Side(HERE, ROOT, ["asyncio", *common]), "new": Side(HERE, ROOT, ["uvloop", *common])}
    same = True
    try:
        for stage in args.stages:
            for k in args.k:
                r = interleaved(sides, f"{stage} k={k}", args.rounds)
                tokens, best = r["tokens"], r["best"]
                same &= r["identical"] and not r["failed"]
                print(f"{stage + ' k=' + str(k):<13} {best['ref'] / tokens * 1e6:>14.2f} "
                      f"{best['new'] / tokens * 1e6:>13.2f} {best['ref'] / best['new']:>5.2f}x {r['paired']:>6.2f}x  "
                      f"{r['records']:>8}  {'identical' if r['identical'] else 'DIFFERENT'}"
                      f"{', publish failures' if r['failed'] else ''}", flush=True)
    finally:
        for side in sides.values():
            side.close()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
