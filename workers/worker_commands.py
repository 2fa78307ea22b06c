"""`genpipe generate-worker` and `genpipe derender-worker`: the two long-running processes."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from workers.cli_options import add_log_level, add_max_logprobs, at_least, one_of, port_number
from workers.derender.commands import add_model_options, add_stalled_request_option
from workers.generate.stall import ENGINE_STALL_S
from workers.kafka.reply_topics import DEFAULT_PATTERN, ReplyTopicPatternError, reply_topic_rule
from workers.kafka.settings import MAX_RECORD_BYTES, KafkaSettings
from workers.logs import setup_logging


def _pattern(text: str) -> str:
    """An argparse type: a reply-topic pattern that compiles (checked with a sample prefix)."""
    try:
        reply_topic_rule("genpipe", text)
    except ReplyTopicPatternError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text




def _common(parser: argparse.ArgumentParser) -> None:
    KafkaSettings.add_arguments(parser)
    parser.add_argument("--group-id", default=os.environ.get("GENPIPE_GROUP_ID"),
                        help="consumer group (env GENPIPE_GROUP_ID; default <topic-prefix>-generate / "
                             "<topic-prefix>-derender, so deployments with different prefixes never share a group)")
    parser.add_argument("--metrics-port", type=port_number(0), default=os.environ.get("GENPIPE_METRICS_PORT", "0"),
                        help="serve Prometheus metrics on this port (env GENPIPE_METRICS_PORT; 0 = off)")
    add_max_logprobs(parser)
    parser.add_argument("--grace-period", type=at_least(0.0, float), default=None,
                        help="seconds to finish in-flight work after SIGTERM (default 30 for the generate "
                             "worker, 10 for the derender). With the broker gone, the flush and the last "
                             "commit after it wait at most 10 s each; what is not committed then is "
                             "redone by the partitions' next owner")
    parser.add_argument("--commit-interval-ms", type=at_least(1.0, float), default=500.0,
                        help="how often finished work is committed (default %(default)s ms)")
    parser.add_argument("--max-record-bytes", type=at_least(1024),
                        default=os.environ.get("GENPIPE_MAX_RECORD_BYTES", str(MAX_RECORD_BYTES)),
                        help="largest record to publish (env GENPIPE_MAX_RECORD_BYTES; default "
                             "%(default)s, under Kafka's default 1 MiB limit). A chunk or result that "
                             "would be larger is cut or, when it cannot be, replaced by an error for its "
                             "request. Raise it only together with the broker's message.max.bytes, and use one "
                             "value for all workers (and replay): a new owner replays a partition's "
                             "requests by the same rule. At start a worker checks that the topics its "
                             "large records go to and the DLQ take it (their max.message.bytes at "
                             "least this, and the 256 KiB producer batch, plus 512), and stops with "
                             "one line naming the topic if not.")
    parser.add_argument("--reply-topic-pattern", type=_pattern,
                        default=os.environ.get("GENPIPE_REPLY_TOPIC_PATTERN", DEFAULT_PATTERN),
                        help="the topics a request may name as its reply_topic: a regular expression "
                             "that must match the whole name, {prefix} standing for the topic prefix "
                             "(env GENPIPE_REPLY_TOPIC_PATTERN; default %(default)s). The deployment's "
                             "requests, chunks, cancel and dlq topics are never allowed. A request "
                             "outside it gets an invalid_request_error on <prefix>.results. Use the "
                             "same value for both workers. The derender reads a reply topic's own "
                             "max.message.bytes (where the broker lets it describe the topic) and fits "
                             "its batches to it; a result over it ends its request with an error naming "
                             "the limit.")
    parser.add_argument("--event-loop", type=one_of("auto", "uvloop", "asyncio"), metavar="{auto,uvloop,asyncio}",
                        default=os.environ.get("GENPIPE_EVENT_LOOP", "auto"),
                        help="the event loop the worker runs on (env GENPIPE_EVENT_LOOP): uvloop (a "
                             "dependency of genpipe) or Python's own asyncio loop; auto (default) takes "
                             "uvloop where it is installed. The generate worker's loop is callback-heavy "
                             "(engine steps, publish tasks, producer acks): on uvloop it spent 1.04-1.12x "
                             "less CPU per token (BENCHMARKS.md, \"Another CPU, and the workers on "
                             "uvloop\")")
    add_log_level(parser)


def _run_generate(args: argparse.Namespace) -> int:
    from workers.generate.service import GenerateWorkerConfig, run_generate_worker
    from workers.gc_tuning import check_setting as check_gc_setting
    from workers.generate.chunks import ChunkPolicy
    from workers.startup import check_device, check_model_dir

    if args.model:
        check_model_dir(args.model)
    check_device(args.device)
    check_gc_setting()
    setup_logging(args.log_level)
    if args.threads and args.engine_in == "thread":  # a child engine process sets its own
        import torch

        torch.set_num_threads(args.threads)
    settings = KafkaSettings.from_args(args, client_id="genpipe-generate")
    config = GenerateWorkerConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_batch=args.max_batch,
        max_model_len=args.max_model_len, prefill_chunk=args.prefill_chunk, max_logprobs=args.max_logprobs,
        cuda_graphs=args.cuda_graphs, group_id=args.group_id or f"{settings.topic_prefix}-generate",
        grace_s=args.grace_period if args.grace_period is not None else 30.0,
        commit_interval_s=args.commit_interval_ms / 1000, min_step_s=args.min_step_ms / 1000,
        engine_in=args.engine_in, threads=args.threads, max_record_bytes=args.max_record_bytes,
        engine=args.engine, synthetic_step_s=args.step_ms / 1000, synthetic_tokens=args.synthetic_tokens,
        reply_topic_pattern=args.reply_topic_pattern, queue_requests=args.queue_requests,
        queue_tokens=args.queue_tokens, group_instance_id=args.group_instance_id or None, assignor=args.assignor,
        engine_stall_s=args.engine_stall_s,
        policy=ChunkPolicy(max_tokens=args.coalesce_max_tokens, max_delay_s=args.coalesce_max_delay_ms / 1000,
                           max_records_per_s=args.max_chunk_rate, saturated_stretch=args.saturated_stretch))
    return _serve_with_metrics(args, run_generate_worker(settings, config, on_ready=_ready("generate")))


def _run_derender(args: argparse.Namespace) -> int:
    from workers.derender.service import DerenderWorkerConfig, run_derender_worker
    from workers.gc_tuning import check_setting as check_gc_setting
    from workers.startup import check_tokenizer_dir

    if args.tokenizer:
        check_tokenizer_dir(args.tokenizer)
    check_gc_setting()
    setup_logging(args.log_level)
    settings = KafkaSettings.from_args(args, client_id="genpipe-derender")
    config = DerenderWorkerConfig(
        tokenizer=args.tokenizer, model_name=args.model_name, max_logprobs=args.max_logprobs,
        group_id=args.group_id or f"{settings.topic_prefix}-derender",
        grace_s=args.grace_period if args.grace_period is not None else 10.0,
        commit_interval_s=args.commit_interval_ms / 1000, max_record_bytes=args.max_record_bytes,
        reply_topic_pattern=args.reply_topic_pattern, stalled_request_s=args.stalled_request_s)
    return _serve_with_metrics(args, run_derender_worker(settings, config, on_ready=_ready("derender")))


def event_loop_factory(choice: str):
    """The loop factory for `--event-loop`: None is asyncio's default loop. "uvloop" where
    it cannot be imported is an error that says so; "auto" falls back to asyncio."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise SystemExit("--event-loop uvloop: uvloop is not installed (pip install uvloop), "
                             "or run with --event-loop asyncio") from None
        return None
    return uvloop.new_event_loop


