"""`genpipe serve`: the OpenAI-compatible HTTP gateway (workers/gateway/app.py)."""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket

from workers.cli_options import add_log_level, add_worker_group_options, at_least, port_number, worker_groups
from workers.gateway.api_keys import api_keys
from workers.kafka.settings import MAX_RECORD_BYTES, KafkaSettings


def _gateway_id(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,100}", text):
        raise argparse.ArgumentTypeError(f"{text!r}: letters, digits, '.', '_' and '-' only (it names a topic)")
    return text


def _origins(text: str) -> tuple[str, ...]:
    """`--allowed-origins`: "*" or comma-separated origins as browsers send them
    (scheme://host[:port], no path): one without its scheme would never match."""
    origins = tuple(o.strip() for o in text.split(",") if o.strip())
    for origin in origins:
        if origin != "*" and not re.fullmatch(r"https?://[A-Za-z0-9.\-\[\]:]+", origin):
            raise argparse.ArgumentTypeError(f"{origin!r}: an origin is scheme://host[:port] as a browser sends it "
                                             f"(e.g. https://app.example.com), or *")
    return origins


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _default_gateway_id() -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:100] or "gw"


def _raise_open_files_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard limit. Every open HTTP stream is a socket: with the
    common default soft limit of 1024, a gateway holding ~1,000 streams (its --max-in-flight
    default is 1024) would fail to accept more (EMFILE) while the hard limit allows far more."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # some systems refuse RLIM_INFINITY: keep what we have
            pass


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from workers.gateway.app import Gateway, GatewayConfig
    from workers.gc_tuning import check_setting as check_gc_setting
    from workers.logs import setup_logging
    from workers.models.tinymodel import default_model_dir
    from workers.startup import check_tokenizer_dir

    if args.tokenizer:
        check_tokenizer_dir(args.tokenizer)
    check_gc_setting()
    setup_logging(args.log_level)
    _raise_open_files_limit()
    settings = KafkaSettings.from_args(args, client_id="genpipe-gateway")
    gateway = Gateway(settings, GatewayConfig(
        tokenizer=args.tokenizer or str(default_model_dir("spm")), model_name=args.model_name,
        gateway_id=args.gateway_id, max_in_flight=args.max_in_flight, max_logprobs=args.max_logprobs,
        timeout_s=args.timeout, answer_timeout_s=args.answer_timeout, max_unread=args.max_unread,
        max_body_bytes=args.max_body_mib << 20, write_timeout_s=args.write_timeout,
        worker_groups=worker_groups(args, settings.topic_prefix), max_record_bytes=args.max_record_bytes,
        max_answer_bytes=args.max_answer_mib << 20, max_model_len=args.max_model_len,
        allowed_origins=args.allowed_origins, api_keys=args.api_key))
    if not args.api_key and not _loopback(args.host):
        logging.getLogger(__name__).warning(
            "serving on %s without --api-key: whoever reaches port %d may generate", args.host, args.port)
    # uvicorn's "auto" picks httptools and uvloop, which genpipe depends on: every streamed
    # token is an HTTP body write, and h11 on asyncio cost 1.23-1.36x more gateway CPU per
    # token (BENCHMARKS.md, "HTTP gateway").
    # log_config None: uvicorn's lines (its access log too, which it printed to stdout)
    # go through the root logger set up above, to stderr, escaped as genpipe's own
    # timeout_graceful_shutdown: told to stop, uvicorn waited for every open request with no
    # end: a stream of minutes held the gateway until its orchestrator killed it, and then
    # nothing cancelled the requests, which ran on unread
    uvicorn.run(gateway.app(), host=args.host, port=args.port, log_level=args.log_level.lower(), log_config=None,
                timeout_graceful_shutdown=args.shutdown_timeout)
    return 0


