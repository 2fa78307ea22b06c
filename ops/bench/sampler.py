"""The sampler alone, a reference revision's against this checkout's, on one device.

    python ops/bench/sampler.py --reference REV [--device cpu|cuda] [--threads 1] [--rounds 10]
    python ops/bench/sampler.py --reference-file OLD_SAMPLER.py ...   (a machine without git)

On the device (no git there): here `git show REV:workers/generate/sampler.py >
.kit/sampler_ref.py`, then run(command="python3 ops/bench/sampler.py --reference-file
.kit/sampler_ref.py --device cuda --shapes 256x32000 256x128256", carry=[".kit"]).

Both sides' workers/generate/sampler.py are loaded in this process (the reference's from
`git show REV:workers/generate/sampler.py`, or from --reference-file) and called on the
same logits (random normal x 3: peaked like a model's): `process_logits` (temperature,
top-k, top-p) and `sample` (those and the draw), for each batch x vocabulary and each set
of sampling params below. Calls alternate ABBA; printed per case: each side's median ms per
call (on a GPU, synchronized), the ratio reference / this, and whether both sides' masks
(`process_logits`'s finite entries and values) are identical. The draws are not compared:
a change to the random draws makes them differ on purpose.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SHAPES = ((256, 2000), (256, 32000), (64, 128256))  # (--shapes 256x128256 too on a GPU: ~6 s a call here)
PARAMS = (dict(temperature=0.8, top_p=0.95), dict(temperature=1.0), dict(temperature=0.8, top_k=50, top_p=0.9),
          dict(temperature=0.7, top_k=40))


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(call, device: str) -> float:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    call()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", metavar="REV", help="the old sampler: a git revision")
    parser.add_argument("--reference-file", type=Path, help="the old sampler's file (instead of --reference)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the engine's default: 1)")
    parser.add_argument("--rounds", type=int, default=10, help="timed calls per side and case, ABBA")
    parser.add_argument("--shapes", nargs="+", metavar="BxV", help="batch x vocabulary, e.g. 256x2000")
    args = parser.parse_args()
    if bool(args.reference) == bool(args.reference_file):
        parser.error("give one of --reference REV or --reference-file PATH")
    import torch

    from schemas.records import SamplingParams

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="genpipe-sampler-") as tmp:
        old_path = args.reference_file
        if old_path is None:
            old_path = Path(tmp) / "sampler_ref.py"
            old_path.write_bytes(subprocess.run(["git", "show", f"{args.reference}:workers/generate/sampler.py"],
                                                cwd=ROOT, check=True, capture_output=True).stdout)
        sides = {"ref": load(old_path, "genpipe_sampler_ref"),
                 "new": load(ROOT / "workers/generate/sampler.py", "genpipe_sampler_new")}
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    print(f"sampler, {args.reference or args.reference_file} (ref) against this checkout (new), device "
          f"{args.device}, {args.threads} CPU thread(s), {args.rounds} calls a side, ABBA; ms per call, medians")
    print(f"{'batch x vocab':>14} {'params':<36} {'process ref':>11} {'new':>8} {'ratio':>6} "
          f"{'sample ref':>10} {'new':>8} {'ratio':>6}  masks")
    generator = torch.Generator().manual_seed(0)
    for b, vocab in shapes:
        logits = (torch.randn(b, vocab, generator=generator) * 3).to(args.device)
        for params in PARAMS:
            rows = [SamplingParams(**params)] * b
            tensors = {side: m.make_sampling_tensors(rows, args.device) for side, m in sides.items()}
            outs = {side: m.process_logits(logits, tensors[side]) for side, m in sides.items()}
            same = torch.equal(outs["ref"], outs["new"])
            figures = {}
            for what in ("process", "sample"):
                times: dict[str, list[float]] = {"ref": [], "new": []}
                for i in range(args.rounds + 1):
                    for side in (("ref", "new") if i % 2 == 0 else ("new", "ref")):
                        m, st = sides[side], tensors[side]
                        call = ((lambda: m.process_logits(logits, st)) if what == "process" else
                                (lambda: m.sample(logits, st, [None] * b)))
                        ms = timed(call, args.device)
                        if i:  # (the first call of each side warms up)
                            times[side].append(ms)
                figures[what] = (median(times["ref"]), median(times["new"]))
            (pr, pn), (sr, sn) = figures["process"], figures["sample"]
            label = ", ".join(f"{k}={v}" for k, v in params.items())
            print(f"{f'{b}x{vocab}':>14} {label:<36} {pr:>11.2f} {pn:>8.2f} {pr / pn:>5.2f}x {sr:>10.2f} {sn:>8.2f} "
                  f"{sr / sn:>5.2f}x  {'identical' if same else 'DIFFERENT'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
