"""The in-process worker benches (ops/bench/derender_worker.py, generate_worker.py,
engine_read.py) run the workers' real handlers against fakes of their own
(ops/bench/paired.py). When a handler starts calling something new on its publisher,
the fake lacks it and the bench dies: derender_worker.py was broken that way for a day
before anyone ran it (its handler's tick began failing records of deleted topics). Each
child is run here once per script, as the bench's parent runs it, on this checkout."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "ops" / "bench"))

from paired import Side  # noqa: E402

SMALL = ["--requests", "4", "--tokens", "32", "--chunk-tokens", "8"]


@pytest.mark.parametrize("script, args, workload, records", [
    ("derender_worker.py", SMALL, "completion:synthetic:0", 4 * 32 // 8),  # a result per chunk
    ("generate_worker.py", [*SMALL, "--prompt-tokens", "4"], "k=0", 4 * 32 // 8),  # chunks of 8 tokens
    ("engine_read.py", [*SMALL, "--step-ms", "2"], "k=0", None),  # chunks as the policy cuts them
])
def test_each_bench_child_publishes_every_token_and_the_same_bytes_each_run(script, args, workload, records):
    side = Side(ROOT / "ops" / "bench" / script, ROOT, args)
    try:
        first, second = side.run(workload), side.run(workload)
    finally:
        side.close()
    assert first["tokens"] == second["tokens"] == 4 * 32
    if records is not None:
        assert first["records"] == records
    else:
        assert 4 * 32 // 8 <= first["records"] <= 4 * 32
    assert first["digest"] == second["digest"]  # (what the paired bench compares between sides)
    assert first["cpu_s"] > 0
