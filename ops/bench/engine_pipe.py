"""What one engine step costs on the engine → worker pipe.

1. pickle vs msgspec msgpack. Contender: the codec the engine child uses
   (workers/generate/engine_process.py: msgspec msgpack, RequestOutput as arrays).
   Reference: pickle (protocol 5), what it used before. Both encode and decode the same
   steps (a batch of B outputs, one token each, k logprobs) in this process and print µs
   per output and the ratio.
2. `--hold N`: decoding as the worker does, holding the last N steps' outputs alive (a
   request's rows wait in the worker until its chunk goes out, ~10 steps at batch 256),
   so the garbage collector's work counts. Contender: the decoded types as they are
   (tuples); reference: the same wire bytes decoded into lists (the types before).

    python ops/bench/engine_pipe.py [--batch 256] [--k 0 5] [--steps 300] [--hold 10]
"""

from __future__ import annotations

import argparse
import gc
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgspec  # noqa: E402

from schemas.records import GenerateLogProbsContent  # noqa: E402
from workers.generate.engine_process import Step, _decode_from_child, _encode  # noqa: E402
from workers.generate.outputs import RequestOutput  # noqa: E402
from workers.generate.synthetic import synthetic_row, synthetic_token  # noqa: E402


def step(batch: int, k: int) -> Step:
    outputs = []
    for i in range(batch):
        rid = f"req-{i:05d}-0123456789abcdef"
        token = synthetic_token(rid, 10, 32000)
        outputs.append(RequestOutput(request_id=rid, token_ids=[token],
                                     logprobs=[synthetic_row(token, k, 32000)] if k else None,
                                     num_prompt_tokens=20, num_output_tokens=11, sampled_at_ns=time.time_ns()))
    return Step(outputs, 0.002)


class _ListRow(msgspec.Struct, array_like=True, gc=False):  # RowLogprobs before: lists
    sampled_id: int
    rank: int
    value: float
    top_ids: list[int]
    top_values: list[float]


class _ListOutput(msgspec.Struct, kw_only=True, gc=False, array_like=True):  # RequestOutput before
    request_id: str
    token_ids: list[int]
    logprobs: list[_ListRow] | None = None
    finish_reason: str | None = None
    stop_token_id: int | None = None
    prompt_logprobs: list[GenerateLogProbsContent | None] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    sampled_at_ns: int = 0


class _ListStep(msgspec.Struct, tag="Step"):
    outputs: list[_ListOutput]
    step_s: float


def held(decode, data: bytes, batch: int, steps: int, hold: int) -> float:
    """µs per output to decode `steps` steps while the last `hold` stay alive."""
    kept: list = []
    gc.collect()
    start = time.perf_counter()
    for _ in range(steps):
        kept.append(decode(data))
        if len(kept) > hold:
            kept.pop(0)
    return (time.perf_counter() - start) / steps / batch * 1e6


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
    parser.add_argument("--hold", type=int, default=10, help="steps held alive in part 2 (0: skip it)")
    parser.add_argument("--rounds", type=int, default=3, help="part 2: interleaved rounds (median)")
    args = parser.parse_args()
    print(f"{'k':>3} {'pickle us/out':>13} {'msgspec us/out':>14} {'ratio':>6} {'pickle B':>9} {'msgspec B':>9}")
    for k in args.k:
        message = step(args.batch, k)
        assert _encode(_decode_from_child(_encode(message))) == _encode(message)  # the same step comes out
        reference = per_output(lambda m: pickle.loads(pickle.dumps(m, protocol=5)), message, args.steps)
        contender = per_output(lambda m: _decode_from_child(_encode(m)), message, args.steps)
        print(f"{k:>3} {reference:>13.2f} {contender:>14.2f} {reference / contender:>5.1f}x "
              f"{len(pickle.dumps(message, protocol=5)):>9} {len(_encode(message)):>9}")
    if not args.hold:
        return
    print(f"\ndecode holding the last {args.hold} steps (batch {args.batch}), median of {args.rounds} rounds:")
    print(f"{'k':>3} {'lists us/out':>12} {'tuples us/out':>13} {'ratio':>6}")
    as_lists = msgspec.msgpack.Decoder(_ListStep).decode
    for k in args.k:
        data = _encode(step(args.batch, k))
        assert msgspec.msgpack.encode(as_lists(data)) == data  # the same wire bytes, either way
        ref, con = [], []
        for _ in range(args.rounds):
            ref.append(held(as_lists, data, args.batch, args.steps, args.hold))
            con.append(held(_decode_from_child, data, args.batch, args.steps, args.hold))
        ref_m, con_m = statistics.median(ref), statistics.median(con)
        print(f"{k:>3} {ref_m:>12.2f} {con_m:>13.2f} {ref_m / con_m:>5.1f}x")


if __name__ == "__main__":
    main()
