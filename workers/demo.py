"""`genpipe demo`: the whole pipeline on one machine, streamed to the terminal.

Brings up a local broker if none answers, creates the topics, starts one generate and
one derender worker as child processes, submits a few prompts (chat and completion, one
with logprobs) and prints the answers as they stream, with a status line (time to first
token, tokens/s). On the end, an error or Ctrl-C it stops what it started: the workers
always, the broker if it started it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from workers.kafka.settings import KafkaSettings

PROMPTS = [
    dict(kind="chat", messages=[{"role": "user", "content": "Hello! Who are you?"}]),
    dict(kind="completion", text="Once upon a time", logprobs=2),
    dict(kind="chat", messages=[{"role": "user", "content": "Dis-moi quelque chose en français."}]),
]


def _say(text: str) -> None:
    print(text, flush=True)


def _status(text: str, final: bool = False) -> None:
    # A live status line on a terminal; elsewhere (CI logs, tests) only the final one.
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[2K" + text + ("\n" if final else ""))
    elif final:
        sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _local_port(bootstrap: str) -> int | None:
    """The port when `bootstrap` is a single loopback address a local broker could serve."""
    host, _, port = bootstrap.rpartition(":")
    if "," in bootstrap or host not in ("127.0.0.1", "localhost") or not port.isdigit():
        return None
    return int(port)


class Children:
    """Worker processes this demo owns; each in its own process group, stopped on exit."""

    def __init__(self, settings: KafkaSettings):
        # The demo's Kafka connection, security options included (given as flags, they
        # reached only the demo's own client), for every command it starts
        self.env = {**os.environ, **settings.to_env()}
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, args: list[str], log_dir: Path) -> subprocess.Popen:
        log = open(log_dir / f"demo-{name}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "workers.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=self.env)
        self.procs.append(proc)
        return proc

    def stop(self, timeout: float = 20.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)  # graceful: the worker drains and commits
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _status_line(first: float | None, tokens: int, elapsed: float) -> str | None:
    if first is None or not tokens:
        return None
    return f"  ttft {first * 1000:.0f} ms · {tokens} tokens · {tokens / elapsed:.1f} tok/s"


async def _run_prompts(settings: KafkaSettings, tokenizer_dir: str, max_tokens: int, timeout_s: float,
                       children: Children) -> int:
    from workers.client import GenpipeClient, Restart, make_request, render_chat, render_prompt

    async with GenpipeClient(settings=settings, timeout_s=timeout_s) as client:
        for n, prompt in enumerate(PROMPTS, 1):
            if prompt["kind"] == "chat":
                ids = render_chat(tokenizer_dir, prompt["messages"])
                shown = prompt["messages"][-1]["content"]
            else:
                ids = render_prompt(tokenizer_dir, prompt["text"])
                shown = prompt["text"]
            request = make_request(ids, kind=prompt["kind"], max_tokens=max_tokens, temperature=0.8, seed=n,
                                   stream=True, include_usage=True, logprobs=prompt.get("logprobs"),
                                   top_logprobs=prompt.get("logprobs"))
            _say(f"\n[{n}/{len(PROMPTS)}] {prompt['kind']}: {shown}")
            sent = time.monotonic()
            first = None
            tokens = chunks = 0
            logprob_lines = []
            async for item in client.stream(request):
                for proc in children.procs:
                    if proc.poll() is not None:
                        raise RuntimeError(f"a worker exited with code {proc.returncode}; see its log")
                if isinstance(item, Restart):
                    _say("\n[a worker restarted the request; starting over]")
                    continue
                choice = item.choices[0]
                chunks += 1  # one streamed record per generate chunk: about a token each
                text = choice.delta.content if prompt["kind"] == "chat" else choice.text
                if first is None and text is not None:
                    first = time.monotonic() - sent
                print(text or "", end="", flush=True)
                lp = choice.logprobs
                if lp is not None and getattr(lp, "tokens", None):
                    tokens += len(lp.tokens)
                    for token, top in zip(lp.tokens, lp.top_logprobs):
                        if len(logprob_lines) < 5 and top:
                            alts = ", ".join(f"{k!r}: {v:.2f}" for k, v in top.items())
                            logprob_lines.append(f"  {token!r:>12} ← {{{alts}}}")
                tokens = max(tokens, chunks)
                if item.usage is not None:
                    tokens = item.usage.completion_tokens
                status = _status_line(first, tokens, time.monotonic() - sent)
                if status:
                    _status(status)
            print()
            _status(_status_line(first, tokens, time.monotonic() - sent) or "  no tokens", final=True)
            if logprob_lines:
                _say("  top logprobs of the first tokens:")
                for line in logprob_lines:
                    _say(line)
    return 0


def _serve(settings: KafkaSettings, model_dir: str, port: int, children: "Children", log_dir: Path) -> int:
    """`--serve PORT`: the HTTP gateway beside the workers until Ctrl-C, with examples
    that work as printed."""
    import urllib.request

    from workers.derender.state import DEFAULT_MODEL_NAME

    proc = children.start("serve", ["serve", "--port", str(port), "--tokenizer", model_dir, "--log-level", "warning",
                                    "--bootstrap-servers", settings.bootstrap_servers,
                                    "--topic-prefix", settings.topic_prefix], log_dir)
    deadline = time.monotonic() + 60
    while True:  # polling the gateway's port until it answers (or the process died)
        if proc.poll() is not None:
            raise RuntimeError(f"genpipe serve exited (code {proc.returncode}); see {log_dir}/demo-serve.log")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1).read()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"genpipe serve did not answer on port {port} within 60 s") from None
            time.sleep(0.2)
    base = f"http://127.0.0.1:{port}"
    _say(f"\nserving the OpenAI API on {base}/v1 (model {DEFAULT_MODEL_NAME!r}); try, in another shell:\n"
         f"  curl -s {base}/v1/completions -H 'Content-Type: application/json' \\\n"
         f"    -d '{{\"model\": \"{DEFAULT_MODEL_NAME}\", \"prompt\": \"Once upon a time\", \"max_tokens\": 16}}'\n"
         f"  python3 -c 'from openai import OpenAI; print(OpenAI(base_url=\"{base}/v1\", api_key=\"-\")"
         f".completions.create(model=\"{DEFAULT_MODEL_NAME}\", prompt=\"Hello\", max_tokens=16).choices[0].text)'\n"
         f"Ctrl-C stops everything.")
    try:
        while proc.poll() is None:
            time.sleep(0.5)  # waiting for Ctrl-C (or the gateway to exit)
    except KeyboardInterrupt:
        _say("\nstopping")
        return 0
    raise RuntimeError(f"genpipe serve exited (code {proc.returncode}); see {log_dir}/demo-serve.log")


def run_demo(args: argparse.Namespace) -> int:
    from workers.broker.local import broker_down, broker_status, broker_up
    from workers.broker.topics import create_topics
    from workers.cache import cache_root
    from workers.models.tinymodel import cached_model_dir, default_model_dir

    import logging

    # aiokafka warns about transient states (a new topic without a leader yet); the demo
    # shows answers, and failures reach the user as one error line anyway.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    settings = KafkaSettings.from_args(args, client_id="genpipe-demo")
    started_broker = None
    children = Children(settings)
    log_dir = cache_root()
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        port = _local_port(settings.bootstrap_servers)
        if port is not None and broker_status(port).state not in ("running", "foreign"):
            _say(f"starting a local Kafka broker on 127.0.0.1:{port} (first run resolves its jars with Maven)…")
            info = broker_up(port=port, quiet=True)
            started_broker = None if info.reused else port
        report = asyncio.run(create_topics(settings, partitions=args.partitions))
        _say(f"topics ready: {', '.join(report.created + report.existed)}")
        if cached_model_dir("spm") is None:
            _say("building the built-in tiny model (first run only, ~20 s)…")
        model_dir = str(default_model_dir("spm"))
        common = ["--bootstrap-servers", settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix,
                  "--grace-period", "5"]
        children.start("generate", ["generate-worker", "--model", model_dir, *common], log_dir)
        children.start("derender", ["derender-worker", "--tokenizer", model_dir, *common], log_dir)
        _say(f"started a generate and a derender worker (logs: {log_dir}/demo-*.log)")
        code = asyncio.run(_run_prompts(settings, model_dir, args.max_tokens, args.timeout, children))
        if code == 0 and args.serve:
            return _serve(settings, model_dir, args.serve, children, log_dir)
        return code
    except KeyboardInterrupt:
        _say("\ninterrupted")
        return 130
    except Exception as exc:  # one clear line, then clean up
        print(f"\ngenpipe demo: error: {exc}", file=sys.stderr)
        return 1
    finally:
        children.stop()
        if started_broker is not None and not args.keep_broker:
            broker_down(port=started_broker)
        _say("demo finished: workers stopped" + (", broker stopped" if started_broker and not args.keep_broker else ""))


def register(sub) -> None:
    demo = sub.add_parser(
        "demo", help="run the whole pipeline locally and stream a few answers",
        description="Start a local Kafka broker if none answers, create the topics, start one generate and "
                    "one derender worker, submit a few prompts (chat and completion, one with logprobs) "
                    "and stream the answers. Everything it started is stopped at the end or on Ctrl-C.")
    KafkaSettings.add_arguments(demo)
    demo.add_argument("--partitions", type=int, default=8, help="partitions per topic if they are created")
    demo.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (default %(default)s)")
    demo.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each answer")
    demo.add_argument("--keep-broker", action="store_true", help="leave a broker the demo started running")
    demo.add_argument("--serve", type=int, metavar="PORT", default=None,
                      help="after the answers, keep the workers running and serve the OpenAI-compatible HTTP "
                           "API (genpipe serve) on this port until Ctrl-C, printing curl and openai examples")
    demo.set_defaults(func=run_demo)
