"""What the workers' garbage-collector settings (workers/gc_tuning.py) buy on their hot
path, side by side in one process run.

The work: decoding batch-256 engine steps (as the generate worker reads them, k
logprobs per token) whose outputs stay alive for a few steps, as they do until their
chunk is published, in a process that holds `--heap` other GC-tracked objects (a worker
after start-up holds ~33,000 from imports alone, more with in-flight state). Python's
default settings, then the workers' (`gc.freeze()` after start-up and the young
generation's threshold of workers/gc_tuning.py), alternating `--repeat` times; prints µs
per output and the ratio.

    python ops/bench/gc.py [--heap 200000] [--k 5] [--steps 2000] [--repeat 3] [--gen0 N]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from workers.gc_tuning import YOUNG_THRESHOLD  # noqa: E402
from workers.generate.engine_pipe import Step, decode_from_child as _decode_from_child, encode as _encode  # noqa: E402
from workers.generate.outputs import RequestOutput, StepOutputs  # noqa: E402
from workers.generate.synthetic import synthetic_entries  # noqa: E402


def run(message: bytes, steps: int, live_steps: int = 10) -> float:
    alive: list = []
    t0 = time.perf_counter()
    for _ in range(steps):
        alive.append(_decode_from_child(message))
        if len(alive) > live_steps:
            del alive[0]
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heap", type=int, default=200_000, help="other GC-tracked objects the process holds")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gen0", type=int, default=YOUNG_THRESHOLD,
                    help="gen-0 threshold with the freeze (default: the workers'; to try others)")
    args = ap.parse_args(argv)
    entries = synthetic_entries([100 + i for i in range(256)], [args.k] * 256, 32000) if args.k else [None] * 256
    outputs = [RequestOutput(request_id=f"req-{i:06d}", token_ids=[100 + i], num_output_tokens=5,
                             logprobs=None if entry is None else [entry])
               for i, entry in enumerate(entries)]
    message = _encode(Step(outputs=StepOutputs.of(outputs), step_s=0.002))  # as the engines send it
    heap = [[i] for i in range(args.heap)]  # noqa: F841 (held: what the collector rescans)
    defaults = gc.get_threshold()
    per_output = {"default": [], "tuned": []}
    for r in range(args.repeat):
        for name in (("default", "tuned") if r % 2 == 0 else ("tuned", "default")):
            gc.unfreeze()
            gc.set_threshold(*defaults)
            if name == "tuned":
                gc.collect()
                gc.freeze()
                gc.set_threshold(args.gen0, defaults[1], defaults[2])
            per_output[name].append(1e6 * run(message, args.steps) / (args.steps * len(outputs)))
    d, t = statistics.median(per_output["default"]), statistics.median(per_output["tuned"])
    print(f"decode of a batch-256 step, k={args.k}, heap {args.heap:,} objects, median of {args.repeat}:")
    print(f"  Python defaults {d:.2f} µs per output, frozen start-up (gen-0 threshold {args.gen0:,}) {t:.2f} µs: {d / t:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
