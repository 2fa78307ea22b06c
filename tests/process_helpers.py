"""Worker *processes* for end-to-end tests: started like an operator would, always stopped."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


class WorkerProcesses:
    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "workers.cli", *args], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Wait until every worker logged that it has partitions (or fail with its log)."""
        deadline = time.monotonic() + timeout
        pending = {name for name, _ in self.procs}
        while pending:
            for name, proc in self.procs:
                if name in pending and "worker ready" in self.log(name):
                    pending.discard(name)
                if proc.poll() is not None:
                    raise AssertionError(f"{name} exited with {proc.returncode}:\n{self.log(name)[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"workers not ready after {timeout}s: {sorted(pending)}")
            time.sleep(0.1)  # polling a log file: the condition is checked, not assumed

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def partitions(self, name: str, topic_suffix: str = ".requests") -> set[int]:
        """The partitions (of the topic ending in `topic_suffix`) a worker holds now, from
        its last "partitions assigned (generation N): t[p], ...; kept: t[p], ..." log line."""
        lines = [line for line in self.log(name).splitlines() if "partitions assigned (generation" in line]
        assert lines, f"{name} has no partitions yet"
        named = re.findall(r"(\S+)\[(\d+)\]", lines[-1].split("): ", 1)[1])
        return {int(p) for topic, p in named if topic.endswith(topic_suffix)}

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        for n, proc in self.procs:
            if n == name and proc.poll() is None:
                os.killpg(proc.pid, sig)
                proc.wait(60)

    def stop_all(self, timeout: float = 60.0) -> dict[str, int]:
        for _, proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        codes = {}
        for name, proc in self.procs:
            try:
                codes[name] = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                codes[name] = proc.wait()
        return codes


async def last_attempt_text(client, request) -> tuple[str, int]:
    """Stream `request` through the client: (text of its last attempt, restarts seen)."""
    texts, restarts = [], 0
    async for message in client.records(request):
        if message.restart:
            restarts += 1
            texts = []
        texts.append(message.value.choices[0].text)
    return "".join(texts), restarts


def run_alone(engine, requests) -> dict[str, list[int]]:
    """The reference: every request through the engine in-process, no Kafka; ids by request."""
    ids = {r.request_id: [] for r in requests}
    for request in requests:
        engine.add(request)
    while engine.has_work():
        for out in engine.step():
            ids[out.request_id].extend(out.token_ids)
    return ids


def uninterrupted_texts(model_dir, requests) -> dict[str, str]:
    """What each greedy completion request prints when nothing goes wrong: the engine's
    ids through the derender rules in-process (byte-fallback repair included, which a
    plain tokenizer decode would not do)."""
    from tests.derender_support import make_chunks, run_chunks, streamed_text
    from workers.derender.state import Derenderer
    from workers.generate.engine import Engine
    from workers.generate.chunks import PROMPT_TAIL

    ids = run_alone(Engine(str(model_dir), max_batch=len(requests)), requests)
    derenderer = Derenderer(str(model_dir))
    return {r.request_id: streamed_text(run_chunks(derenderer, make_chunks(
        r.request_id, ids[r.request_id], output=r.output, prompt_tail=r.prompt_token_ids[-PROMPT_TAIL:],
        prompt_count=len(r.prompt_token_ids)))) for r in requests}


def free_port(span: int = 1) -> int:
    """A TCP port nothing listens on now (the OS's pick), and the `span - 1` after it too: a
    local broker takes PORT and PORT + 1 (its controller). With one port checked, the
    broker of tests/test_kafka_kit.py once found its controller's taken."""
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port + span - 1 <= 65535 and all(_bindable(port + i) for i in range(1, span)):
            return port
    raise RuntimeError(f"no {span} free TCP ports in a row found")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
