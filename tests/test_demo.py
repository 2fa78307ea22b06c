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
