"""What one engine step costs on the engine → worker pipe.

1. pickle vs msgspec msgpack. Contender: the codec the engine child uses
   (workers/generate/engine_process.py: msgspec msgpack, RequestOutput as arrays).
   Reference: pickle (protocol 5), what it used before. Both encode and decode the same
   steps (a batch of B outputs, one token each, k logprobs, as the engine encodes them:
   msgpack bytes per position) in this process and print µs per output and the ratio.

(Its part 2, `--hold`, compared logprob rows decoded as tuples and as lists; the engine
now sends each position's entry as bytes, which the garbage collector never scans, so
that comparison is gone: BENCHMARKS.md keeps its figures.)

    python ops/bench/engine_pipe.py [--batch 256] [--k 0 5] [--steps 300]
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from workers.generate.engine_process import Step, _decode_from_child, _encode  # noqa: E402
from workers.generate.outputs import RequestOutput  # noqa: E402
from workers.generate.synthetic import synthetic_entries, synthetic_token  # noqa: E402


def step(batch: int, k: int) -> Step:
    rids = [f"req-{i:05d}-0123456789abcdef" for i in range(batch)]
    tokens = [synthetic_token(rid, 10, 32000) for rid in rids]
    entries = synthetic_entries(tokens, [k] * batch, 32000) if k else [None] * batch
    outputs = [RequestOutput(request_id=rid, token_ids=[token], logprobs=None if entry is None else [entry],
                             num_prompt_tokens=20, num_output_tokens=11, sampled_at_ns=time.time_ns())
               for rid, token, entry in zip(rids, tokens, entries)]
    return Step(outputs, 0.002)


def per_output(fn, message: Step, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn(message)
    return (time.perf_counter() - start) / steps / len(message.outputs) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--k", type=int, nargs="+", default=[0, 5])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    print(f"{'k':>3} {'pickle us/out':>13} {'msgspec us/out':>14} {'ratio':>6} {'pickle B':>9} {'msgspec B':>9}")
    for k in args.k:
        message = step(args.batch, k)
        assert _encode(_decode_from_child(_encode(message))) == _encode(message)  # the same step comes out
        reference = per_output(lambda m: pickle.loads(pickle.dumps(m, protocol=5)), message, args.steps)
        contender = per_output(lambda m: _decode_from_child(_encode(m)), message, args.steps)
        print(f"{k:>3} {reference:>13.2f} {contender:>14.2f} {reference / contender:>5.1f}x "
              f"{len(pickle.dumps(message, protocol=5)):>9} {len(_encode(message)):>9}")


if __name__ == "__main__":
    main()
