"""CLI: `genpipe submit`, `genpipe tail`, `genpipe replay` (the user's side of the pipeline).

Heavy imports (aiokafka, transformers, the derender tables) stay inside the command
functions so that `genpipe --help` starts fast.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from workers.startup import one_line as _one_line
from workers.cli_options import (add_worker_group_options, at_least, int64, quiet_kafka_logs, resolve_topic,
                                 seconds, stdout_gone, topic_arg, worker_groups)
from workers.kafka.settings import KafkaSettings

_SUBMIT_EPILOG = """\
examples:
  genpipe submit --prompt "Once upon a time" --max-tokens 32
  genpipe submit --chat "system: You are terse." --chat "user: Hello!" --temperature 0
  genpipe submit --token-ids 1,306,468 --no-stream --logprobs 2 --json
  genpipe submit --chat-file messages.json --stop "\\n" --include-usage -v

The prompt is rendered with the model's tokenizer (--tokenizer): --prompt as a
completion prompt (with BOS), --chat/--chat-file with its chat template and the
generation prompt. --token-ids is sent as is.

Logprobs follow OpenAI: for a completion, --logprobs K returns the sampled token and
the top K per position; for a chat, --logprobs turns them on and --top-logprobs K lists
K candidates per position.

Exit status: 0 on a complete answer, 1 on an error result, an aborted one (its
deadline passed, a cancel: what it had is printed), a timeout or a Kafka failure (one
line on stderr), 2 on bad arguments.
"""

_TAIL_EPILOG = """\
Each record is printed as one JSON line:
  {"key": ..., "headers": {...}, "value": ..., "topic": ..., "partition": ..., "offset": ..., "timestamp": ...}
JSON values are printed as they are; msgpack values (requests, chunks) are converted.

examples:
  genpipe tail                                   # new results, until Ctrl-C
  genpipe tail --request-id 42 --from-beginning --until-final
  genpipe tail --topic chunks --from-beginning --idle-exit 2 > chunks.jsonl
