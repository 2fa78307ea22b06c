"""ops/bench/proc_cpu.py finds the generate worker's engine child among its children. A
child that exits between being listed and being read (a helper the worker runs at start-up)
made the throughput bench die with FileNotFoundError on /proc/<pid>/cmdline: CI's run of
ops/device/throughput_gpu.sh failed that way once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "ops" / "bench"))

from proc_cpu import children  # noqa: E402

# A parent with an engine-like child (multiprocessing's spawn, as
# workers/generate/engine_process.py starts one) that keeps starting children that exit at once.
CHURN = """
import multiprocessing, subprocess, time
if __name__ == "__main__":
    stay = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    stay.start()
    print(stay.pid, flush=True)
    while True:
        subprocess.run(["true"])
"""


def test_children_skips_a_child_that_exits_while_it_is_listed():
    parent = subprocess.Popen([sys.executable, "-c", CHURN], stdout=subprocess.PIPE, text=True)
    stay = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 3
        most = 0
        while time.monotonic() < deadline:
            assert children(parent.pid) == [stay]  # (raised on a gone child before)
            most = max(most, len(Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()))
        assert most >= 3, "no short-lived child beside the spawned one and the resource tracker"
    finally:
        parent.kill()
        parent.wait()
        os.kill(stay, signal.SIGKILL)
