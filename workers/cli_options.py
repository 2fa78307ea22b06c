"""Option parsing the `genpipe` commands share: numbers, topic names, quiet Kafka logs."""

from __future__ import annotations

import argparse
import logging


def at_least(minimum, kind=int):
    """An argparse type: a number of `kind` no smaller than `minimum`, so a bad flag is a
    one-line usage error rather than a traceback from deep inside the worker. Defaults
    from the environment are given as strings, so argparse checks them the same way."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if not value >= minimum:  # also refuses NaN
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {text}")
        return value
    return parse


def int64(text: str) -> int:
    """An argparse type: an integer that fits a record's 64 bits (a larger seed could not
    be encoded: a traceback from the send)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not -(2 ** 63) <= value < 2 ** 63:
        raise argparse.ArgumentTypeError(f"must fit in 64 bits, got {text}")
    return value


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0 (`inf` overflowed a deadline
    into a traceback; `nan` never timed out)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < 1e9:  # (also refuses NaN; 1e9 s is ~32 years)
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0 and below 1e9, got {text}")
    return value


def port_number(minimum: int = 1):
    """An argparse type: a TCP port, `minimum`..65535 (0 where it means "none")."""
    in_range = at_least(minimum)

    def parse(text: str) -> int:
        value = in_range(text)
        if value > 65535:
            raise argparse.ArgumentTypeError(f"must be a port number, at most 65535, got {text}")
        return value
    return parse


def bootstrap_servers(text: str) -> str:
    """An argparse type: Kafka's `host:port[,host:port...]` (IPv6 hosts in brackets; a
    missing port is 9092). A typo (`kafka:9O92`, `:99999`) was a traceback from deep in the
    client's first connection, or only its message, rather than one usage line."""
    entries = [entry.strip() for entry in text.split(",")]
    for entry in entries:
        host, port = entry, None
        if entry.startswith("["):
            end = entry.find("]")
            host, rest = (entry[1:end], entry[end + 1:]) if end > 0 else ("", "")
            if rest and not rest.startswith(":"):
                host = ""
            port = rest[1:] if rest else None
        elif entry.count(":") > 1:  # a bare IPv6 address: no port (aiokafka's reading too)
            host = entry if _is_ip(entry) else ""
        elif ":" in entry:
            host, port = entry.rsplit(":", 1)
        if not host or port is not None and not (port.isdigit() and 1 <= int(port) <= 65535):
            raise argparse.ArgumentTypeError(f"expected host:port[,host:port...] with ports 1..65535, got {text!r}")
    return ",".join(entries)


def _is_ip(text: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(text.split("%", 1)[0])  # (a zone id after %)
        return True
    except ValueError:
        return False


def one_of(*choices: str, fold_case: bool = False):
    """An argparse type: one of `choices` (any case with `fold_case`, given back as the
    choice is spelled). argparse checks `choices=` on flags only, not on a default taken
    from the environment, so a typo in a deployment's GENPIPE_* variable went through
    unchecked; a type checks both. Give the parser `metavar="{a,b}"` for the help."""
    spelled = {(choice.lower() if fold_case else choice): choice for choice in choices}

    def parse(text: str) -> str:
        choice = spelled.get(text.lower() if fold_case else text)
        if choice is None:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {text!r}")
        return choice
    return parse


def add_max_logprobs(parser: argparse.ArgumentParser) -> None:
    """`--max-logprobs`, parsed the same by both workers and the offline derenderers."""
    import os

    from schemas.validation import DEFAULT_MAX_LOGPROBS

    parser.add_argument("--max-logprobs", type=at_least(-1),
                        default=os.environ.get("GENPIPE_MAX_LOGPROBS", str(DEFAULT_MAX_LOGPROBS)),
                        help="largest logprobs/top_logprobs a client may ask for (a completion's "
                             "logprobs=k asks generate for k+1 candidates, so its chunks may carry "
                             "one more entry per position than a chat's); -1 = no cap (env "
                             "GENPIPE_MAX_LOGPROBS; default %(default)s). The same value for both "
                             "workers, replay and file mode.")


def add_worker_group_options(parser: argparse.ArgumentParser) -> None:
    """`--generate-group-id` / `--derender-group-id`: the workers' consumer groups, which
    the gateway's /health and `genpipe submit` look at to tell whether any worker runs."""
    import os

    for role in ("generate", "derender"):
        env = f"GENPIPE_{role.upper()}_GROUP_ID"
        parser.add_argument(f"--{role}-group-id", default=os.environ.get(env), metavar="GROUP",
                            help=f"the {role} workers' consumer group, looked at to tell whether one "
                                 f"runs: their --group-id (env {env}; default <topic-prefix>-{role})")


def worker_groups(args: argparse.Namespace, topic_prefix: str) -> dict[str, str]:
    """Group id -> role, from `add_worker_group_options`' arguments."""
    return {args.generate_group_id or f"{topic_prefix}-generate": "generate",
            args.derender_group_id or f"{topic_prefix}-derender": "derender"}


def stdout_gone() -> int:
    """The reader of stdout went away (`genpipe tail | head`): the command ends quietly,
    exit 0, and the interpreter's own flush at exit finds somewhere to write (it printed
    "Exception ignored ... BrokenPipeError")."""
    import os
    import sys

    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def topic_arg(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError("topic must not be empty")
    return value.strip()


def resolve_topic(settings, value: str | None, default_role: str) -> str:
    """A `--topic` value: a role name (`results`) means that topic of the prefix."""
    from workers.kafka.settings import TOPIC_ROLES

    if value is None:
        return settings.topic(default_role)
    return settings.topic(value) if value in TOPIC_ROLES else value


def quiet_kafka_logs(verbose: bool = False) -> None:
    """aiokafka logs connection errors itself; a command reports them as one line."""
    if not verbose:
        logging.getLogger("aiokafka").setLevel(logging.CRITICAL)


def add_log_level(parser: argparse.ArgumentParser) -> None:
    """`--log-level`, the same for every long-running command."""
    import os

    levels = ("DEBUG", "INFO", "WARNING", "ERROR")
    parser.add_argument("--log-level", default=os.environ.get("GENPIPE_LOG_LEVEL", "INFO"),
                        type=one_of(*levels, fold_case=True), metavar="{" + ",".join(levels) + "}",
                        help="log level, in any case (env GENPIPE_LOG_LEVEL; default %(default)s)")
