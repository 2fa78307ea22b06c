"""What one engine step costs on the engine → worker pipe, µs per output, two comparisons:

1. pickle vs msgspec msgpack. Contender: the pipe as the engine child writes it
   (workers/generate/engine_pipe.py: a `Step` of `StepOutputs`, the step column-wise)
   and the worker reads it. Reference: pickle (protocol 5) of the same step's outputs as
   a `RequestOutput` each, what the pipe carried first.
2. A struct per output vs columns. Reference: a step as a list of `RequestOutput` structs
   (msgpack arrays), what the engines made and the pipe carried before the columns.
   Contender: the same step as the engines make it now (`StepCollector` ->
   `StepOutputs`, workers/generate/outputs.py). Each side twice: the engine process's
   part (making the step's outputs from its ids and entries, and encoding them) and the
   worker's (decoding the bytes).

The steps: a batch of B outputs, one token each, k logprobs (as the engine encodes them:
msgpack bytes per position), every side on the same ids and entries in this process.

    python ops/bench/engine_pipe.py [--batch 256] [--k 0 5] [--steps 300]
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from workers.generate.engine_pipe import Step, decode_from_child as _decode_from_child, encode as _encode  # noqa: E402
from workers.generate.outputs import RequestOutput, StepCollector  # noqa: E402
from workers.generate.synthetic import synthetic_entries, synthetic_token  # noqa: E402


class StructStep(msgspec.Struct, tag="Step"):
    """The pipe's step before the columns: a struct per output."""

    outputs: list[RequestOutput]
    step_s: float


_decode_structs = msgspec.msgpack.Decoder(StructStep).decode


def made(batch: int, k: int) -> tuple[list[str], list[int], list]:
    """A step's request ids, tokens and logprob entries (None: not asked)."""
    rids = [f"req-{i:05d}-0123456789abcdef" for i in range(batch)]
    tokens = [synthetic_token(rid, 10, 32000) for rid in rids]
    entries = synthetic_entries(tokens, [k] * batch, 32000) if k else [None] * batch
    return rids, tokens, entries


def as_structs(step) -> StructStep:
    """The step as the engines made it before: a RequestOutput each."""
    now = time.time_ns()
    return StructStep([RequestOutput(request_id=rid, token_ids=[token], logprobs=None if entry is None else [entry],
                                     num_prompt_tokens=20, num_output_tokens=11, sampled_at_ns=now)
                       for rid, token, entry in zip(*step)], 0.002)


def as_columns(step) -> Step:
    """The step as the engines make it now."""
    outputs = StepCollector()
    outputs.sampled_at_ns = time.time_ns()
    for rid, token, entry in zip(*step):
        outputs.token(rid, token, entry)
    return Step(outputs.done(), 0.002)


def per_output(fn, arg, batch: int, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn(arg)
    return (time.perf_counter() - start) / steps / batch * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--k", type=int, nargs="+", default=[0, 5])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    n, steps = args.batch, args.steps
    print("1. pickle vs the pipe (encode + decode)")
    print(f"{'k':>3} {'pickle us/out':>13} {'msgspec us/out':>14} {'ratio':>6} {'pickle B':>9} {'msgspec B':>9}")
    for k in args.k:
        rids, tokens, entries = made(n, k)
        step = as_columns((rids, tokens, entries))
        resolved = as_structs((rids, tokens, [None if e is None else bytes(e) for e in entries]))
        # (pickle cannot take the engine's pending entries: their bytes)
        reference = per_output(lambda s: pickle.loads(pickle.dumps(s.outputs, protocol=5)), resolved, n, steps)
        contender = per_output(lambda s: _decode_from_child(_encode(s)), step, n, steps)
        print(f"{k:>3} {reference:>13.2f} {contender:>14.2f} {reference / contender:>5.1f}x "
              f"{len(pickle.dumps(resolved.outputs, protocol=5)):>9} {len(_encode(step)):>9}")
    print("2. a struct per output vs columns (engine process: make + encode; worker: decode)")
    print(f"{'k':>3} {'engine structs':>14} {'columns':>8} {'ratio':>6} {'worker structs':>14} {'columns':>8} "
          f"{'ratio':>6} {'structs B':>9} {'columns B':>9}")
    for k in args.k:
        step = made(n, k)
        old_bytes, new_bytes = _encode(as_structs(step)), _encode(as_columns(step))
        old, new = _decode_structs(old_bytes).outputs, _decode_from_child(new_bytes).outputs
        assert [(o.request_id, tuple(o.token_ids), o.logprobs and tuple(o.logprobs)) for o in old] == \
            [(rid, (token,), entry and (entry,)) for rid, token, entry, _ in new.new_tokens()]  # the same step
        engine_ref = per_output(lambda s: _encode(as_structs(s)), step, n, steps)
        engine_new = per_output(lambda s: _encode(as_columns(s)), step, n, steps)
        worker_ref = per_output(_decode_structs, old_bytes, n, steps)
        worker_new = per_output(_decode_from_child, new_bytes, n, steps)
        print(f"{k:>3} {engine_ref:>14.3f} {engine_new:>8.3f} {engine_ref / engine_new:>5.2f}x "
              f"{worker_ref:>14.3f} {worker_new:>8.3f} {worker_ref / worker_new:>5.2f}x "
              f"{len(old_bytes):>9} {len(new_bytes):>9}")


if __name__ == "__main__":
    main()
