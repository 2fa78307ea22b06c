"""What a decode step's logprobs cost on the host, per token: entries encoded by the engine
a step at a time (contender) against structs built per token (reference), in one process.

    python ops/bench/logprob_wire.py [--batch 256] [--vocab 32000] [--k 5 20] [--rounds 5]

Both sides start from the same logits ([batch, vocab] float32 on the CPU, one sampled id
a row) and end with the chunk records' logprobs encoded, 10 tokens a chunk, as the
generate worker publishes them; they differ in where the entries are assembled:
- reference (how the engine handed logprobs over before logprob_wire.py, from today's host
  arrays): the engine child builds `RowLogprobs` (`step_to_rows`) and sends them on the
  pipe; the worker builds each token's k+1 structs (`RowLogprobs.content`) and msgspec
  encodes them with the chunk;
- contender: the engine child encodes the step's entries at once (`step_to_entries`,
  numpy) and sends bytes on the pipe; the worker joins them into the chunk (`logprobs_raw`).
The device work (log-softmax, top-k, ranks: `_step_rows`) is the same call on both
sides, made once and printed on its own (once, not a best: on the CPU it is most of a
step). Printed: µs per token of the host assembly in the engine child (pipe encode
included) and in the worker (pipe decode included), each side's best of --rounds
(interleaved), and the ratios. The decoded chunks must be equal, or the row says DIFFERENT.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgspec  # noqa: E402
import torch  # noqa: E402

from schemas.records import GenerateLogProbs  # noqa: E402
from workers.generate.logprob_entries import RowLogprobs, encode_pending, logprobs_raw  # noqa: E402
from workers.generate.logprobs import _assemble, _entries, _step_rows  # noqa: E402

CHUNK = 10
VOCAB = 32000  # --vocab (set by main)


class _Rows(msgspec.Struct, array_like=True):  # a step's logprobs on the pipe (encoded as a list)
    rows: list


class _StructRows(msgspec.Struct, array_like=True):  # ... decoded by the reference's worker
    rows: list[RowLogprobs]


class _ByteRows(msgspec.Struct, array_like=True):  # ... decoded by the contender's worker
    rows: list[bytes]


_encode = msgspec.msgpack.Encoder().encode
_encode_pending = msgspec.msgpack.Encoder(enc_hook=encode_pending).encode
_decode_structs = msgspec.msgpack.Decoder(_StructRows).decode
_decode_bytes = msgspec.msgpack.Decoder(_ByteRows).decode


def reference(host_step) -> tuple[float, float, list[bytes]]:
    ids, rows, (eff, *lists) = host_step
    t0 = time.process_time()
    out: list = [None] * len(ids)
    _assemble(out, rows, eff, ids, *lists)  # step_to_rows after the device work
    wire = _encode(_Rows(out))
    t1 = time.process_time()
    got = _decode_structs(wire).rows
    chunks = [_encode(GenerateLogProbs(content=[r.content() for r in got[i:i + CHUNK]]))
              for i in range(0, len(got), CHUNK)]
    return t1 - t0, time.process_time() - t1, chunks


def contender(host_step) -> tuple[float, float, list[bytes]]:
    ids, rows, host = host_step
    t0 = time.process_time()
    out = _entries(ids, rows, host, VOCAB)  # step_to_entries after the device work
    wire = _encode_pending(_Rows(out))  # the outbox thread's encode: the entries' too
    t1 = time.process_time()
    got = _decode_bytes(wire).rows
    chunks = [_encode(logprobs_raw(got[i:i + CHUNK])) for i in range(0, len(got), CHUNK)]
    return t1 - t0, time.process_time() - t1, chunks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--k", type=int, nargs="+", default=[5, 20])
    parser.add_argument("--steps", type=int, default=20, help="steps per timed run")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    global VOCAB
    VOCAB = args.vocab
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    steps = [torch.randn(args.batch, args.vocab, generator=g) * 3 for _ in range(args.steps)]
    sampled = [s.softmax(-1).multinomial(1, generator=g).view(-1) for s in steps]
    tokens = args.batch * args.steps
    print(f"batch {args.batch}, vocab {args.vocab}, {args.steps} steps a run, best of {args.rounds}; µs per token")
    print(f"{'k':>3} {'device':>7} {'child ref':>9} {'child new':>9} {'ratio':>6} "
          f"{'worker ref':>10} {'worker new':>10} {'ratio':>6} {'both':>6}  chunks")
    status = 0
    for k in args.k:
        ks = [k] * args.batch
        t = time.process_time()
        host_steps = [_step_rows(x, s, ks, None) for x, s in zip(steps, sampled)]  # the device work, once
        device = time.process_time() - t
        best = {"ref": [1e9, 1e9], "new": [1e9, 1e9]}
        encoded: dict[str, list] = {}
        for r in range(args.rounds):
            for side in (("ref", "new") if r % 2 == 0 else ("new", "ref")):
                fn = reference if side == "ref" else contender
                child = worker = 0.0
                chunks = []
                for host_step in host_steps:
                    c, w, out = fn(host_step)
                    child, worker = child + c, worker + w
                    chunks += out
                best[side] = [min(best[side][0], child), min(best[side][1], worker)]
                encoded[side] = chunks
        same = [msgspec.msgpack.decode(c, type=GenerateLogProbs) for c in encoded["ref"]] == \
            [msgspec.msgpack.decode(c, type=GenerateLogProbs) for c in encoded["new"]]
        ref, new = ([v / tokens * 1e6 for v in best[side]] for side in ("ref", "new"))
        print(f"{k:>3} {device / tokens * 1e6:>7.2f} {ref[0]:>9.2f} {new[0]:>9.2f} {ref[0] / new[0]:>5.2f}x "
              f"{ref[1]:>10.2f} {new[1]:>10.2f} {ref[1] / new[1]:>5.2f}x {sum(ref) / sum(new):>5.2f}x  "
              f"{'identical' if same else 'DIFFERENT'}")
        status |= not same
    return status


if __name__ == "__main__":
    sys.exit(main())
