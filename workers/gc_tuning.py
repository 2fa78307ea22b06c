"""The workers' garbage-collector setting, applied once they are up: `gc.freeze()`.

Why: the hot paths allocate many small containers per token (the engine's decoded
outputs, chunk and result entries, per-request text state) that live for a few steps —
long enough to be promoted, so the oldest generation's collections keep coming and
each rescans every object the process holds: the modules, Kafka clients, tokenizer
tables and metric series that start-up built. `gc.freeze()` after start-up moves those
into a generation the collector never scans. Measured by `ops/bench/gc.py` (decoding
batch-256 engine steps at k=5 in a process holding 100,000 objects): 4.7 → 1.0 µs per
output, 4.8× (BENCHMARKS.md, "Throughput"). A larger gen-0 threshold on top bought
nothing measurable there, so Python's thresholds stay. Reference cycles are still
collected as before. `GENPIPE_GC_TUNING=0` keeps Python's defaults.
"""

from __future__ import annotations

import gc
import os


def tune_after_startup() -> bool:
    """Freeze what start-up built (once the worker is up); False when turned off."""
    if os.environ.get("GENPIPE_GC_TUNING", "1") == "0":
        return False
    gc.collect()
    gc.freeze()
    return True
