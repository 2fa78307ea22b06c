"""A decode step's logprob entries as msgpack bytes, all rows at once (numpy).

The worker puts each token's entry into a chunk record, and building its k+1 structs
to encode them was the worker's largest cost at k=5 (~30% of its loop, py-spy). The
same entries are written straight to msgpack instead, a whole step at once
(`encode_entries`), in the engine process where the step is sent (`StepEntries`: the
engine hands over `PendingEntry`s, logprobs.py `step_to_entries`), and the worker
copies them into its records as they are (`logprob_entries.logprobs_raw`).

Every entry of a row has a fixed layout (a map of token_id, logprob and rank; the
sampled token's map also has top_logprobs), so a step is one numpy structured array
whose bytes are its rows' encodings side by side. They differ from msgspec's in one
way only: ints take a fixed width (uint16, or uint32 where a value needs it; ranks of
top entries a byte when k <= 127) where msgspec writes the shortest form, and every
msgpack reader decodes both to the same values (tests/test_logprob_wire.py checks this
against `RowLogprobs.content`, the reference assembly). A row with NaN (rank 0: rank
None and every value FLOOR) has another shape and is encoded from its structs.
"""

from __future__ import annotations

import functools
from typing import Sequence

import msgspec
import numpy as np

from workers.generate.logprob_entries import PendingEntry, RowLogprobs, msgpack_array_header

_MAP4, _MAP3, _FLOAT64 = b"\x84", b"\x83", b"\xcb"
_KEY_ID, _KEY_LOGPROB, _KEY_RANK, _KEY_TOP = b"\xa8token_id", b"\xa7logprob", b"\xa4rank", b"\xactop_logprobs"
_UINT = {2: (b"\xcd", ">u2"), 4: (b"\xce", ">u4")}  # msgpack uint16/uint32 marker, numpy type
_FIXINT_MAX = 127  # msgpack's positive fixint: the value is the byte
_encode_struct = msgspec.msgpack.Encoder().encode


def _entry_type(prefix: bytes, marker: bytes, uint: str, rank: tuple[bytes, str]) -> tuple[np.dtype, dict]:
    """One map's layout (constants, then the id, logprob and rank slots) and its constants."""
    consts = {"c0": prefix + _KEY_ID + marker, "c1": _KEY_LOGPROB + _FLOAT64, "c2": rank[0]}
    fields = [("c0", f"S{len(consts['c0'])}"), ("id", uint), ("c1", "S9"), ("lp", ">f8"),
              ("c2", f"S{len(rank[0])}"), ("rank", rank[1])]
    return np.dtype(fields), consts


@functools.cache
def _row_template(top: int, width: int, fixint_ranks: bool) -> np.ndarray:
    """A one-row table with the constants filled in, for rows with `top` entries after
    the sampled one and ints `width` bytes wide."""
    marker, uint = _UINT[width]
    wide_rank = (_KEY_RANK + marker, uint)
    content, content_consts = _entry_type(_MAP4, marker, uint, wide_rank)
    sampled, sampled_consts = _entry_type(_MAP3, marker, uint, wide_rank)
    header = _KEY_TOP + msgpack_array_header(top + 1)
    fields = [("content", content), ("header", f"S{len(header)}"), ("sampled", sampled)]
    if top:
        entry, entry_consts = _entry_type(_MAP3, marker, uint, (_KEY_RANK, "u1") if fixint_ranks else wide_rank)
        fields.append(("top", entry, (top,)))
    template = np.zeros(1, np.dtype(fields))
    template["header"] = header
    for part, consts in (("content", content_consts), ("sampled", sampled_consts)) + (
            (("top", entry_consts),) if top else ()):
        for name, value in consts.items():
            template[part][name] = value
    return template


