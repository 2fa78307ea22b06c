"""Processes and measurements shared by ops/bench/gateway*.py: the worktree's code as
subprocesses (`python -m workers.cli ...`, PYTHONPATH set), waits on conditions, /proc stats."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from workers.kafka.settings import KafkaSettings

ROOT = Path(__file__).resolve().parents[2]
LOG_DIR = Path(tempfile.mkdtemp(prefix="genpipe-gwbench-"))
GATEWAY_ID = "bench"


def raise_nofile() -> tuple[int, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return soft, hard


def pct(values, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}ms"


def spawn(name: str, args: list[str], nofile: tuple[int, int | None] | None = None,
          root: Path = ROOT) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(root)}  # the worktree's code, not an installed copy

    def limit() -> None:
        if nofile is not None:  # (soft, hard or None: keep the hard limit)
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1] if nofile[1] is None else nofile[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile[0], hard))
    log = open(LOG_DIR / f"{name}.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "workers.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                            cwd=root, env=env, start_new_session=True, preexec_fn=limit)


def add_broker_arguments(parser, default_port: int) -> None:
    """--bootstrap-servers, or --broker-port for one started here (`bench_broker`)."""
    parser.add_argument("--bootstrap-servers", help="an existing broker (default: start one on --broker-port)")
    parser.add_argument("--broker-port", type=int, default=default_port, help="controller on the next port")


@contextlib.contextmanager
def bench_broker(bootstrap_servers: str | None, port: int, name: str):
    """Yields `bootstrap_servers`, or one started here (`genpipe broker up` on `port`, its
    controller on the next, data under /tmp/`name`-`port`) and stopped after."""
    if bootstrap_servers is not None:
        yield bootstrap_servers
        return
    broker = ["--port", str(port), "--data-dir", str(Path(tempfile.gettempdir()) / f"{name}-{port}")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "workers.cli", "broker", "up", *broker, "--controller-port", str(port + 1)],
                   check=True, cwd=ROOT, env=env)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([sys.executable, "-m", "workers.cli", "broker", "down", *broker], cwd=ROOT, env=env)


def kafka_args(settings: KafkaSettings) -> list[str]:
    return ["--bootstrap-servers", settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix]


def start_generate(settings: KafkaSettings, step_ms: float, max_batch: int, name: str) -> subprocess.Popen:
    return spawn(name, ["generate-worker", "--engine", "synthetic", "--engine-in", "thread", "--step-ms",
                        str(step_ms), "--max-batch", str(max_batch), "--grace-period", "5", "--log-level", "INFO",
                        *kafka_args(settings)])


async def wait_for(what: str, condition, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{what}: the process exited ({proc.returncode}); logs in {LOG_DIR}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not happen within {timeout:.0f} s; logs in {LOG_DIR}")
        await asyncio.sleep(0.05)


def log_has(name: str, text: str) -> bool:
    return text.encode() in (LOG_DIR / f"{name}.log").read_bytes()


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        proc.wait(60)


def proc_stats(pid: int) -> tuple[int, float, int]:
    """(RSS bytes, CPU seconds user+system, open file descriptors) of a process."""
    rss = next(int(line.split()[1]) * 1024 for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:"))
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return rss, cpu, len(os.listdir(f"/proc/{pid}/fd"))


async def http_ok(port: int, path: str) -> bool:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.write(b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path.encode())
    line = await reader.readline()
    writer.close()
    return line.split()[1:2] == [b"200"]


async def relay_buckets(port: int) -> dict[float, float]:
    """The gateway's `genpipe_gateway_relay_seconds` histogram: upper bound -> cumulative count."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    text = (await reader.read()).decode()
    writer.close()
    buckets = {}
    for line in text.splitlines():
        if line.startswith("genpipe_gateway_relay_seconds_bucket{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float("inf") if bound == "+Inf" else float(bound)] = float(line.split()[-1])
    return buckets


def bucket_pct(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The q-quantile of the observations between two scrapes, interpolated in its bucket."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0
    if not total:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = bound, count
    return lower
