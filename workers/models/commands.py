"""`genpipe model tiny`: build and inspect the built-in tiny model.

Heavy imports (torch, transformers) stay inside the command functions so that
`genpipe --help` starts fast.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def register(subparsers) -> None:
    """Add this module's commands to the top-level `genpipe` subparsers."""
    for add in _COMMANDS:
        add(subparsers)


# --------------------------------------------------------------------------- model tiny


def _add_model(subparsers) -> None:
    model = subparsers.add_parser(
        "model",
        help="build and inspect models (the built-in tiny test model)",
        description="Build and inspect models.",
    )
    model.set_defaults(func=lambda args: _print_help(model))
    model_sub = model.add_subparsers(dest="model_command", metavar="SUBCOMMAND")

    tiny = model_sub.add_parser(
        "tiny",
        help="build the built-in tiny Llama test/demo model",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Build the built-in tiny test/demo model: a ~1.3M parameter LlamaForCausalLM\n"
            "(4 layers, 4 query heads, 2 kv heads) with a 2000-entry BPE tokenizer, both\n"
            "trained offline in seconds on the corpus shipped with genpipe (English, accents,\n"
            "CJK, emoji, code). Builds are deterministic on one machine: same kind and seed,\n"
            "same bytes (another CPU may train other weights).\n"
            "\n"
            "kinds:\n"
            "  spm        SentencePiece/Llama style: Metaspace '▁', byte fallback with the 256\n"
            "             <0xNN> pieces as ordinary vocabulary, <unk>/<s>/</s> = 0/1/2\n"
            "  bytelevel  GPT-2 style byte-level BPE, <|endoftext|> (last id) as bos/eos\n"
            "\n"
            "The result is a Hugging Face directory (config.json, model.safetensors,\n"
            "tokenizer.json, tokenizer_config.json with a chat template, ...) that\n"
            "AutoTokenizer and AutoModelForCausalLM load.\n"
            "\n"
            "Without --out the model goes to the shared cache\n"
            "(${GENPIPE_CACHE_DIR:-~/.cache/genpipe}/models/tiny-<kind>-v<N>), built only if\n"
            "missing; that is the model the demo and tests use by default."
        ),
        epilog="example: genpipe model tiny --out ./tiny-spm --kind spm",
    )
    tiny.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="directory to write the model to (default: the shared cache, seed 0)",
    )
    tiny.add_argument(
        "--kind", choices=("spm", "bytelevel"), default="spm", help="tokenizer flavour (default: spm)"
    )
    tiny.add_argument(
        "--seed", type=int, default=0, help="seed for weight init and training batches (default: 0)"
    )
    tiny.add_argument(
        "--train-steps",
        type=int,
        default=None,
        metavar="N",
        help="training steps on the corpus; 0 keeps random weights (default: the builder's)",
    )
    tiny.add_argument(
        "--force", action="store_true", help="write into --out even if it is not empty"
    )
    tiny.set_defaults(func=_cmd_model_tiny)


def _cmd_model_tiny(args: argparse.Namespace) -> int:
    from workers.models import tinymodel

    started = time.perf_counter()
    if args.out is None:
        if args.seed != 0 or args.train_steps is not None:
            print("genpipe model tiny: --seed/--train-steps need --out", file=sys.stderr)
            return 2
        path = tinymodel.default_model_dir(args.kind)
    else:
        kwargs = {} if args.train_steps is None else {"train_steps": args.train_steps}
        try:
            path = tinymodel.build_tiny_model(
                args.out, kind=args.kind, seed=args.seed, overwrite=args.force, **kwargs
            )
        except FileExistsError as exc:
            print(f"genpipe model tiny: {exc} (use --force to write into it)", file=sys.stderr)
            return 1
    manifest = tinymodel.read_manifest(path) or {}
    print(f"path:        {path.resolve()}")
    print(f"kind:        {manifest.get('kind')}  (seed {manifest.get('seed')})")
    print(f"vocab size:  {manifest.get('vocab_size')}")
    print(f"parameters:  {manifest.get('num_parameters'):,}")
    print(f"final loss:  {manifest.get('final_loss')}")
    print(f"took:        {time.perf_counter() - started:.1f}s")
    return 0


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


# Each entry adds one top-level command; append new ones (e.g. generate-worker) here.
_COMMANDS = [_add_model]
