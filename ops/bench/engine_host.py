"""The engine's host work per step, old code against new, in one run: what `Engine.step()`
does besides the model's forward (the schedule, the step's plan, sampling, the ids'
copy to the host, the stop rules, the step's outputs). On a GPU the device waits for it:
0.16-0.65 ms a step on the H200's host, 5-11% of a CUDA-graph step (BENCHMARKS.md, "The
engine on a GPU").

Each side is a child process running one checkout's engine (ops/bench/paired.py: kept
up, timed runs ABBA, the median of the pairs' ratios). A workload `B:k` queues 2B
requests at once (prompts of 4-60 ids, max_tokens 16-143 spread so that requests end
and join on most steps, greedy, EOS ignored, `logprobs=k` when k > 0; `B:k:sampled`:
temperature 0.8, top_p 0.95, the default generator seeded before each run, so both sides
draw alike; `B:k:seeded`: the same, each request with its own seed; `B:k:mixed`: every
other request greedy, the rest sampled) on an engine of max_batch B over a tiny Llama
with random weights (ops/bench/random_model.py's `tiny`: the forward is small, so the
host work is most of a step), and steps it to the end.
Timed, on the stepping thread's CPU clock (one torch thread): each step minus its
`runner.execute` (the forward; printed too, from the last run). On the CPU that host
figure also holds sampling's own arithmetic (argmax over B x 2,000 logits, a sampled
row's top-p and random draws). Both sides must sample the same ids (the digest), unless
--draws-may-differ (a change to the draws).

    python ops/bench/engine_host.py --reference REV [--workloads 256:0 64:0 256:5 256:0:sampled] [--rounds 10]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paired import ROOT, compare, use_code, worktree  # noqa: E402  (ops/bench/paired.py)


def requests(batch: int, k: int, how: str = "greedy") -> list:
    from schemas.records import GenerateRequest, SamplingParams

    def params(i: int) -> dict:
        greedy = how == "greedy" or (how == "mixed" and i % 2)
        return dict(temperature=0.0) if greedy else dict(temperature=0.8, top_p=0.95)

    return [GenerateRequest(request_id=f"r{i}", prompt_token_ids=[1] + [3 + (i * 7 + j) % 1990 for j in range(3 + i % 57)],
                            sampling=SamplingParams(max_tokens=16 + (i * 37) % 128, ignore_eos=True, logprobs=k or None,
                                                    seed=i if how == "seeded" else None, **params(i)))
            for i in range(2 * batch)]


def serve(args) -> None:
    """The child: one timed run per workload line on stdin, a JSON line out."""
    use_code()
    import torch

    from workers.generate.engine import Engine

    torch.set_num_threads(1)
    engines: dict[int, Engine] = {}
    for line in sys.stdin:
        batch, k, how = (line.strip() + ":greedy").split(":")[:3]
        batch, k = int(batch), int(k)
        engine = engines.get(batch)
        if engine is None:
            engine = engines[batch] = Engine(args.model, max_batch=batch)
            forward = engine.runner.execute
            spent = engine.forward_s = [0.0]

            def timed(plan, forward=forward, spent=spent):
                started = time.thread_time()
                try:
                    return forward(plan)
                finally:
                    spent[0] += time.thread_time() - started

            engine.runner.execute = timed
        torch.manual_seed(0)  # (unseeded requests share the default generator's draws: alike on both sides)
        for request in requests(batch, k, how):
            engine.add(request)
        digest, steps, tokens = hashlib.sha256(), 0, 0
        engine.forward_s[0] = 0.0
        started = time.thread_time()
        while engine.has_work():
            for out in engine.step():
                digest.update(f"{out.request_id}:{out.token_ids}:{out.finish_reason};".encode())
                tokens += len(out.token_ids)
            steps += 1
        host = time.thread_time() - started - engine.forward_s[0]
        print(json.dumps({"cpu_s": host, "forward_s": engine.forward_s[0], "steps": steps, "tokens": tokens,
                          "digest": digest.hexdigest()}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", metavar="REV", help="the old code: a git revision (required)")
    parser.add_argument("--workloads", nargs="+", default=["256:0", "64:0", "256:5", "256:0:sampled"],
                        metavar="B:k[:sampled|seeded|mixed]")
    parser.add_argument("--rounds", type=int, default=10, help="timed runs of each workload per side")
    parser.add_argument("--draws-may-differ", action="store_true",
                        help="the sides may sample different ids (a change to the sampler's draws): timed, not compared")
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args)
        return 0
    if not args.reference:
        parser.error("--reference REV is required (the old code to compare with)")
    sys.path.insert(0, str(ROOT))
    from ops.bench.random_model import write_random_model

    with tempfile.TemporaryDirectory(prefix="genpipe-engine-host-") as tmp:
        write_random_model("tiny", Path(tmp))
        print(f"host work per engine step, {args.reference} (ref) against this checkout (new), "
              f"{args.rounds} runs a side, ABBA")
        print(f"{'workload':>8} {'steps':>6} {'ref ms/step':>11} {'new ms/step':>11} {'best':>6} {'paired':>7} "
              f"{'forward ms/step':>15}")

        def row(workload: str, r: dict) -> str:
            best, steps = r["best"], r["steps"]
            forward = f"{r['forward_s'] / steps * 1e3:>15.3f}" if "forward_s" in r else f"{'-':>15}"
            return (f"{workload:>8} {steps:>6} {best['ref'] / steps * 1e3:>11.3f} {best['new'] / steps * 1e3:>11.3f} "
                    f"{best['ref'] / best['new']:>5.2f}x {r['paired']:>6.2f}x {forward}")

        return compare(Path(__file__).resolve(), worktree(args.reference), ROOT, ["--model", tmp], args.workloads,
                       args.rounds, row, may_differ=args.draws_may_differ)


if __name__ == "__main__":
    sys.exit(main())
