"""Encode+decode time per chunk: genpipe's msgspec codec vs pydantic v2 + JSON.

The reference is what vLLM's Python frontend does: pydantic v2 models of the same
shape, `model_dump_json()` to encode and `model_validate_json()` to decode. Both sides
run in this one process on the same chunks (one position with 5 and with 20 candidates)
and the ratio is printed.

    python ops/bench/codec.py [--iterations N]
"""

from __future__ import annotations

import argparse
import platform
import random
import time

import msgspec
from pydantic import BaseModel

from schemas import (JSON, MSGPACK, GenerateChunk, GenerateLogProb, GenerateLogProbs,
                     GenerateLogProbsContent, decode, encode)


# --- the reference: the same shapes as pydantic v2 models ----------------------------
class PdLogProb(BaseModel):
    token_id: int
    logprob: float
    rank: int | None = None


class PdLogProbsContent(PdLogProb):
    top_logprobs: list[PdLogProb] = []


class PdLogProbs(BaseModel):
    content: list[PdLogProbsContent] | None = None


class PdChunk(BaseModel):
    request_id: str
    attempt: str
    seq: int
    token_offset: int = 0
    token_ids: list[int] = []
    logprobs: PdLogProbs | None = None
    finish_reason: str | None = None
    stop_token_id: int | None = None
    sampled_at_ns: int | None = None


def make_chunk(candidates: int, rng: random.Random) -> GenerateChunk:
    sampled = rng.randrange(32000)
    top = [GenerateLogProb(token_id=sampled, logprob=-0.25, rank=1)]
    top += [GenerateLogProb(token_id=rng.randrange(32000), logprob=-rng.random() * 10, rank=i + 2)
            for i in range(candidates - 1)]
    content = GenerateLogProbsContent(token_id=sampled, logprob=-0.25, rank=1, top_logprobs=top)
    return GenerateChunk(request_id="req-0123456789", attempt="a1b2c3", seq=42, token_offset=42,
                         token_ids=[sampled], logprobs=GenerateLogProbs(content=[content]),
                         sampled_at_ns=time.time_ns())


ROUNDS = 7


def one_round(fn, iterations: int) -> float:
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - start) / iterations


def side_by_side(reference, contender, iterations: int) -> tuple[float, float, float]:
    """Best time of each and the median per-round ratio.

    Each round times the reference and then the contender back to back, so a burst of
    load from other processes hits both; the median ratio is robust to the bursts.
    """
    reference(), contender()  # warm up
    refs, ours, ratios = [], [], []
    for _ in range(ROUNDS):
        r, c = one_round(reference, iterations), one_round(contender, iterations)
        refs.append(r)
        ours.append(c)
        ratios.append(r / c)
    return min(refs), min(ours), sorted(ratios)[len(ratios) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=20000)
    args = parser.parse_args()
    rng = random.Random(0)
    print(f"python {platform.python_version()} on {platform.machine()}, {args.iterations} iterations x "
          f"{ROUNDS} rounds; times are the best round, speedup the median per-round ratio")
    print(f"{'candidates':>10} {'codec':<22} {'us/chunk':>9} {'bytes':>6} {'speedup':>8}")
    for candidates in (5, 20):
        chunk = make_chunk(candidates, rng)
        pd_chunk = PdChunk.model_validate(msgspec.to_builtins(chunk))

        def reference():
            PdChunk.model_validate_json(pd_chunk.model_dump_json())

        ref_size = len(pd_chunk.model_dump_json())
        rows = []
        for content_type, label in ((MSGPACK, "msgspec msgpack"), (JSON, "msgspec JSON")):
            def ours(ct=content_type):
                decode(encode(chunk, ct), GenerateChunk, ct)

            ref, t, ratio = side_by_side(reference, ours, args.iterations)
            rows.append((label, t, len(encode(chunk, content_type)), ratio, ref))
        print(f"{candidates:>10} {'pydantic v2 + JSON':<22} {min(r[4] for r in rows) * 1e6:>9.2f} {ref_size:>6} {'1.0x':>8}")
        for label, t, size, ratio, _ in rows:
            print(f"{candidates:>10} {label:<22} {t * 1e6:>9.2f} {size:>6} {ratio:>7.1f}x")


if __name__ == "__main__":
    main()
