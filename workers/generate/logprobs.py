"""Integer-id logprobs for sampled and prompt tokens (SPEC §3, §4 "Logprobs, per position").

Device side (`topk_logprobs`): float32 log-softmax over the whole vocabulary, the
sampled token's value and rank, and the top `k_max` ids/values. Only `[B, 2 + 2*k_max]`
numbers then cross to the host in ONE copy (`logprobs_to_host`): a device→host copy is
a full stream sync, so the cost of logprobs is the number of copies, not the FLOPs.
Host side (`build_position`): the wire rules (sampled first, dedupe, cut, NaN/inf).

Engine usage, one decode step:

    ids, positions = step_to_host(raw_logits, sampled, [req.k for req in batch])

`batch_positions` is the same without the ids. `raw_logits` must be the model's logits
before min_tokens suppression and before temperature/top-k/top-p (vLLM's raw
logprobs); pass `processed=` to switch to processed logprobs. Rows whose k is None
cost nothing.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from schemas.records import GenerateLogProb, GenerateLogProbsContent

FLOOR = -9999.0  # the lowest value on the wire; NaN and -inf become this
PROMPT_BLOCK_ELEMS = 1 << 25  # rows x vocab per prompt-logprobs block (~128 MiB float32)


class LogprobTensors(NamedTuple):
    """Device tensors for B rows; top entries are in rank order (slot j = rank j+1)."""

    sampled_logprob: Tensor  # [B] float32
    sampled_rank: Tensor  # [B] int64, #entries with logprob >= the sampled one
    top_ids: Tensor  # [B, k_max] int64
    top_logprobs: Tensor  # [B, k_max] float32


def _order_key(lp: Tensor) -> Tensor:
    """A total order on (logprob desc, token id asc) as one int64 per entry.

    torch.topk ranks NaN above everything and leaves the order of equal values to the
    kernel (CPU and CUDA differ, and bf16 logits tie often). Folding the id into the
    key makes the top-k list a pure function of the row: the same whichever device,
    batch size or k_max it ran with, so a row's first k entries never depend on what
    other rows asked for. NaN sorts below -inf. Cost: a few int32 passes and three
    int64 passes over [B, V], only for rows that asked for logprobs.
    """
    bits = lp.view(torch.int32)  # a view: float32 bits as sign-magnitude ints
    # Flip the magnitude bits of negatives so ints order like the floats.
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    # Only NaN patterns map to INT32_MIN; put every NaN there, below -inf. (log_softmax
    # makes a row all-NaN or NaN-free, so this is belt and braces.)
    ordered = ordered.masked_fill(lp.isnan(), -(2**31))
    rev_ids = (2**32 - 1) - torch.arange(lp.shape[-1], device=lp.device, dtype=torch.int64)
    # high word: the value order; low word: the reversed id, so lower ids win ties.
    return (ordered.to(torch.int64) << 32).add_(rev_ids)


def topk_logprobs(logits: Tensor, sampled: Tensor, k_max: int) -> LogprobTensors:
    """Logprobs of `sampled` ([B] long) and the top `k_max` entries of `logits` [B, V].

    Values are log_softmax of the given logits computed in float32 whatever their dtype.
    k_max is clamped to [0, V]; k_max = 0 yields [B, 0] top tensors.
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
        top_ids = _order_key(lp).topk(k, dim=-1, sorted=True).indices
    return LogprobTensors(sampled_lp.view(-1), rank, top_ids, lp.gather(1, top_ids))


def _pack(t: LogprobTensors) -> Tensor:
    """[B, 2 + 2k] float64: float32 values and ids/ranks < 2^53 are exact in float64."""
    b = t.top_ids.shape[0]
    cols = [t.sampled_logprob.view(b, 1), t.sampled_rank.view(b, 1), t.top_ids, t.top_logprobs]
    return torch.cat([c.double() for c in cols], dim=1)


def _unpack(flat: list[float], b: int, k: int) -> tuple[list[float], list[int], list[list[int]], list[list[float]]]:
    w = 2 + 2 * k
    rows = [flat[i * w : (i + 1) * w] for i in range(b)]
    return (
        [r[0] for r in rows],
        [int(r[1]) for r in rows],
        [[int(x) for x in r[2 : 2 + k]] for r in rows],
        [r[2 + k :] for r in rows],
    )


def logprobs_to_host(t: LogprobTensors) -> tuple[list[float], list[int], list[list[int]], list[list[float]]]:
    """(sampled logprobs, ranks, top ids, top logprobs) as python lists, in ONE copy.

    Every copy from a CUDA tensor blocks on the stream, so the four tensors are packed
    into one float64 tensor first instead of paying four syncs.
    """
    b, k = t.top_ids.shape
    return _unpack(_pack(t).view(-1).tolist(), b, k)


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
    """The wire entry for one position (host side; pure python).

    `top_ids`/`top_logprobs` are in rank order and may be longer than k (the batch's
    k_max); only the first k are considered. `top_logprobs` of the result = the sampled
    token (with its >=-rule rank) first, then top entries with rank = slot (1-based),
    skipping the sampled id, cut to max(k, 1) entries. k = -1 means the whole
    vocabulary (the caller passes all V top entries).
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
    src = logits if processed is None else processed
    b, vocab = src.shape
    if len(ks) != b:
        raise ValueError(f"{len(ks)} ks for {b} rows")
    sampled = sampled.view(-1).to(torch.int64)
    rows = [i for i, k in enumerate(ks) if k is not None]
    out: list[GenerateLogProbsContent | None] = [None] * b
    if not rows:
        return sampled.tolist(), out
    eff = [_k_for(ks[i], vocab) for i in rows]  # type: ignore[arg-type]
    sel_src, sel_sampled = src, sampled.to(src.device)
    if len(rows) < b:  # only the rows that asked pay for the V-wide work
        idx = torch.tensor(rows, device=src.device)
        sel_src, sel_sampled = src.index_select(0, idx), sel_sampled.index_select(0, idx)
    k_max = max(eff)
    packed = _pack(topk_logprobs(sel_src, sel_sampled, k_max))
    flat = torch.cat([sampled.to(packed.device).double(), packed.view(-1)]).tolist()
    ids = [int(x) for x in flat[:b]]
    lps, ranks, top_ids, top_lps = _unpack(flat[b:], len(rows), k_max)
    for j, (i, k) in enumerate(zip(rows, eff)):
        out[i] = build_position(ids[i], lps[j], ranks[j], top_ids[j], top_lps[j], k)
    return ids, out


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