def encode_entries(sampled_ids: np.ndarray, ranks: np.ndarray, values: np.ndarray, top_ids: np.ndarray,
                   top_values: np.ndarray, ks: Sequence[int], vocab_size: int | None = None) -> list[bytes]:
    """The msgpack encoding of each row's wire entry (what `RowLogprobs(...).content()`
    encodes to), for a step's n rows at once: sampled ids, >=-rule ranks (0: a NaN row),
    wire-safe values ([n] each), top ids and values in rank order ([n, >= max(ks)]), and
    each row's k (>= 0, already cut to the vocabulary). With `vocab_size` (ids are below
    it, ranks at most it) the ints' width comes from it instead of a scan of the values."""
    n = len(sampled_ids)
    out: list[bytes] = [b""] * n
    first = ks[0] if n else 0
    if ks.count(first) == n and ranks.all():  # the usual step: one k, no NaN row
        _encode_group(out, None, first, sampled_ids, ranks, values, top_ids, top_values, vocab_size)
        return out
    ks_array = np.asarray(ks)
    for k in np.unique(ks_array).tolist():
        rows = np.flatnonzero((ks_array == k) & (ranks != 0))
        if len(rows):
            _encode_group(out, rows, k, sampled_ids[rows], ranks[rows], values[rows], top_ids[rows], top_values[rows],
                          vocab_size)
    for i in np.flatnonzero(ranks == 0).tolist():  # NaN: another shape (rank None), and rare
        k = ks[i]
        row = RowLogprobs(int(sampled_ids[i]), 0, float(values[i]), tuple(top_ids[i, :k].tolist()),
                          tuple(top_values[i, :k].tolist()))
        out[i] = _encode_struct(row.content())
    return out


def _encode_group(out: list[bytes], rows: np.ndarray | None, k: int, sid: np.ndarray, rank: np.ndarray,
                  value: np.ndarray, top_ids: np.ndarray, top_values: np.ndarray, vocab_size: int | None) -> None:
    """Rows (`rows` of `out`, None: all) that have one k and a rank: one structured
    array, one `tobytes`."""
    n = len(sid)
    top = max(k, 1) - 1  # top entries after the sampled one: the top k without it, cut to max(k, 1)
    largest = max(vocab_size, k) if vocab_size else max(int(sid.max()), int(rank.max()), k)
    if top:
        tids = top_ids[:, :k]
        # The sampled id's slot is dropped (the ids of a row are distinct), else the last.
        drop = tids == sid[:, None]
        drop[:, -1] |= ~drop.any(axis=1)
        keep = ~drop
        kept_ids = tids[keep].reshape(n, top)
        if not vocab_size:
            largest = max(largest, int(kept_ids.max()))
    table = np.repeat(_row_template(top, 2 if largest <= 0xFFFF else 4, k <= _FIXINT_MAX), n)
    for part in ("content", "sampled"):  # the content's own fields, then its sampled entry's: the same
        fields = table[part]
        fields["id"], fields["lp"], fields["rank"] = sid, value, rank
    if top:
        entries = table["top"]
        entries["id"], entries["lp"] = kept_ids, top_values[:, :k][keep].reshape(n, top)
        entries["rank"] = (keep.nonzero()[1] + 1).reshape(n, top)  # slot j has rank j + 1
    # Each row's bytes, cut in C ("V": raw bytes kept whole, where "S" would drop trailing NULs).
    encoded = table.view(f"V{table.itemsize}").tolist()
    if rows is None:
        out[:] = encoded
    else:
        for i, data in zip(rows.tolist(), encoded):
            out[i] = data


class StepEntries:
    """A step's logprob rows on the host, encoded (`encode_entries`) the first time one of
    them is asked for, all at once. The engine makes one per step and hands each output a
    `PendingEntry`, so the encoding happens where the step is sent (the engine process's
    outbox thread, while the engine runs its next step: `encode_pending`), not inside
    the step: at batch 32, k=20 it was ~0.13 ms of a 7 ms CPU step (ops/bench/engine.py)."""

    __slots__ = ("_args", "_encoded")

    def __init__(self, sampled_ids: np.ndarray, ranks: np.ndarray, values: np.ndarray, top_ids: np.ndarray,
                 top_values: np.ndarray, ks: Sequence[int], vocab_size: int | None = None):
        self._args = (sampled_ids, ranks, values, top_ids, top_values, ks, vocab_size)
        self._encoded: list[bytes] | None = None

    def entry(self, j: int) -> bytes:
        if self._encoded is None:
            self._encoded = encode_entries(*self._args)
            self._args = None  # the arrays are not needed once encoded
        return self._encoded[j]


def pending_entries(step: StepEntries, n: int) -> list[PendingEntry]:
    return [PendingEntry(step, j) for j in range(n)]
