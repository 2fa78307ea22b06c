"""Percentiles of each hop a step's tokens take from the engine to the producer, from the
lines ops/bench/hop_probe/sitecustomize.py wrote (see there).

    python ops/bench/hop_probe/report.py /tmp/hops [--skip-s 2]

Steps are joined by their `sampled_at_ns` across the engine process and the worker; a
step whose hand-on never reached the worker (a step that only carried metrics is still
written) or that published nothing is left out of the hops after that point. `--skip-s`
drops the first seconds of steps (start-up, the first admissions)."""

from __future__ import annotations

import argparse
from pathlib import Path

HOPS = [
    ("engine thread -> outbox thread", "sampled", "out_enter"),
    ("outbox: holder + encode + write", "out_enter", "out_written"),
    ("written -> worker loop read", "out_written", "in_read"),
    ("read -> on_outputs (decode)", "in_read", "in_handled"),
    ("on_outputs -> publish task runs", "in_handled", "pub_start"),
    ("task -> publish_batch (lock, take)", "pub_start", "pub_publish"),
    ("publish_batch (room, queue)", "pub_publish", "pub_done"),
    ("total: sampled -> queued in producer", "sampled", "pub_done"),
]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def load(directory: Path) -> dict[int, dict[str, int]]:
    steps: dict[int, dict[str, int]] = {}
    for path in directory.glob("*.tsv"):
        for line in path.read_text().splitlines():
            kind, sampled, *times = line.split("\t")
            sampled = int(sampled)
            if sampled <= 0:
                continue  # a release between steps: no step to join to
            step = steps.setdefault(sampled, {"sampled": sampled})
            if kind == "out":
                step["out_enter"], step["out_written"] = int(times[0]), int(times[1])
            elif kind == "in":
                step["in_read"], step["in_handled"] = int(times[0]), int(times[1])
            elif kind == "pub" and "pub_start" not in step:
                step["pub_start"], step["pub_publish"], step["pub_done"] = map(int, times[:3])
                step["records"] = int(times[3])
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory", type=Path)
    ap.add_argument("--skip-s", type=float, default=2.0, help="leave out the first seconds of steps")
    args = ap.parse_args()
    steps = load(args.directory)
    joined = [s for s in steps.values() if "out_enter" in s and "in_read" in s]
    if not joined:
        raise SystemExit(f"no step of {args.directory} reached a worker")
    first = min(s["sampled"] for s in joined) + args.skip_s * 1e9
    joined = [s for s in joined if s["sampled"] >= first]
    published = [s for s in joined if "pub_start" in s]
    print(f"{len(joined)} steps handed to a worker, {len(published)} of them published "
          f"({sum(s['records'] for s in published)} records); ms:")
    print(f"  {'hop':40} {'p50':>7} {'p90':>7} {'p99':>7} {'max':>7}")
    for name, a, b in HOPS:
        values = [(s[b] - s[a]) / 1e6 for s in joined if a in s and b in s]
        if values:
            print(f"  {name:40} " + " ".join(f"{pct(values, q):7.2f}" for q in (0.5, 0.9, 0.99, 1.0)))


if __name__ == "__main__":
    main()
