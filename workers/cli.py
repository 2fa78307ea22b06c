"""The `genpipe` command line.

Every command lives in its own module, which exposes ``register(subparsers)``: it adds
its parser(s) and sets ``func`` (``args -> int`` exit code) as a default. Modules keep
heavy imports (torch, transformers, aiokafka) inside their functions so that
``genpipe --help`` and the light commands start fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Order is the order in `genpipe --help`.
COMMAND_MODULES = [
    "workers.demo",
    "workers.broker.commands",
    "workers.worker_commands",
    "workers.models.commands",
    "workers.derender.commands",
    "workers.client_commands",
    "workers.derender.replay",
    "workers.gateway.commands",
    "schemas.commands",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="genpipe",
        description=(
            "Token-in/token-out LLM inference as a Kafka pipeline. "
            "Generate workers turn token-id requests into token chunks with integer "
            "logprobs; derender workers turn chunks into OpenAI-shaped results."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # command not built yet
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    from workers.startup import StartupError

    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except StartupError as exc:  # one line saying what is wrong and what to do, no traceback
        print(f"genpipe {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