def register(sub) -> None:
    from workers.cli_options import add_max_logprobs
    from workers.derender.state import DEFAULT_MODEL_NAME

    serve = sub.add_parser(
        "serve", help="run the OpenAI-compatible HTTP gateway over the topics",
        description="Serve POST /v1/completions and /v1/chat/completions (streamed as server-sent events "
                    "or not), GET /v1/models, /health and /metrics, and vLLM's POST /tokenize and /detokenize "
                    "(the tokenizer and chat template, for clients that send token ids). Each HTTP request becomes a "
                    "GenerateRequest on <prefix>.requests; answers come from the results the derender "
                    "workers publish to this gateway's reply topic <prefix>.reply.<gateway-id> (created on "
                    "start). A client that disconnects cancels its request. Needs running generate and "
                    "derender workers.")
    serve.add_argument("--host", default=os.environ.get("GENPIPE_HOST", "127.0.0.1"),
                       help="address to listen on (env GENPIPE_HOST; default %(default)s)")
    serve.add_argument("--port", type=port_number(), default=os.environ.get("GENPIPE_PORT", "8000"),
                       help="port (env GENPIPE_PORT; default %(default)s)")
    serve.add_argument("--tokenizer", default=os.environ.get("GENPIPE_TOKENIZER"),
                       help="Hugging Face tokenizer directory of the served model: renders chat messages "
                            "and text prompts (env GENPIPE_TOKENIZER; default: the built-in tiny model's)")
    serve.add_argument("--model-name", default=os.environ.get("GENPIPE_MODEL_NAME", DEFAULT_MODEL_NAME),
                       help="the `model` clients must name (others get 404; env GENPIPE_MODEL_NAME; default "
                            "%(default)s)")
    serve.add_argument("--gateway-id", type=_gateway_id, default=os.environ.get("GENPIPE_GATEWAY_ID")
                       or _default_gateway_id(),
                       help="names this gateway's reply topic <prefix>.reply.<gateway-id> (env "
                            "GENPIPE_GATEWAY_ID; default: the host name). Unique per gateway process")
    serve.add_argument("--max-in-flight", type=at_least(1), default=1024,
                       help="open requests at most; more get 429 (default %(default)s)")
    serve.add_argument("--max-unread", type=at_least(1), default=1024,
                       help="result records one request may have waiting while its HTTP client does not "
                            "read (past the socket's buffers); a stream that falls further behind, its oldest "
                            "record unread for 5 s, ends with "
                            "an error event and its request is cancelled, so a stalled client cannot make "
                            "the gateway grow without end (default %(default)s)")
    serve.add_argument("--max-body-mib", type=at_least(1), default=16,
                       help="largest request body in MiB; a larger one gets 413 and is not kept in memory, so "
                            "one client cannot take the gateway's memory (default %(default)s; a request record "
                            "on the topics holds ~1 MB)")
    serve.add_argument("--max-answer-mib", type=at_least(1), default=16,
                       help="a non-streamed request whose logprobs may not fit one Kafka record (~1 MB) is "
                            "streamed inside the pipeline and its answer assembled here: its result records "
                            "may hold this many MiB all told, or it gets 400 and is cancelled, so one request "
                            "cannot take the gateway's memory (default %(default)s)")
    serve.add_argument("--write-timeout", type=at_least(1.0, float), default=60.0,
                       help="seconds a stream waits for its HTTP client to take bytes (its socket's buffers "
                            "full) before the stream is given up: the request cancelled and its --max-in-flight "
                            "slot freed (default %(default)s)")
    serve.add_argument("--timeout", type=at_least(1.0, float), default=120.0,
                       help="seconds a stream waits for its next result before it ends with a 504 error "
                            "(default %(default)s)")
    serve.add_argument("--answer-timeout", type=at_least(1.0, float), default=600.0,
                       help="seconds a non-streamed request waits for its answer, which comes whole when the "
                            "request ends, before it gets 504; a request's own timeout (body \"timeout\", "
                            "header X-Request-Timeout) raises it (default %(default)s)")
    serve.add_argument("--shutdown-timeout", type=at_least(0.0, float), default=15.0,
                       help="seconds a gateway told to stop (SIGTERM, Ctrl-C) waits for its open requests to "
                            "end; those still open then end too (a stream is cut before its [DONE], a "
                            "non-streamed request gets a 500) and their requests are cancelled, which takes up "
                            "to 10 s more with Kafka away. Keep the two under the orchestrator's grace period "
                            "(Kubernetes: 30 s), which kills the gateway, its requests left running unread "
                            "(default %(default)s)")
    serve.add_argument("--api-key", type=api_keys, default=os.environ.get("GENPIPE_API_KEY", ""),
                       help="keys a caller must send as `Authorization: Bearer <key>` (an OpenAI SDK's api_key), "
                            "comma-separated, any one of them valid (to rotate a key without downtime); others "
                            "get 401. /health and /metrics stay open. Best given in the environment, "
                            "GENPIPE_API_KEY, off the command line (default: none, no check)")
    serve.add_argument("--allowed-origins", type=_origins, default=os.environ.get("GENPIPE_ALLOWED_ORIGINS", ""),
                       help="web origins whose pages may read the gateway's answers in a browser (CORS), "
                            "comma-separated: "
                            "https://app.example.com,http://localhost:3000, or * for any (env "
                            "GENPIPE_ALLOWED_ORIGINS; default: none, no CORS headers). Who may generate is "
                            "--api-key's to decide: a page's plain POST needs no CORS")
    serve.add_argument("--max-model-len", type=at_least(1), default=os.environ.get("GENPIPE_MAX_MODEL_LEN"),
                       help="the served context length in tokens, as the generate workers' --max-model-len: a "
                            "prompt this long or longer gets 400 here, and /v1/models and /tokenize report it "
                            "(env GENPIPE_MAX_MODEL_LEN; default: max_position_embeddings in the --tokenizer "
                            "directory's config.json)")
    add_log_level(serve)
    add_max_logprobs(serve)
    add_worker_group_options(serve)
    serve.add_argument("--max-record-bytes", type=at_least(1024),
                       default=os.environ.get("GENPIPE_MAX_RECORD_BYTES", str(MAX_RECORD_BYTES)),
                       help="largest request record to send (env GENPIPE_MAX_RECORD_BYTES; default %(default)s, "
                            "under Kafka's default 1 MiB): a request larger gets 413. The workers' value, "
                            "raised only together with the broker's message.max.bytes")
    KafkaSettings.add_arguments(serve)
    serve.set_defaults(func=_serve)
