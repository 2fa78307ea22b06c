"""The broker kit for a machine with no Java (ops/device/kafka_kit.py) and the GPU
throughput script built on it (ops/device/throughput_gpu.sh), run here on the CPU."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.process_helpers import free_port
from workers.broker import local

ROOT = Path(__file__).resolve().parents[1]
# The tools ops/device/throughput_gpu.sh calls; java is not one of them.
SCRIPT_TOOLS = ("bash", "rm", "cp", "mkdir", "date", "df", "awk", "grep", "dirname")


def test_a_broker_probe_without_the_kafka_client_says_so(monkeypatch):
    # Before: the ImportError read as "the broker did not answer", and `broker up`
    # waited out its 60 s and blamed the broker's log.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        monkeypatch.setitem(sys.modules, "aiokafka.admin", None)  # (import fails)
        with pytest.raises(local.BrokerError, match="Kafka client cannot be imported.*aiokafka"):
            local.answers(listener.getsockname()[1])


def path_without_java(bin_dir: Path) -> str:
    """A PATH of the script's tools and this Python (as `python3`), and no java."""
    bin_dir.mkdir()
    for tool in SCRIPT_TOOLS:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    # A wrapper, not a link: a virtualenv's python finds its packages from where it is.
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    assert shutil.which("java", path=str(bin_dir)) is None
    return str(bin_dir)


@pytest.mark.kafka
@pytest.mark.skipif(not (shutil.which("jlink") and shutil.which("mvn")),
                    reason="packing the kit needs a JDK's jlink and Maven")
def test_the_gpu_throughput_script_runs_the_real_engine_through_a_broker_from_the_kit_alone(tmp_path):
    kit = tmp_path / "kit"
    packed = subprocess.run([sys.executable, "ops/device/kafka_kit.py", "pack", "--out", str(kit), "--no-wheels",
                             "--no-compress"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert packed.returncode == 0, packed.stderr
    port = free_port(span=2)  # (the broker's controller takes the next one)
    env = dict(os.environ, PATH=path_without_java(tmp_path / "bin"), KIT=str(kit), WORK=str(tmp_path / "work"),
               PORT=str(port), SHAPES="tiny", DEVICE="cpu", DTYPE="float32", BATCH="16", REQUESTS="48",
               MAX_TOKENS="12", KS="0", SYNTHETIC="1", SYN_REQUESTS="64")
    env.pop("GENPIPE_CACHE_DIR", None)  # (the kit's own cache: the jars placed by unpack)
    run = subprocess.run(["bash", "ops/device/throughput_gpu.sh"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert f"java {tmp_path / 'work' / 'kit' / 'jre' / 'bin' / 'java'}" in out
    assert f"broker up on 127.0.0.1:{port}" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("this ")]
    # Both stages measured: every request's final result was read (the bench waits for
    # each, and fails a load with an error result).
    # (the model, then the synthetic engine under the two chunk policies)
    assert [row[5] for row in rows] == ["generate", "derender"] * 3, out[-4000:]
    assert out.count("engine alone:") == 3 and out.count("goal (a)") == 3
    # the broker the script started is found and its CPU per token given, for each stage
    assert "broker us/tok" in out and not any("n/a" in row for row in rows), out[-4000:]
    assert "--coalesce-max-delay-ms 4" in out
    assert not local.answers(port), "the script left its broker running"
    # nor its data on tmpfs (memory: each run left ~20 MB there for good), its log kept
    assert not Path(f"/dev/shm/genpipe-gpu-broker-{port}").exists()
    assert (tmp_path / "work" / "broker.log").exists() or (tmp_path / "work" / "broker" / "broker.log").exists()

