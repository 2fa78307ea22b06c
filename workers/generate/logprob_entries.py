"""Logprob entries on the host: the wire rules per value and the struct assembly.

`logprobs.py` does the tensor work and hands over `RowLogprobs` (plain values, the wire
rules already applied on the device); this module turns them into the wire structs,
where the chunk is encoded. `build_position` is the value-by-value reference of the same
rules (docs/design.md §4 "Logprobs, per position") that the unit tests pin the fast paths to.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

import msgspec

from schemas.records import GenerateLogProb, GenerateLogProbsContent

if TYPE_CHECKING:
    from workers.generate.logprob_wire import StepEntries

FLOOR = -9999.0  # the lowest value on the wire; NaN and -inf become this
_SLOTS = tuple(range(1, 1 << 16))  # the rank of top slot j is j + 1 (sliced, never built per row)


class RowLogprobs(msgspec.Struct, array_like=True, gc=False):
    """One decode position's logprobs as the engine hands them over: plain values with
    every wire rule applied, not yet the ~k+1 wire structs.

    Building those structs is the biggest host cost of logprobs, so the engine leaves it
    to whoever encodes the chunk (`content()`; the worker process, while the engine runs
    its next step — vLLM v1 splits engine core and output processing the same way), and
    five plain fields cross the engine pipe far cheaper than k+1 structs.
    """

    sampled_id: int
    rank: int  # the >= rule; 0 marks a NaN row (every entry -9999.0, rank None)
    value: float
    # The request's top k in rank order (slot j has rank j+1). Tuples, not lists, when
    # decoded from the engine pipe: the worker holds a request's rows until its chunk
    # goes out, and a list of numbers is scanned by every garbage collection it lives
    # through while a tuple of numbers is dropped from the collector's view at the
    # first (decode + hold at k=5: ops/bench/engine_pipe.py --hold).
    top_ids: tuple[int, ...]
    top_values: tuple[float, ...]

    def content(self) -> GenerateLogProbsContent:
        """The wire entry: the sampled id first, then the top entries without it, cut to
        max(k, 1) (dropping the top slot that repeats it or, if none does, the last)."""
        sid, k = self.sampled_id, len(self.top_ids)
        tids, tvals = self.top_ids, self.top_values
        tranks = ()
        if k:
            try:
                pos = tids.index(sid)
            except ValueError:
                pos = k - 1
            tids, tvals = tids[:pos] + tids[pos + 1:], tvals[:pos] + tvals[pos + 1:]
            tranks = _SLOTS[:pos] + _SLOTS[pos + 1 : k]
        entry = GenerateLogProb
        if self.rank:
            top = [entry(sid, self.value, self.rank)]
            top += map(entry, tids, tvals, tranks)  # positional: the hot loop of logprobs
            return GenerateLogProbsContent(token_id=sid, logprob=self.value, rank=self.rank, top_logprobs=top)
        # the sampled value was NaN, and log_softmax makes the whole row NaN
        top = [entry(a, FLOOR, None) for a in [sid, *tids]]
        return GenerateLogProbsContent(token_id=sid, logprob=self.value, rank=None, top_logprobs=top)


def contents(rows: Sequence[RowLogprobs | None]) -> list[GenerateLogProbsContent | None]:
    return [None if r is None else r.content() for r in rows]


# --- entries as msgpack (the engine encodes them a step at a time: logprob_wire.py) -----


def msgpack_array_header(n: int) -> bytes:
    if n <= 15:
        return bytes((0x90 | n,))
    if n <= 0xFFFF:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def logprobs_raw(entries: Sequence[bytes]) -> msgspec.Raw:
    """A chunk's `GenerateLogProbs` from its tokens' encoded entries, as msgspec.Raw: the
    encoder copies it into the record as is."""
    return msgspec.Raw(b"".join((b"\x81\xa7content", msgpack_array_header(len(entries)), *entries)))


def decode_entry(data: bytes | PendingEntry) -> GenerateLogProbsContent:
    """An encoded entry as the struct (tests, and tools that inspect engine outputs)."""
    return _decode_entry(bytes(data))


_decode_entry = msgspec.msgpack.Decoder(GenerateLogProbsContent).decode


def _wire(value: float, rank: int | None) -> tuple[float, int | None]:
    """Make a value safe for JSON: NaN → FLOOR with rank None, -inf → FLOOR, clamp."""
    if math.isnan(value):
        return FLOOR, None
    if value == math.inf:
        # log_softmax is <= 0 by construction, and a +inf logit makes its whole row NaN
        # (inf - inf). This guard only keeps inf off the wire whatever the caller passes:
        # 0.0 is the largest possible logprob.
        return 0.0, rank
    return (value if value > FLOOR else FLOOR), rank


def build_position(
    sampled_id: int,
    sampled_logprob: float,
    sampled_rank: int | None,
    top_ids: Sequence[int],
    top_logprobs: Sequence[float],
    k: int,
) -> GenerateLogProbsContent:
    """The wire entry for one position (host side; pure python, every rule per value).

    `top_ids`/`top_logprobs` are in rank order and may be longer than k (the batch's
    k_max); only the first k are considered. `top_logprobs` of the result = the sampled
    token (with its >=-rule rank) first, then top entries with rank = slot (1-based),
    skipping the sampled id, cut to max(k, 1) entries. k = -1 means the whole
    vocabulary (the caller passes all V top entries). The reference of the rules value
    by value; step_to_host gets the same entries with the value rules applied on the
    device and the host left with assembly only (`_assemble`).
    """
    if k < -1:
        raise ValueError(f"logprobs k must be >= -1, got {k}")
    n = len(top_ids) if k == -1 else min(k, len(top_ids))
    limit = max(n, 1)
    value, rank = _wire(float(sampled_logprob), sampled_rank)
    entries = [GenerateLogProb(token_id=sampled_id, logprob=value, rank=rank)]
    for j in range(n):
        if len(entries) >= limit:
            break
        tid = top_ids[j]
        if tid == sampled_id:
            continue  # the sampled entry already holds this id, in first position
        v, r = _wire(float(top_logprobs[j]), j + 1)
        entries.append(GenerateLogProb(token_id=tid, logprob=v, rank=r))
    return GenerateLogProbsContent(token_id=sampled_id, logprob=value, rank=rank, top_logprobs=entries)


class PendingEntry:
    """Row `j` of a step's entries (logprob_wire.py `StepEntries`): `bytes(entry)` is its
    encoding, made with the rest of the step's the first time one is asked for."""

    __slots__ = ("step", "j")

    def __init__(self, step: StepEntries, j: int):
        self.step, self.j = step, j

    def __bytes__(self) -> bytes:
        return self.step.entry(self.j)


def encode_pending(value):
    """msgspec `enc_hook`: a PendingEntry goes on the wire as its bytes."""
    if type(value) is PendingEntry:
        return value.step.entry(value.j)
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


def resolve_pending(step) -> None:
    """Replace a step's (StepOutputs) pending entries with their bytes (an engine in the
    worker's own process: its outputs reach the chunk builder without crossing the pipe's
    encoder)."""
    if step.logprobs is not None:
        step.logprobs = tuple(None if entry is None else bytes(entry) for entry in step.logprobs)
    for out in step.others:
        if out.logprobs and type(out.logprobs[0]) is PendingEntry:
            out.logprobs = [bytes(entry) for entry in out.logprobs]
