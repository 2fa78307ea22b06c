"""Integer-id logprobs for sampled and prompt tokens (docs/design.md §3, §4 "Logprobs, per position").

Device side (`topk_logprobs`): float32 log-softmax over the whole vocabulary, the
sampled token's value and rank, and the top `k_max` ids/values: a plain float topk,
with the order of equal values fixed afterwards (`_top_ids`). The wire value rules run
on the device too (NaN and -inf → -9999.0, everything clamped to >= -9999.0), and
`step_to_host` moves the B sampled ids, ranks and values and the [B, k_max] top
ids/values to the host in ONE copy: a device→host copy is a full stream sync, so the
cost of logprobs is the number of copies, not the FLOPs. The host only assembles the
entries (sampled id first, its duplicate dropped, the cut to max(k, 1)) from numpy arrays
of that copy: the engine's `step_to_entries` as msgpack, a step at a time
(logprob_wire.py), and `step_to_host` as structs (`RowLogprobs.content`, the reference;
prompt logprobs). On the CPU, where reading a tensor is free, `_rows_cpu` takes a shorter
path for the common rows and sends the rest back to the exact one.

Tie rule: top entries are ordered by (logprob desc, token id asc), NaN counting as
-inf, so a row's list never depends on the batch, k_max or device. A row is NaN
throughout or not at all (log_softmax: any NaN, +inf or all -inf poisons the row's
sum), which the host sees as rank 0: every entry -9999.0 with rank None.

Engine usage, one decode step:

    ids, entries = step_to_entries(raw_logits, sampled, [req.k for req in batch])

`batch_positions` is `step_to_host` (structs) without the ids. `raw_logits` must be the model's logits
before min_tokens suppression and before temperature/top-k/top-p (vLLM's raw
logprobs); pass `processed=` to switch to processed logprobs. Rows whose k is None
cost nothing.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from schemas.records import GenerateLogProbsContent
from workers.generate.logprob_entries import FLOOR, RowLogprobs, contents
from workers.generate.logprob_wire import PendingEntry, StepEntries, pending_entries

PROMPT_BLOCK_ELEMS = 1 << 25  # rows x vocab per prompt-logprobs block (~128 MiB float32)


class LogprobTensors(NamedTuple):
    """Device tensors for B rows; top entries are in rank order (slot j = rank j+1)."""

    sampled_logprob: Tensor  # [B] float32
    sampled_rank: Tensor  # [B] int64, #entries with logprob >= the sampled one
    top_ids: Tensor  # [B, k_max] int64
    top_logprobs: Tensor  # [B, k_max] float32


def _order_key(lp: Tensor) -> Tensor:
    """A total order on (logprob desc, token id asc) as one int64 per entry.

    The exact (and slower) ranking: the whole-vocabulary case and the rows whose float
    top-k cut falls inside a run of equal values use it (see `_top_ids`). NaN sorts
    below -inf here; the callers pass NaN-free input (NaN already replaced by -inf).
    """
    bits = lp.view(torch.int32)  # a view: float32 bits as sign-magnitude ints
    # Flip the magnitude bits of negatives so ints order like the floats.
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    ordered = ordered.masked_fill(lp.isnan(), -(2**31))  # NaN patterns: below -inf
    rev_ids = (2**32 - 1) - torch.arange(lp.shape[-1], device=lp.device, dtype=torch.int64)
    # high word: the value order; low word: the reversed id, so lower ids win ties.
    return (ordered.to(torch.int64) << 32).add_(rev_ids)


def _sort_small(ids: Tensor, vals: Tensor) -> tuple[Tensor, Tensor]:
    """Order the [B, k] candidates by (value desc, id asc): two small sorts, no [B, V] work."""
    ids, perm = ids.sort(dim=-1)
    vals, perm = vals.gather(-1, perm).sort(dim=-1, descending=True, stable=True)
    return ids.gather(-1, perm), vals


def _device_kind(device: torch.device) -> str:
    """How a device is treated (tests patch this to run every path on the CPU).

    "cpu": step_to_host takes `_rows_cpu` (reading a tensor costs no sync there), and
    `_top_ids` checks the cut (the CPU topk is a heap: any of the tied ids may enter).
    "cuda": PyTorch's CUDA topk kernels (single- and multi-block `gatherTopK`) fill the
    slots left at the k-th value with "the first seen set", in index order, i.e. the
    lowest ids of a run of equal values, so the cut needs no check and no extra sync.
    "other" (ROCm, whose kernel gathers with atomics; MPS; ...): the cut is checked,
    at the cost of one extra sync.
    """
    if device.type == "cpu":
        return "cpu"
    return "cuda" if device.type == "cuda" and torch.version.hip is None else "other"


def _fix_cut(keyed: Tensor, vals: Tensor, ids: Tensor, k: int) -> None:
    """Rows whose k-th and (k+1)-th values tie: take the lowest tied ids (exact int64 key)."""
    rows = (vals[:, k - 1] == vals[:, k]).nonzero().view(-1)
    if rows.numel():
        ids[rows, :k] = _order_key(keyed.index_select(0, rows)).topk(k, dim=-1, sorted=True).indices


@functools.lru_cache(maxsize=16)
def _strides(s: int, c: int) -> Tensor:
    return torch.arange(0, s * c, c).view(1, s, 1)  # CPU, never written to


def _topk_cpu(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """torch.topk(x, k) values (exact, sorted) and ids for a [B, V] CPU tensor, faster.

    The CPU kernel runs a heap over every entry. Cheaper: view the first s*c entries of
    a row as [s, c] (chunk j = ids j, j+c, j+2c, ...), take the c chunk maxima (one
    vectorised pass), and run topk only over the k chunks with the largest maxima plus
    the < s leftover ids: no entry of the top k lives in another chunk, since those k
    maxima already reach its chunk's maximum. Same values; equal values may come in
    another order (the callers deal with ties: `_top_ids`, `_rows_cpu`).
    """
    b, v = x.shape
    s = max(1, round(math.sqrt(v / k)))  # balances the c-wide and the s*k-wide topk
    c = v // s
    if s < 4 or c < k or b * v <= 1 << 14:  # too small to pay for the extra ops (measured)
        return x.topk(k, dim=-1, sorted=True)
    maxima = (x if s * c == v else x[:, : s * c]).view(b, s, c).amax(dim=1)  # [B, c]
    chunks = maxima.topk(k, dim=-1, sorted=False).indices
    cand = (_strides(s, c) + chunks.unsqueeze(1)).view(b, s * k)
    if s * c != v:
        cand = torch.cat([cand, torch.arange(s * c, v, device=x.device).expand(b, v - s * c)], dim=1)
    vals, pos = x.gather(1, cand).topk(k, dim=-1, sorted=True)
    return vals, cand.gather(1, pos)


def _top_ids(lp: Tensor, k: int) -> Tensor:
    """Top k ids [B, k] of lp [B, V] (0 < k) in (logprob desc, id asc) order, NaN as -inf.

    A plain float topk does the work. It may leave equal values in any order, so two
    small sorts on [B, k] put them in id order, and the rows whose k-th and (k+1)-th
    values tie (which tied ids enter?) are redone with the exact int64 `_order_key`.
    """
    v = lp.shape[1]
    keyed = lp.nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    if k >= v:  # the whole vocabulary: one exact sort, no cut to worry about
        return _order_key(keyed).topk(v, dim=-1, sorted=True).indices
    kind = _device_kind(lp.device)
    if kind == "cuda":
        ids = keyed.topk(k, dim=-1, sorted=False).indices
    else:
        vals, ids = _topk_cpu(keyed, k + 1) if kind == "cpu" else keyed.topk(k + 1, dim=-1, sorted=True)
        _fix_cut(keyed, vals, ids, k)
        ids = ids[:, :k]
    return _sort_small(ids, keyed.gather(1, ids))[0]


def topk_logprobs(logits: Tensor, sampled: Tensor, k_max: int) -> LogprobTensors:
    """Logprobs of `sampled` ([B] long) and the top `k_max` entries of `logits` [B, V].

    Values are log_softmax of the given logits computed in float32 whatever their dtype.
    k_max is clamped to [0, V]; k_max = 0 yields [B, 0] top tensors. Top entries are in
    (logprob desc, token id asc) order, NaN counting as -inf, so a row's first k
    entries are the same whatever k_max, batch or device it ran with.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    sampled = sampled.to(device=lp.device, dtype=torch.int64).view(-1, 1)
    sampled_lp = lp.gather(1, sampled)  # [B, 1]
    # Ties count against the sampled token; NaN compares false so it is never counted
    # (a NaN sampled value gets rank None on the host anyway).
    rank = (lp >= sampled_lp).sum(dim=-1)
    k = max(0, min(int(k_max), lp.shape[-1]))
    if k == 0:
        top_ids = torch.empty(lp.shape[0], 0, dtype=torch.int64, device=lp.device)
    else:
        top_ids = _top_ids(lp, k)
    return LogprobTensors(sampled_lp.view(-1), rank, top_ids, lp.gather(1, top_ids))