"""

def register(subparsers) -> None:
    _add_submit(subparsers)
    _add_tail(subparsers)


# ---------------------------------------------------------------------------------- submit


def _token_ids(value: str) -> list[int]:
    try:
        ids = [int(part) for part in value.replace(" ", ",").split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _chat_message(value: str) -> dict:
    # Only a chat role in front is one: "Q: what is 2+2?" was sent as role "Q" (a user
    # message the template then rendered as some other speaker), with no error
    role, sep, text = value.partition(":")
    if not sep or role.strip().lower() not in CHAT_ROLES:
        return {"role": "user", "content": value}
    return {"role": role.strip().lower(), "content": text[1:] if text.startswith(" ") else text}


def _max_tokens(value: str) -> int | None:
    if value.lower() in ("none", "max"):
        return None
    number = int64(value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be at least 1 (or 'none' for the model's context)")
    return number


def _add_submit(subparsers) -> None:
    p = subparsers.add_parser(
        "submit",
        help="send one request and print the answer as it streams",
        description="Send one request to the pipeline and print its answer as it streams in.",
        epilog=_SUBMIT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prompt = p.add_argument_group("prompt (exactly one of --prompt, --chat, --chat-file, --token-ids)")
    source = prompt.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT", help="completion prompt text")
    source.add_argument("--chat", metavar="'ROLE: TEXT'", action="append", type=_chat_message,
                        help="a chat message, e.g. 'user: Hello!' (repeatable, in order; the roles: "
                             f"{', '.join(CHAT_ROLES)}; anything else is all a user's text)")
    source.add_argument("--chat-file", metavar="FILE",
                        help='JSON chat messages: [{"role": ..., "content": ...}, ...] or '
                             '{"messages": [...]}; - for stdin')
    source.add_argument("--token-ids", metavar="1,2,3", type=_token_ids,
                        help="prompt token ids, sent as they are")
    prompt.add_argument("--kind", choices=("chat", "completion"), default=None,
                        help="result shape (default: chat for --chat/--chat-file, else completion)")
    prompt.add_argument("--tokenizer", metavar="DIR", default=os.environ.get("GENPIPE_TOKENIZER"),
                        help="the workers' model/tokenizer directory, to render the prompt with "
                             "(env GENPIPE_TOKENIZER; default: the built-in tiny spm model)")

    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=_max_tokens, default=64, metavar="N",
                   help="most tokens to generate; 'none' = until the context is full (default: 64)")
    s.add_argument("--min-tokens", type=int64, default=0, metavar="N",
                   help="generate at least N tokens before EOS/stop tokens count (default: 0)")
    s.add_argument("--temperature", type=float, default=1.0,
                   help="0 = greedy (default: 1.0)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    s.add_argument("--top-k", type=int64, default=0, help="keep the K most likely tokens; 0 = off (default: 0)")
    s.add_argument("--min-p", type=float, default=0.0, help="minimum probability relative to the top token (default: 0)")
    s.add_argument("--seed", type=int64, default=None, help="per-request sampling seed (reproducible output)")
    s.add_argument("--stop-token-id", type=int64, action="append", default=[], metavar="ID",
                   help="stop when this token id is sampled (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    s.add_argument("--logprobs", type=int64, nargs="?", const=0, default=None, metavar="K",
                   help="completion: the sampled token and the top K per position; "
                        "chat: turn logprobs on (K = top_logprobs when --top-logprobs is absent)")
    s.add_argument("--top-logprobs", type=int64, default=None, metavar="K",
                   help="chat: K candidates per position (implies --logprobs)")
    s.add_argument("--prompt-logprobs", type=int64, default=None, metavar="K",
                   help="vLLM's prompt_logprobs field in a non-streamed result (--no-stream): per prompt "
                        "token its logprob, rank and text, with the top K candidates")

    o = p.add_argument_group("output")
    o.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="stream the answer chunk by chunk (default: --stream)")
    o.add_argument("--include-usage", action="store_true",
                   help="usage on the last streamed record (non-streamed results always have it)")
    o.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string, matched on the text (repeatable)")
    o.add_argument("--include-stop-str-in-output", action="store_true",
                   help="keep the matched stop string (or stop token) in the text")
    o.add_argument("--skip-special-tokens", action=argparse.BooleanOptionalAction, default=True,
                   help="leave special tokens out of the text (default: skip)")
    o.add_argument("--model", default=None, help="`model` reported in the results")

    d = p.add_argument_group("delivery")
    d.add_argument("--request-id", default=None, help="request id (default: a new uuid)")
    d.add_argument("--reply-topic", type=topic_arg, default=None, metavar="TOPIC",
                   help="topic for the results (must exist; default: <prefix>.results)")
    d.add_argument("--deadline-s", type=seconds, default=None, metavar="S",
                   help="abort generation S seconds from now (finish_reason=abort)")
    d.add_argument("--priority", type=int64, default=0, help="request priority (default: 0)")
    d.add_argument("--timeout", type=seconds, default=120.0, metavar="S",
                   help="give up when no result arrives for S seconds (default: 120)")

    r = p.add_argument_group("printing")
    r.add_argument("--json", action="store_true",
                   help="print the raw result records, one JSON line each, instead of the text")
    r.add_argument("-v", "--verbose", action="store_true",
                   help="print the request id, finish reason and usage on stderr")
    add_worker_group_options(p)
    KafkaSettings.add_arguments(p)
    p.set_defaults(func=run_submit)


def _load_chat_file(path: str) -> list[dict]:
    import json

    text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    data = json.loads(text)
    if isinstance(data, dict):
        data = data.get("messages")
    if not isinstance(data, list) or not all(isinstance(m, dict) and "role" in m for m in data):
        raise ValueError(f"{path}: expected a JSON list of {{\"role\", \"content\"}} messages "
                         "(or an object with \"messages\")")
    return data


def run_submit(args: argparse.Namespace) -> int:
    from workers.client import make_request, render_chat, render_prompt

    def fail(message: str, code: int = 2) -> int:
        print(f"genpipe submit: {message}", file=sys.stderr)
        return code

    if args.reply_topic:  # (before the tokenizer loads; a doubtful one is the client's warning)
        from workers.kafka.reply_topics import check_client_reply_topic

        try:
            check_client_reply_topic(args.reply_topic, args.topic_prefix, warn=False)
        except ValueError as exc:
            return fail(_one_line(exc))
    kind = args.kind or ("chat" if (args.chat or args.chat_file) else "completion")
    if args.token_ids is not None:
        ids = args.token_ids
    else:
        tokenizer = args.tokenizer
        if tokenizer is None:
            from workers.models.tinymodel import default_model_dir

            tokenizer = str(default_model_dir("spm"))
        try:
            if args.prompt is not None:
                ids = render_prompt(tokenizer, args.prompt)
            else:
                messages = args.chat if args.chat else _load_chat_file(args.chat_file)
                ids = render_chat(tokenizer, messages)
        except (OSError, ValueError) as exc:
            return fail(_one_line(exc))
        except Exception as exc:  # a template error, a bad tokenizer dir ...
            return fail(f"cannot render the prompt with {tokenizer}: {_one_line(exc)}")
        if not ids:
            return fail("the prompt rendered to no tokens")
    try:
        request = make_request(
            ids, kind=kind, request_id=args.request_id, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
            stop=args.stop, stop_token_ids=args.stop_token_id, ignore_eos=args.ignore_eos,
            logprobs=args.logprobs, top_logprobs=args.top_logprobs, prompt_logprobs=args.prompt_logprobs,
            stream=args.stream, include_usage=args.include_usage,
            include_stop_str_in_output=args.include_stop_str_in_output,
            skip_special_tokens=args.skip_special_tokens, model=args.model, reply_topic=args.reply_topic,
            deadline_s=args.deadline_s, priority=args.priority)
    except ValueError as exc:
        return fail(_one_line(exc))
    quiet_kafka_logs(args.verbose)
    try:
        return asyncio.run(_submit(args, request))
    except BrokenPipeError:
        return stdout_gone()


async def _submit(args: argparse.Namespace, request) -> int:
    from aiokafka.errors import KafkaError

    from schemas.headers import HEADER_ERROR
    from workers.client import (GenpipeClient, GenpipeError, assemble, raise_for_error, record_json,
                                text_of)
    from workers.kafka.clients import KafkaUnreachable
    from workers.kafka.settings import KafkaSettings

    settings = KafkaSettings.from_args(args, client_id="genpipe-submit")
    out, err = sys.stdout, sys.stderr
    if args.verbose:
        print(f"genpipe submit: request {request.request_id} ({len(request.prompt_token_ids)} prompt tokens)",
              file=err)
    items = []
    printed, code = False, 0
    answered = asyncio.Event()
    watcher = asyncio.ensure_future(_while_waiting(settings, worker_groups(args, settings.topic_prefix),
                                                   request.request_id, answered, err, args.timeout))
    try:
        async with GenpipeClient(settings=settings, reply_topic=args.reply_topic, timeout_s=args.timeout) as client:
            async for record in client.records(request):
                answered.set()
                last = record
                if record.restart:
                    items.clear()
                    if not args.json:
                        err.write(f"\n[genpipe: request {record.request_id} restarted (attempt "
                                  f"{record.attempt}); its answer starts over]\n")
                        if printed:
                            out.write("\n")
                items.append(record.value)
                if args.json:
                    out.write(record_json(_RecordView(record)).decode() + "\n")
                    out.flush()
                    continue
                text = text_of(record.value)
                if text:
                    out.write(text)
                    out.flush()
                    printed = True
            if not args.json:
                out.write("\n")
                out.flush()
            final = assemble(items)
            raise_for_error(final, request.request_id)
            choice = final.choices[0] if getattr(final, "choices", None) else None
            if choice is not None and choice.finish_reason == "abort":  # (the deadline passed, a cancel)
                why = last.header(HEADER_ERROR)
                print(f"genpipe submit: request {request.request_id} was aborted"
                      + (f": {_one_line(Exception(why))}" if why else ""), file=err)
                code = 1  # not a complete answer (a script took it for one)
    except GenpipeError as exc:
        if printed and not args.json:
            out.write("\n")
        message = str(exc) if exc.type == "timeout" else f"error ({exc.type}): {exc.message}"
        print(f"genpipe submit: {_one_line(Exception(message))}", file=err)
        return 1
    except KafkaUnreachable as exc:  # says where and why already
        print(f"genpipe submit: {_one_line(exc)}", file=err)
        return 1
    except BrokenPipeError:
        raise  # (the reader of stdout went away, `| head`: not Kafka's doing; main says nothing)
    except (KafkaError, RuntimeError, OSError) as exc:
        print(f"genpipe submit: Kafka at {settings.bootstrap_servers}: {_one_line(exc)}", file=err)
        return 1
    finally:
        watcher.cancel()
    if args.verbose:
        choice = final.choices[0] if getattr(final, "choices", None) else None
        usage = getattr(final, "usage", None)
        used = (f"{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens"
                if usage is not None else "usage not requested (--include-usage)")
        print(f"genpipe submit: finish_reason={choice.finish_reason if choice else None}; {used}", file=err)
    return code


async def _while_waiting(settings, groups: dict[str, str], request_id: str, answered: asyncio.Event, err,
                         timeout_s: float) -> None:
    """Say early when no worker is there to answer (instead of a silent wait until the
    timeout), then every 10 s how long the wait has been."""
    from workers.kafka.groups import missing_workers

    started = time.monotonic()
    if await _set_within(answered, 2.0):
        return
    missing = await missing_workers(settings, groups)
    if missing and not answered.is_set():
        print(f"genpipe submit: {'; '.join(missing)}. Request {request_id} waits in "
              f"{settings.topic('requests')} until one runs (genpipe generate-worker / genpipe derender-worker; "
              f"workers with a --group-id of their own: --generate-group-id / --derender-group-id)", file=err,
              flush=True)
    while not await _set_within(answered, 10.0):
        print(f"genpipe submit: still waiting for request {request_id} "
              f"({time.monotonic() - started:.0f} s of {timeout_s:.0f} s)", file=err, flush=True)


async def _set_within(event: asyncio.Event, seconds: float) -> bool:
    try:
        await asyncio.wait_for(event.wait(), seconds)
        return True
    except asyncio.TimeoutError:
        return False


class _RecordView:
    """Adapts a client ResultMessage to what `record_json` reads from a Kafka record."""

    def __init__(self, record):
        self.key = record.request_id.encode()
        self.headers = record.headers
        self.value = record.raw
        self.topic, self.partition, self.offset, self.timestamp = (
            record.topic, record.partition, record.offset, record.timestamp)


# ---------------------------------------------------------------------------------- tail


def _add_tail(subparsers) -> None:
    p = subparsers.add_parser(
        "tail",
        help="follow the results topic (or any genpipe topic) as JSON lines",
        description="Follow every partition of a topic without a consumer group and print each "
                    "record as one JSON line.",
        epilog=_TAIL_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--topic", type=topic_arg, default=None, metavar="TOPIC",
                   help="a role (requests, requests.bulk, chunks, results, cancel, dlq) or a full topic name "
                        "(default: results)")
    p.add_argument("--request-id", default=None, metavar="ID",
                   help="only records with this key: the request_id (`submit --request-id` sets it, `submit --verbose` prints it)")
    p.add_argument("--from-beginning", action="store_true",
                   help="start at the oldest retained record (default: only new records)")
    p.add_argument("--until-final", action="store_true",
                   help="exit after the first record with genpipe-final: 1 (with --request-id: its own)")
    p.add_argument("--max-records", type=at_least(1), default=None, metavar="N", help="exit after printing N records")
    p.add_argument("--idle-exit", type=seconds, default=None, metavar="S",
                   help="exit when no record to print (one of --request-id's, with it) arrived for S seconds")
    KafkaSettings.add_arguments(p)
    p.set_defaults(func=run_tail)


def run_tail(args: argparse.Namespace) -> int:

    from aiokafka.errors import KafkaError

    quiet_kafka_logs()
    try:
        return asyncio.run(_tail(args))
    except BrokenPipeError:
        return stdout_gone()
    except (KafkaError, RuntimeError, OSError) as exc:
        print(f"genpipe tail: {_one_line(exc)}", file=sys.stderr)
        return 1


async def _tail(args: argparse.Namespace) -> int:

    from schemas import header_value
    from schemas.headers import HEADER_FINAL
    from workers.client import record_json
    from workers.kafka.clients import start_client, stop_consumer
    from workers.kafka.follow import assign_all, batches, make_follower
    from workers.kafka.settings import KafkaSettings

    settings = KafkaSettings.from_args(args, client_id="genpipe-tail")
    topic = resolve_topic(settings, args.topic, "results")
    # From the beginning, a position retention deleted under a slow reader goes on at the
    # oldest record left (at the end, the records between were skipped without a word)
    consumer = make_follower(settings, "earliest" if args.from_beginning else "latest")
    printed = 0
    try:
        await start_client(consumer, settings)  # (a refused login or TLS is named, not "Unable to bootstrap")
        await assign_all(consumer, topic, 0 if args.from_beginning else None)
        last = time.monotonic()
        out = sys.stdout
        async for records in batches(consumer, follow=topic):
            for message in records:
                key = message.key.decode("utf-8", "replace") if message.key is not None else None
                if args.request_id is not None and key != args.request_id:
                    continue
                last = time.monotonic()
                out.write(record_json(message).decode() + "\n")
                printed += 1
                if args.max_records is not None and printed >= args.max_records:
                    out.flush()
                    return 0
                if args.until_final and header_value(message.headers, HEADER_FINAL) == "1":
                    out.flush()
                    return 0
            out.flush()
            if args.idle_exit is not None and time.monotonic() - last >= args.idle_exit:
                return 0  # (other requests' records do not count: on a busy topic it never exited)
        return 0
    finally:
        await stop_consumer(consumer, "genpipe tail")
