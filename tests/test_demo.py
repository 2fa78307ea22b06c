"""The README's first command, as a new user runs it: answers stream, nothing is left running."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def processes_mentioning(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if marker.encode() in cmdline and int(entry) != os.getpid():
            found.append(int(entry))
    return found


def test_demo_streams_answers_and_leaves_no_process_behind(kafka_bootstrap):
    prefix = f"demo-{uuid.uuid4().hex[:8]}"
    result = subprocess.run(
        [sys.executable, "-m", "workers.cli", "demo", "--bootstrap-servers", kafka_bootstrap,
         "--topic-prefix", prefix, "--max-tokens", "12", "--partitions", "2"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "[1/3] chat: Hello! Who are you?" in out
    assert "[2/3] completion: Once upon a time" in out
    assert "top logprobs of the first tokens:" in out  # the logprobs prompt
    # each answer printed some text after its heading
    for heading in ("[1/3]", "[2/3]", "[3/3]"):
        answer = out.split(heading, 1)[1].split("\n", 2)[1]
        assert answer.strip(), f"no streamed answer after {heading}"
    assert "ttft" in result.stderr and "tok/s" in result.stderr
    assert "demo finished: workers stopped" in out
    assert processes_mentioning(prefix) == [], "worker processes left running"


def test_demo_serve_answers_over_http_until_ctrl_c(kafka_bootstrap):
    import json
    import signal
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prefix = f"demo-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "demo", "--bootstrap-servers", kafka_bootstrap, "--topic-prefix", prefix,
         "--max-tokens", "4", "--partitions", "2", "--serve", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = []
    try:
        for line in proc.stdout:  # until the demo says it serves (or exits)
            out.append(line)
            if "Ctrl-C stops everything" in line:
                break
        printed = "".join(out)
        assert f"serving the OpenAI API on http://127.0.0.1:{port}/v1" in printed, printed[-3000:]
        assert f"curl -s http://127.0.0.1:{port}/v1/completions" in printed
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": "genpipe-tiny", "prompt": "Once upon a time", "max_tokens": 5,
                             "ignore_eos": True}).encode())
        answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
        assert answer["usage"]["completion_tokens"] == 5
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "demo finished: workers stopped" in rest
    assert processes_mentioning(prefix) == [], "worker or gateway processes left running"