def _to_host(*tensors: Tensor) -> list[list]:
    """Each tensor as a (nested) python list, in ONE device→host copy.

    Every copy from a CUDA tensor blocks on the stream, so off the CPU all of them
    travel as one int64 tensor, floats as float64 bit patterns (float32 is exact in
    float64); the typed views are taken on the host copy, so ids come back as python
    ints and values as python floats with no per-value conversion. On the CPU there is
    nothing to copy: each tensor is read directly.
    """
    if all(t.device.type == "cpu" for t in tensors):
        return [t.tolist() for t in tensors]
    return _packed_to_host(tensors)


def _packed_to_host(tensors: Sequence[Tensor]) -> list[list]:
    """`_to_host` off the CPU: one int64 tensor on the tensors' device, one copy."""
    return [part.tolist() for part in _packed_copy(tensors)]


def _packed_copy(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The tensors on the host (ints int64, floats float64) from ONE copy of one int64 tensor."""
    dev = next((t.device for t in tensors if t.device.type != "cpu"), tensors[0].device)
    parts = [(t.double() if t.is_floating_point() else t.to(torch.int64)).to(dev).reshape(-1) for t in tensors]
    flat = torch.cat([p if p.dtype == torch.int64 else p.view(torch.int64) for p in parts]).cpu()
    out, at = [], 0
    for t in tensors:
        part = flat[at : at + t.numel()]
        at += t.numel()
        part = part.view(torch.float64) if t.is_floating_point() else part
        out.append(part.view(t.shape))
    return out


def _arrays_to_host(*tensors: Tensor) -> list[np.ndarray]:
    """`_to_host` as numpy arrays (ints int64, floats float64), in ONE copy off the CPU."""
    if all(t.device.type == "cpu" for t in tensors):
        return [(t.double() if t.is_floating_point() else t.to(torch.int64)).numpy() for t in tensors]
    return [part.numpy() for part in _packed_copy(tensors)]


def logprobs_to_host(t: LogprobTensors) -> tuple[list[float], list[int], list[list[int]], list[list[float]]]:
    """(sampled logprobs, ranks, top ids, top logprobs) as python lists, in ONE copy."""
    return tuple(_to_host(t.sampled_logprob, t.sampled_rank, t.top_ids, t.top_logprobs))  # type: ignore[return-value]


def _k_for(k: int, vocab: int) -> int:
    if k < -1:
        raise ValueError(f"logprobs k must be >= -1, got {k}")
    return vocab if k == -1 else min(k, vocab)


def step_to_host(
    logits: Tensor,
    sampled: Tensor,
    ks: Sequence[int | None],
    processed: Tensor | None = None,
) -> tuple[list[int], list[GenerateLogProbsContent | None]]:
    """All B sampled ids and the logprob entries of one decode step, in ONE device→host copy.

    The engine needs the sampled ids on the host anyway; taking them here, in the same
    copy as the logprobs, keeps a decode step at one stream sync. See batch_positions.
    """
    ids, rows = step_to_rows(logits, sampled, ks, processed)
    return ids, contents(rows)


def step_to_rows(
    logits: Tensor,
    sampled: Tensor,
    ks: Sequence[int | None],
    processed: Tensor | None = None,
) -> tuple[list[int], list[RowLogprobs | None]]:
    """step_to_host with the entries left as RowLogprobs (the reference assembly)."""
    ids, rows, host = _step_rows(logits, sampled, ks, processed)
    out: list[RowLogprobs | None] = [None] * len(ids)
    if host is not None:
        eff, *lists = host
        _assemble(out, rows, eff, ids, *lists)
    return ids, out


def step_to_entries(
    logits: Tensor,
    sampled: Tensor,
    ks: Sequence[int | None],
    processed: Tensor | None = None,
) -> tuple[list[int], list[PendingEntry | None]]:
    """step_to_host with each entry as its msgpack encoding (`bytes(entry)`), the whole
    step's encoded at once when first asked for (logprob_wire.py `StepEntries`): what the
    engine emits, and what the worker puts into chunk records as it is."""
    ids, rows, host = _step_rows(logits, sampled, ks, processed)
    return ids, _entries(ids, rows, host, logits.shape[-1])


def _entries(ids: list[int], rows: list[int], host, vocab_size: int) -> list[PendingEntry | None]:
    out: list[PendingEntry | None] = [None] * len(ids)
    if host is not None:
        eff, ranks, values, top_ids, top_values = host
        sampled = np.array(ids if len(rows) == len(ids) else [ids[i] for i in rows], dtype=np.int64)
        step = StepEntries(sampled, ranks, values, top_ids, top_values, eff, vocab_size)
        for i, entry in zip(rows, pending_entries(step, len(rows))):
            out[i] = entry
    return out


def _step_rows(logits: Tensor, sampled: Tensor, ks: Sequence[int | None], processed: Tensor | None):
    """The sampled ids, the rows that asked for logprobs and, if any did, their host
    arrays: (effective ks, ranks [n], values [n], top ids [n, k_max], top values [n, k_max])."""
    src = logits if processed is None else processed
    b, vocab = src.shape
    if len(ks) != b:
        raise ValueError(f"{len(ks)} ks for {b} rows")
    if sampled.dim() != 1 or sampled.dtype != torch.int64:
        sampled = sampled.reshape(-1).to(torch.int64)
    rows = [i for i, k in enumerate(ks) if k is not None]
    if not rows:
        return sampled.tolist(), rows, None
    eff = [k if 0 <= k <= vocab else _k_for(k, vocab) for k in (ks[i] for i in rows)]  # type: ignore[operator]
    sel_src, sel_sampled = src, sampled if sampled.device == src.device else sampled.to(src.device)
    if len(rows) < b:  # only the rows that asked pay for the V-wide work
        idx = torch.tensor(rows, device=src.device)
        sel_src, sel_sampled = src.index_select(0, idx), sel_sampled.index_select(0, idx)
    k_max = max(eff)
    # 16-bit logits tie too often for the CPU short path to pay (most rows redone).
    if _device_kind(src.device) == "cpu" and src.dtype.itemsize >= 4 and 0 < k_max < vocab:
        ids = sampled.tolist()
        rows_data = _rows_cpu(sel_src, sel_sampled, k_max)
    else:
        sampled_host, *rows_data = _arrays_to_host(sampled, *_rows_exact(sel_src, sel_sampled, k_max))
        ids = sampled_host.tolist()
    return ids, rows, (eff, *rows_data)


def _rows_exact(src: Tensor, sampled: Tensor, k_max: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sampled ranks [n], values [n], top ids [n, k_max], top values [n, k_max].

    The wire rules run on the device: NaN and -inf → FLOOR, everything >= FLOOR, +inf →
    0.0 (log-softmax is <= 0, so that cap only ever meets +inf). A NaN row has rank 0.
    """
    t = topk_logprobs(src, sampled, k_max)

    def wire(x: Tensor) -> Tensor:
        return x.nan_to_num(nan=FLOOR, posinf=0.0, neginf=FLOOR).clamp_(min=FLOOR)

    return t.sampled_rank, wire(t.sampled_logprob), t.top_ids, wire(t.top_logprobs)


def _rows_cpu(src: Tensor, sampled: Tensor, k_max: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`_rows_exact` on the host for CPU tensors: the same result with a third of the ops.

    Reading a CPU tensor costs no sync, so the common case takes a short path and the
    host sends the rare rows back to the exact one. One `_topk_cpu` gives the k_max+1
    top values; when they are all distinct, their order is the tie rule, and a sampled
    id found in slot j < k_max has rank j+1 and that slot's value (the next value is
    below it, and so is every value outside the top). Rows with equal values among
    those k_max+1 (a tie, or values the floor clamp made equal) or a NaN (log_softmax
    makes such a row NaN throughout) go through `_rows_exact`; rows whose sampled id is
    not in the first k_max slots get their value gathered and their rank counted.
    """
    lp = torch.log_softmax(src.float(), dim=-1)
    vals, ids = _topk_cpu(lp, k_max + 1)
    vals.clamp_(min=FLOOR, max=0.0)
    # Sorted values: a row is safe when they strictly decrease. A tie, two values the
    # clamp made equal, or NaN (a NaN row is NaN throughout; NaN > x is false) breaks it.
    # On the host from here (numpy: a small op costs a fraction of a torch one, which
    # counts at small batches); the tensors' memory is read in place.
    all_values = vals.numpy()
    safe = (all_values[:, :-1] > all_values[:, 1:]).all(axis=1)
    top_ids = ids.numpy()[:, :k_max].copy()
    top_values = all_values[:, :k_max].astype(np.float64)
    hit = top_ids == sampled.numpy()[:, None]
    found = hit.any(axis=1)
    pos = hit.argmax(axis=1)  # the sampled id's slot, where found
    n = len(safe)
    values = top_values[np.arange(n), pos]
    if safe.all() and found.all():  # the usual step (ops on a few rows cost more than their data)
        return pos + 1, values, top_ids, top_values
    ranks = np.where(safe & found, pos + 1, 0)
    values = np.where(safe & found, values, FLOOR)
    recount = np.flatnonzero(safe & ~found)
    if len(recount):
        r = torch.from_numpy(recount)
        lp_r = lp.index_select(0, r)
        sampled_lp = lp_r.gather(1, sampled.index_select(0, r).view(-1, 1))
        ranks[recount] = (lp_r >= sampled_lp).sum(dim=-1).numpy()
        values[recount] = sampled_lp.clamp_(min=FLOOR, max=0.0).view(-1).double().numpy()
    redo = np.flatnonzero(~safe)  # a NaN row, or equal top values
    if len(redo):
        r = torch.from_numpy(redo)
        exact = _arrays_to_host(*_rows_exact(src.index_select(0, r), sampled.index_select(0, r), k_max))
        ranks[redo], values[redo], top_ids[redo], top_values[redo] = exact
    return ranks, values, top_ids, top_values


def _assemble(
    out: list,
    rows: Sequence[int],
    eff: Sequence[int],
    ids: list[int],
    ranks: np.ndarray,
    values: np.ndarray,
    top_ids: np.ndarray,
    top_values: np.ndarray,
) -> None:
    """RowLogprobs for `rows` from the host arrays (top rows >= k long; values wire-safe)."""
    for i, k, rank, value, tids, tvals in zip(rows, eff, ranks.tolist(), values.tolist(), top_ids.tolist(),
                                              top_values.tolist()):
        del tids[k:], tvals[k:]  # the lists are ours: cut in place to this row's k
        out[i] = RowLogprobs(ids[i], rank, value, tids, tvals)


def batch_positions(
    logits: Tensor,
    sampled: Tensor,
    ks: Sequence[int | None],
    processed: Tensor | None = None,
) -> list[GenerateLogProbsContent | None]:
    """One decode step: row i gets the entry for k = ks[i] (None → None, no cost).

    logits: [B, V] raw logits (any float dtype, any device); sampled: [B] token ids.
    k = -1 means the whole vocabulary; k > V is cut to V. processed: optional [B, V]
    logits after temperature/top-k/top-p/min-p; when given, values come from it instead
    (the "processed logprobs" worker option); its masked entries reach the wire as
    -9999.0. One device→host copy in all.
    """
    return step_to_host(logits, sampled, ks, processed)[1]


def prompt_positions(
    logits: Tensor, prompt_ids: Sequence[int], k: int | None, start: int = 0
) -> list[GenerateLogProbsContent | None]:
    """Prompt logprobs in the same integer shape; position 0 is None.

    logits: [L, V] model outputs at prompt positions start .. start+L-1; row r predicts
    prompt_ids[start + r + 1]. Returns the entries for positions start+1 .. (clipped to
    the prompt), preceded by None when start == 0; so with chunked prefill the lists of
    successive chunks concatenate to exactly len(prompt_ids) entries. A final row that
    predicts past the prompt (the first generated token) is ignored. k None → all None.
    """
    t = len(prompt_ids)
    n = max(0, min(logits.shape[0], t - 1 - start))  # rows whose target is in the prompt
    head: list[GenerateLogProbsContent | None] = [None] if start == 0 else []
    if k is None:
        return head + [None] * n
    if n == 0:
        return head
    targets = torch.tensor(prompt_ids[start + 1 : start + 1 + n], dtype=torch.int64, device=logits.device)
    # A long prompt is [T, V]: bound the float32/int64 temporaries by going in row
    # blocks (one host copy each) instead of materialising T x V keys at once.
    step = max(1, PROMPT_BLOCK_ELEMS // logits.shape[-1])
    out = head
    for r in range(0, n, step):
        e = min(n, r + step)
        out += batch_positions(logits[r:e], targets[r:e], [k] * (e - r))
    return out