def _ready(name: str):
    def announce() -> None:
        from workers.gc_tuning import tune_after_startup

        tune_after_startup()  # start-up is over: what it built leaves the collector's sight
        loop = "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
        logging.getLogger("genpipe").info("%s worker ready (partitions assigned; event loop: %s)", name, loop)
    return announce


def _serve_with_metrics(args: argparse.Namespace, coroutine) -> int:
    if args.metrics_port:
        from workers.metrics import start_metrics_server
        from workers.startup import UsageError

        try:
            start_metrics_server(args.metrics_port)
        except OSError as exc:  # (the port taken: it was a traceback)
            coroutine.close()  # (never run)
            raise UsageError(f"--metrics-port {args.metrics_port}: cannot serve metrics there: {exc}") from None
    try:
        with asyncio.Runner(loop_factory=event_loop_factory(args.event_loop)) as runner:
            code = runner.run(coroutine)
    except KeyboardInterrupt:
        code = 0
    # Everything is flushed and committed by now. Interpreter teardown with torch and
    # transformers loaded takes seconds (measured 2-4 s here), which orchestrators count
    # against the grace period: skip it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def register(sub) -> None:
    gen = sub.add_parser(
        "generate-worker", help="run a generate worker: requests in, token chunks out",
        description="Consume GenerateRequest records from <prefix>.requests and <prefix>.requests.bulk "
                    "(consumer group), run the model with continuous batching, and publish every sampled "
                    "token as GenerateChunk records with integer-id logprobs to <prefix>.chunks. Requests "
                    "wait in a bounded queue and start by priority (lower first), then deadline_ms, then "
                    "arrival; bulk requests are read only while no interactive one waits. Cancels are read "
                    "from <prefix>.cancel; undecodable records go to <prefix>.dlq. SIGTERM: stop taking "
                    "requests, hand the waiting ones back, finish running ones within the grace period, "
                    "commit, exit 0 (requests still running then are re-run by the next owner).")
    gen.add_argument("--model", default=os.environ.get("GENPIPE_MODEL"),
                     help="local Hugging Face causal-LM directory (env GENPIPE_MODEL; default: the "
                          "built-in tiny model, built into the cache on first use)")
    gen.add_argument("--device", default=os.environ.get("GENPIPE_DEVICE", "cpu"),
                     help="cpu, cuda or cuda:N (env GENPIPE_DEVICE; default %(default)s)")
    gen.add_argument("--dtype", default=os.environ.get("GENPIPE_DTYPE", "float32"),
                     type=one_of("float32", "bfloat16", "float16"), metavar="{float32,bfloat16,float16}",
                     help="weights and KV cache dtype; logprobs are computed in float32 either way "
                          "(env GENPIPE_DTYPE; default %(default)s)")
    gen.add_argument("--max-batch", type=at_least(1), default=os.environ.get("GENPIPE_MAX_BATCH", "32"),
                     help="requests decoded together (KV cache rows; env GENPIPE_MAX_BATCH; default %(default)s)")
    gen.add_argument("--max-model-len", type=at_least(1), default=os.environ.get("GENPIPE_MAX_MODEL_LEN"),
                     help="context length (env GENPIPE_MAX_MODEL_LEN, which `serve` reads too; default: the model's)")
    gen.add_argument("--prefill-chunk", type=at_least(1), default=512,
                     help="prompt tokens prefilled per step, so long prompts don't stall decoding")
    gen.add_argument("--cuda-graphs", default=os.environ.get("GENPIPE_CUDA_GRAPHS", "auto"),
                     type=one_of("auto", "off"), metavar="{auto,off}",
                     help="'auto' (default) replays decode-only steps as CUDA graphs on a CUDA device "
                          "(1.3-3x the tokens/s of eager launches on an H200, see BENCHMARKS.md); each "
                          "batch size and key-length bucket is captured the first time it runs. 'off': "
                          "launch every kernel (env GENPIPE_CUDA_GRAPHS)")
    gen.add_argument("--threads", type=at_least(0), default=os.environ.get("GENPIPE_TORCH_THREADS", "0"),
                     help="torch CPU threads (env GENPIPE_TORCH_THREADS; 0 = torch's default). Small "
                          "models on few cores run faster with 1 (see BENCHMARKS.md)")
    gen.add_argument("--engine-in", choices=("process", "thread"), default="process",
                     help="where the model steps: 'process' (default) a child process, so steps never "
                          "wait on the GIL for the Kafka loop (more tokens/s, see BENCHMARKS.md); "
                          "'thread' a thread of the worker process (one process, less memory)")
    gen.add_argument("--engine", choices=("model", "synthetic"), default="model",
                     help="'model' (default) runs --model; 'synthetic' runs no model at all: every step "
                          "takes --step-ms and gives each of up to --max-batch requests a deterministic "
                          "token of the tiny model's vocabulary. A benchmarking tool for the Kafka side "
                          "at GPU-like rates (like vLLM's dummy weights), never for answers")
    gen.add_argument("--step-ms", type=at_least(0.0, float), default=2.0,
                     help="with --engine synthetic: the time one step takes (default %(default)s ms)")
    gen.add_argument("--synthetic-tokens", choices=("hash", "prompt"), default="hash",
                     help="with --engine synthetic: 'hash' (default) a deterministic ordinary token of "
                          "(request id, position); 'prompt' the request's prompt ids over and over, so a "
                          "benchmark's own text (ASCII, CJK) goes through the derender")
    gen.add_argument("--min-step-ms", type=at_least(0.0, float), default=0.0,
                     help="make each engine step last at least this long (default 0: as fast as the model "
                          "runs). For benchmarks and demos: 20 gives the built-in tiny model a real "
                          "model's pace of ~50 tokens/s per request")
    gen.add_argument("--engine-stall-s", type=at_least(0.0, float),
                     default=os.environ.get("GENPIPE_ENGINE_STALL_S", str(ENGINE_STALL_S)),
                     help="the engine is stuck when it makes no step for this long while requests are in "
                          "it and none of its steps waits to be published (env GENPIPE_ENGINE_STALL_S; "
                          "default %(default)s s; 0: never): the worker then stops, exit code 1, and the "
                          "partitions' next owner redoes its requests, instead of them waiting for good "
                          "behind a worker that still looks alive to its group")
    gen.add_argument("--queue-requests", type=at_least(1), default=os.environ.get("GENPIPE_QUEUE_REQUESTS", "1024"),
                     help="requests read ahead and waiting to start, at most (env GENPIPE_QUEUE_REQUESTS; "
                          "default %(default)s). The priority order applies among these; reading pauses "
                          "while the queue is full")
    gen.add_argument("--queue-tokens", type=at_least(1), default=os.environ.get("GENPIPE_QUEUE_TOKENS", "1000000"),
                     help="prompt tokens of the waiting requests, at most (env GENPIPE_QUEUE_TOKENS; "
                          "default %(default)s)")
    gen.add_argument("--group-instance-id", default=os.environ.get("GENPIPE_GROUP_INSTANCE_ID"),
                     help="static group membership (env GENPIPE_GROUP_INSTANCE_ID, e.g. the pod name of a "
                          "StatefulSet; default: none). A worker that restarts within the session timeout "
                          "(30 s) gets its partitions back with no rebalance; one that stops for good "
                          "keeps them unowned until that timeout. Unique per worker")
    gen.add_argument("--assignor", choices=("sticky", "roundrobin"), default="sticky",
                     help="'sticky' (default): a rebalance moves only the partitions it must, and requests "
                          "of partitions that stay keep running. 'roundrobin': aiokafka's default, every "
                          "rebalance restarts every running request (for comparison; ops/bench/fleet.py). "
                          "Use one value for the whole group")
    gen.add_argument("--coalesce-max-tokens", type=at_least(1), default=16,
                     help="at most this many tokens per chunk; tokens that piled up while the producer "
                          "lagged are cut into chunks of this size (default %(default)s)")
    gen.add_argument("--coalesce-max-delay-ms", type=at_least(0.0, float), default=20.0,
                     help="when coalescing, hold a token at most this long (default %(default)s ms)")
    gen.add_argument("--max-chunk-rate", type=at_least(0.0, float),
                     default=os.environ.get("GENPIPE_MAX_CHUNK_RATE", "10000"),
                     help="chunk records per second this worker aims to stay under (env "
                          "GENPIPE_MAX_CHUNK_RATE; default %(default)s; 0 = no rate aim: one chunk per step while the "
                          "producer keeps up). "
                          "Each request then publishes at most every running/rate seconds after its previous "
                          "chunk, and no token waits longer than --coalesce-max-delay-ms: a small batch still publishes every step, a large "
                          "one coalesces tokens, which every record downstream (derender, results) pays "
                          "for once rather than per token")
    gen.add_argument("--saturated-stretch", type=at_least(1.0, float), default=4.0,
                     help="while this worker falls behind its engine (engine steps arrive before the earlier "
                          "ones are published), its chunks become up to this many times rarer and bigger "
                          "(the three limits above stretched together), so each token costs it less CPU until "
                          "it keeps up; the metric genpipe_chunk_stretch shows the current stretch "
                          "(default %(default)s; 1 = never)")
    _common(gen)
    gen.set_defaults(func=_run_generate)

    der = sub.add_parser(
        "derender-worker", help="run a derender worker: chunks in, OpenAI results out",
        description="Consume GenerateChunk records from <prefix>.chunks (consumer group), turn ids into "
                    "text and OpenAI-shaped logprobs (with byte-fallback correction), and publish chat / "
                    "completion results (JSON) to <prefix>.results or the request's reply_topic. Stop "
                    "strings publish a Cancel to <prefix>.cancel.")
    add_model_options(der)
    add_stalled_request_option(der)
    _common(der)
    der.set_defaults(func=_run_derender)
