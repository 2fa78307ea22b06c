"""The workers' garbage-collector settings, applied once they are up: `gc.freeze()`
and a larger young-generation threshold.

Why the freeze: the hot paths allocate many small containers per token (the engine's
decoded outputs, chunk and result entries, per-request text state) that live for a few
steps — long enough to be promoted, so the oldest generation's collections keep coming and
each rescans every object the process holds: the modules, Kafka clients, tokenizer
tables and metric series that start-up built. `gc.freeze()` after start-up moves those
into a generation the collector never scans. Measured by `ops/bench/gc.py` (decoding
batch-256 engine steps at k=5 in a process holding 100,000 objects): 4.7 → 1.0 µs per
output, 4.8× (BENCHMARKS.md, "Throughput").

Why the threshold: Python collects the young generation each time 700 more tracked
objects are alive than at the last collection. A worker's loop turn holds far more than
that alive until it ends (a derender poll's records, each with its decoded chunk, result
structs, headers and record; an engine step's outputs and their chunks), so at Python's
700 the collector ran every few dozen records and scanned each record's objects before
they were freed, then again in the middle generation. At 10,000 a turn's objects are
mostly freed before a collection comes: in the derender under load its collector CPU
fell from 9-13% of its own to 1-3% (BENCHMARKS.md, "The collector's young threshold"). A
collection then scans up to ~10,000 objects at once (a few ms on a slow core) instead of
700 (well under 1 ms), and far less often. Reference cycles are still collected as
before. `GENPIPE_GC_TUNING=0` keeps Python's defaults; any value but 0 and 1 stops the
command at start (`check_setting`): `false` or `off` used to mean on.
"""

from __future__ import annotations

import gc
import os

# Young objects alive beyond the last collection before the next one (Python: 700).
YOUNG_THRESHOLD = 10_000


def check_setting() -> bool:
    """Whether GENPIPE_GC_TUNING turns the tuning on: 1 (the default) or 0; anything else
    is a usage error, raised when a command starts rather than once it is up."""
    from workers.startup import UsageError

    value = os.environ.get("GENPIPE_GC_TUNING", "1").strip()
    if value not in ("0", "1"):
        raise UsageError(f"GENPIPE_GC_TUNING={value!r}: expected 1 (tune the garbage collector once up, "
                         f"the default) or 0 (keep Python's defaults)")
    return value == "1"


def tune_after_startup() -> bool:
    """Freeze what start-up built (once the worker is up) and raise the young
    generation's threshold; False when turned off."""
    if not check_setting():
        return False
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(YOUNG_THRESHOLD, young), middle, old)
    return True
