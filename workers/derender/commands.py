"""CLI: `genpipe derender` (file mode: chunks in, OpenAI-shaped results out, no Kafka)."""

from __future__ import annotations

import argparse
import os
import sys

from workers.cli_options import add_max_logprobs, at_least, stdout_gone
from workers.derender.stalls import DEFAULT_STALLED_REQUEST_S
from workers.derender.state import DEFAULT_MODEL_NAME
from workers.kafka.settings import MAX_RECORD_BYTES


def add_model_options(p: argparse.ArgumentParser) -> None:
    """--tokenizer and --model-name, with the environment's defaults: the worker's and the
    offline derenders' (file mode, replay), which must render the same records (a replay
    in a deployment's environment rendered a real model's ids with the tiny tokenizer:
    every request a bad chunk)."""
    p.add_argument("--tokenizer", metavar="DIR", default=os.environ.get("GENPIPE_TOKENIZER"),
                   help="local Hugging Face model or tokenizer directory (env GENPIPE_TOKENIZER; default: the "
                        "built-in tiny model's)")
    p.add_argument("--model-name", default=os.environ.get("GENPIPE_MODEL_NAME", DEFAULT_MODEL_NAME),
                   help="`model` of results whose request did not name one (env GENPIPE_MODEL_NAME; default "
                        "%(default)s)")


def add_derender_options(p: argparse.ArgumentParser) -> None:
    """The options every offline derender (file mode, replay) shares with the worker."""
    p.add_argument("--max-record-bytes", type=at_least(1024),
                   default=os.environ.get("GENPIPE_MAX_RECORD_BYTES", str(MAX_RECORD_BYTES)),
                   help="the derender workers' --max-record-bytes (env GENPIPE_MAX_RECORD_BYTES; default "
                        "%(default)s): a result over it becomes the same error result the worker published")
    add_model_options(p)
    add_max_logprobs(p)


def add_stalled_request_option(p: argparse.ArgumentParser) -> None:
    """The worker's and `genpipe replay`'s (which ends the same requests where it did)."""
    p.add_argument("--stalled-request-s", type=at_least(0.0, float),
                   default=os.environ.get("GENPIPE_STALLED_REQUEST_S", f"{DEFAULT_STALLED_REQUEST_S:g}"),
                   help="end a request with an error result and a cancel once no chunk of it came for this "
                        "many seconds of its partition's log time while other requests' chunks went on (env "
                        "GENPIPE_STALLED_REQUEST_S; default %(default)s; 0: never). Until it ends, its first "
                        "chunk pins the partition's commit: a restart replays the partition from there. Log "
                        "time (the chunks' timestamps), not the clock, in which one gap between records counts "
                        "a tenth of this, and 60 s, at most: a worker stopped ages no request, a broker away or "
                        "generate paused ages it by one gap. A request that a generate worker's failover "
                        "restarts waits in the new worker's queue: keep this above the longest such wait "
                        "(docs/design.md §5.5)")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "derender",
        help="turn a file of chunks into OpenAI-shaped results (no Kafka)",
        description=(
            "Read chunk records as JSON lines {\"key\": REQUEST_ID, \"value\": GenerateChunk} "
            "and write result records as JSON lines {\"key\", \"headers\", \"value\"} in the "
            "order a derender worker publishes them. Bad lines are reported on stderr with "
            "their line number and skipped."
        ),
    )
    p.add_argument("--in", dest="input", required=True, metavar="CHUNKS",
                   help="chunk JSON lines; - for stdin")
    p.add_argument("--out", dest="output", default="-", metavar="RESULTS",
                   help="result JSON lines; - for stdout (default)")
    add_derender_options(p)
    p.add_argument("--cancels", metavar="FILE", default=None,
                   help="also write the Cancel records (stop-string matches) as JSON lines")
    p.set_defaults(func=run_derender)


def run_derender(args: argparse.Namespace) -> int:
    from workers.derender.filemode import run
    from workers.derender.state import Derenderer

    tokenizer = args.tokenizer
    if tokenizer is None:
        from workers.models.tinymodel import default_model_dir

        tokenizer = default_model_dir("spm")
    try:
        derenderer = Derenderer(tokenizer, model_name=args.model_name, max_logprobs=args.max_logprobs,
                                max_result_bytes=args.max_record_bytes)
    except (OSError, ValueError) as exc:
        print(f"genpipe derender: cannot load tokenizer {tokenizer}: {exc}", file=sys.stderr)
        return 2

    named = [(flag, path) for flag, path in (("--in", args.input), ("--out", args.output),
                                             ("--cancels", args.cancels)) if path and path != "-"]
    for i, (flag, path) in enumerate(named):  # (--in F --out F: F was emptied, then read as empty)
        for other, other_path in named[i + 1:]:
            if _same_file(path, other_path):
                what = "writing it would destroy what is read" if flag == "--in" else "one would overwrite the other"
                print(f"genpipe derender: {flag} and {other} name the same file, {path}: {what}", file=sys.stderr)
                return 2
    opened = []
    try:
        try:
            source = sys.stdin.buffer if args.input == "-" else _open(args.input, "rb", opened)
            sink = sys.stdout.buffer if args.output == "-" else _open(args.output, "wb", opened)
            cancels = _open(args.cancels, "wb", opened) if args.cancels else None
        except OSError as exc:
            print(f"genpipe derender: {exc}", file=sys.stderr)
            return 2
        name = "stdin" if args.input == "-" else args.input
        try:
            summary = run(derenderer, source, sink, cancels=cancels, source=name,
                          max_record_bytes=args.max_record_bytes)
            sink.flush()
        except BrokenPipeError:
            return stdout_gone()
    finally:
        for f in opened:
            f.close()
    print(f"genpipe derender: {summary.chunks} chunks -> {summary.results} results, "
          f"{summary.cancels} cancels, {summary.bad_lines} bad lines, "
          f"{summary.unfinished} unfinished requests", file=sys.stderr)
    return 1 if summary.bad_lines else 0


def _same_file(a: str, b: str) -> bool:
    """The same regular file (or one not made yet): a device such as /dev/null may be both."""
    try:
        return os.path.samefile(a, b) and os.path.isfile(a)
    except OSError:  # (one does not exist yet)
        return os.path.realpath(a) == os.path.realpath(b)


def _open(path: str, mode: str, opened: list):
    f = open(path, mode)
    opened.append(f)
    return f
