"""Batched sampling with per-request params and per-request seeded generators.

Plain functions over [B, V] logits. Order of the warpers (as Hugging Face applies
them): temperature → top-k → top-p → min-p, each vectorised over the batch; a row
with a feature disabled is left bit-for-bit untouched, and a warper no row uses costs
nothing (the `any_*` flags are python bools, decided on the host once per batch
composition, so no step ever syncs to find out).

Greedy rows (temperature < 1e-5, as in vLLM) take argmax of the logits they are given
and ignore top-k/top-p/min-p (vLLM resets them for greedy requests). Other rows use
the exponential race: argmax(probs / q) with q ~ Exp(1) is an exact draw from probs;
q = -log u with u uniform, and u for a seeded row comes from that row's own
torch.Generator, one [V] draw per step, so a seeded request gets the same tokens alone
or in any batch, at any row (given the same logits: the model forward itself is not
bit-exact across batch sizes on GPU), with the same code (the draws are not promised
across versions: they changed once, for speed).

Engine usage, one decode step:

    logits = suppress(raw, below_min_tokens_ids)      # new tensor only if needed
    sampled = sample(logits, st, generators)          # [B] int64 on logits.device
    ids, entries = step_to_entries(raw, sampled, ks)  # logprobs.py, on the raw logits
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from schemas.records import SamplingParams

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below this are greedy


class SamplingTensors(NamedTuple):
    """Per-row sampling params on the device, plus host-side flags to skip dead work.
    When every row is greedy there is nothing to send: the tensors are None."""

    temperature: Tensor | None  # [B] float32; 1.0 on greedy rows (never divides by ~0)
    top_p: Tensor | None  # [B] float32; 1.0 = disabled
    top_k: Tensor | None  # [B] int64; 0 = disabled
    log_min_p: Tensor | None  # [B] float32; log(min_p), -inf = disabled
    greedy_rows: tuple[bool, ...]  # which rows are greedy (on the host)
    sampled_rows: tuple[int, ...]  # the rows that are not greedy
    max_top_k: int  # largest enabled top_k (0 if none)
    any_temperature: bool
    any_top_p: bool
    any_min_p: bool
    # A batch with greedy rows besides sampled ones: the sampled rows' own tensors, and
    # their rows on the device. Only those rows are processed and drawn for.
    sampled: SamplingTensors | None = None
    sampled_index: Tensor | None = None


SamplingRow = tuple[float, float, float, float, float]


def sampling_row(p: SamplingParams) -> SamplingRow:
    """One request's row of the tensors, normalised: (temperature, top_p, top_k,
    log(min_p), greedy). Made once per request (the engine keeps it on the sequence),
    since a batch's composition, and so its tensors, change on most steps."""
    greedy = p.temperature < GREEDY_EPS
    temp = 1.0 if greedy else float(p.temperature)
    top_p = 1.0 if greedy else min(max(float(p.top_p), 0.0), 1.0)
    top_k = 0 if greedy or p.top_k <= 0 else min(int(p.top_k), 2**31)  # 0, -1: off
    # min_p > 1 would mask the top token too and leave nothing to sample
    min_p = 0.0 if greedy else min(max(float(p.min_p), 0.0), 1.0)
    log_min_p = math.log(min_p) if min_p > 0.0 else -math.inf
    return (temp, top_p, float(top_k), log_min_p, float(greedy))


def make_sampling_tensors(params: Sequence[SamplingParams], device: torch.device | str) -> SamplingTensors:
    return sampling_tensors([sampling_row(p) for p in params], device)


def sampling_tensors(rows: Sequence[SamplingRow], device: torch.device | str) -> SamplingTensors:
    """Build once per batch composition: one host→device copy for all rows, none when
    every row is greedy, two more when some are (the sampled rows' own, and their rows)."""
    greedy_rows = tuple(r[4] == 1.0 for r in rows)
    sampled_rows = tuple(i for i, greedy in enumerate(greedy_rows) if not greedy)
    if not sampled_rows:  # (greedy rows have every warper off)
        return SamplingTensors(None, None, None, None, greedy_rows, (), 0, False, False, False)
    b = len(rows)
    sampled = sampled_index = None
    if len(sampled_rows) < b:
        sampled = sampling_tensors([rows[i] for i in sampled_rows], device)
        sampled_index = torch.tensor(sampled_rows, device=device)
    # float64 keeps any top_k exact (float32 rounds above 2^24); one copy, then views.
    packed = torch.tensor(rows, dtype=torch.float64).reshape(b, 5).t().contiguous().to(device)
    return SamplingTensors(
        temperature=packed[0].float(),
        top_p=packed[1].float(),
        top_k=packed[2].long(),
        log_min_p=packed[3].float(),
        greedy_rows=greedy_rows,
        sampled_rows=sampled_rows,
        max_top_k=max(int(r[2]) for r in rows),
        any_temperature=any(r[0] != 1.0 for r in rows),
        any_top_p=any(r[1] < 1.0 for r in rows),
        any_min_p=any(r[3] != -math.inf for r in rows),
        sampled=sampled,
        sampled_index=sampled_index,
    )


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A request's own generator; its state advances by one [V] draw per sampled step."""
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)  # manual_seed takes uint64
    return g


def _top_k(x: Tensor, st: SamplingTensors, on_host: bool | None = None) -> None:
    """Mask, in place, entries below each row's k-th largest value (ties at k kept).
    `on_host`: x is on the CPU (tests set it to run a device's path there)."""
    vocab = x.shape[-1]
    k_max = min(st.max_top_k, vocab)
    on_host = x.device.type == "cpu" if on_host is None else on_host
    values = _largest_values(x, k_max, on_host)  # one lookup for the whole batch
    k = st.top_k.clamp(max=vocab)
    kth = values.gather(1, (k - 1).clamp(min=0).view(-1, 1))
    kth = kth.masked_fill((k <= 0).view(-1, 1), -math.inf)  # disabled rows: keep all
    x.masked_fill_(x < kth, -math.inf)


def _top_p(x: Tensor, st: SamplingTensors, on_host: bool | None = None) -> None:
    """Mask, in place, all but the smallest set of largest-probability tokens whose mass
    reaches top_p.

    In descending order of value (at a tie the lower id first: the order argmax and the
    logprob ranks use), the tokens before the first one whose mass above it is already
    >= top_p stay; the first token always stays. `on_host`: x is on the CPU (tests set it
    to run a device's path there).

    On a device: a stable sort by value that carries the ids, the mask made in sorted
    order and scattered back. On the CPU that sort took ~30 ms a step at batch 256 on one
    thread, so there only the values are sorted (`_largest_values`): the count kept gives
    the last kept value, and the tokens kept are those above it and, of those equal to it,
    the lowest ids that fill the count; the same tokens (BENCHMARKS.md, "Sampling on the
    CPU"). (On a device that is ~2x the kernels, and a check for ties that waits for it.)
    """
    on_host = x.device.type == "cpu" if on_host is None else on_host
    top_p = st.top_p.view(-1, 1)
    if not on_host:
        sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
        probs = sorted_x.softmax(dim=-1)
        drop = probs.cumsum(dim=-1).sub_(probs) >= top_p  # mass of strictly earlier tokens
        drop[:, 0] = False
        drop &= top_p < 1.0  # disabled rows untouched, even 0-mass tails
        x.scatter_(-1, order, sorted_x.masked_fill_(drop, -math.inf))
        return
    vocab = x.shape[-1]
    sorted_x = _largest_values(x, vocab, on_host)
    probs = sorted_x.softmax(dim=-1)
    above = probs.cumsum(dim=-1).sub_(probs)  # mass of strictly earlier tokens: grows along the row
    kept = torch.searchsorted(above, top_p).clamp_(min=1)
    kept = torch.where(top_p < 1.0, kept, vocab)  # disabled rows untouched, even 0-mass tails
    last = sorted_x.gather(1, kept - 1)
    # A tie across the cut: the first value dropped equals the last one kept.
    tie_at_cut = (sorted_x.gather(1, kept.clamp(max=vocab - 1)) == last) & (kept < vocab)
    if bool(tie_at_cut.any()):  # of the tokens equal to the last kept value, the lowest ids fill the count
        above_last = x > last
        at_last = x == last
        keep = above_last | (at_last & (at_last.cumsum(dim=-1) <= kept - above_last.sum(dim=-1, keepdim=True)))
    else:
        keep = x >= last
    x.masked_fill_(keep.logical_not_(), -math.inf)


def _largest_values(x: Tensor, k: int, on_host: bool) -> Tensor:
    """Each row's k largest values, largest first. On the CPU numpy finds them: torch's
    topk and sort move the ids along, and took 5-20x as long ([256, 2,000], one thread:
    BENCHMARKS.md, "Sampling on the CPU")."""
    vocab = x.shape[-1]
    if not on_host:
        return x.sort(dim=-1, descending=True).values if k >= vocab else x.topk(k, dim=-1, sorted=True).values
    a = x.numpy()
    if k < vocab:
        a = np.partition(a, vocab - k, axis=-1)[:, vocab - k:]
    return torch.from_numpy(np.sort(a, axis=-1)[:, ::-1].copy())  # (copy: torch takes no negative strides)


def _min_p(x: Tensor, st: SamplingTensors) -> None:
    """Mask, in place, tokens with prob < min_p * max prob, i.e. x < max(x) + log(min_p)."""
    thr = x.amax(dim=-1, keepdim=True) + st.log_min_p.view(-1, 1)  # -inf when disabled
    x.masked_fill_(x < thr, -math.inf)


def process_logits(logits: Tensor, st: SamplingTensors) -> Tensor:
    """Temperature, top-k, top-p, min-p → a new float32 [B, V] tensor (input untouched).

    Masked entries are -inf. Greedy rows come out equal to their input (as float32).
    """
    x = logits.to(torch.float32, copy=True)
    if st.any_temperature:
        x.div_(st.temperature.view(-1, 1))
    if st.max_top_k > 0:
        _top_k(x, st)
    if st.any_top_p:
        _top_p(x, st)
    if st.any_min_p:
        _min_p(x, st)
    return x


def suppress(logits: Tensor, row_token_ids: Sequence[Sequence[int]]) -> Tensor:
    """A copy of `logits` with row i's `row_token_ids[i]` set to -inf (min_tokens: EOS and
    stop ids until min_tokens is reached). Returns `logits` itself when nothing is
    suppressed. Not in place on purpose: raw logprobs are reported from the model's
    unsuppressed logits (as vLLM does), so the caller keeps both.
    """
    if len(row_token_ids) != logits.shape[0]:
        raise ValueError(f"{len(row_token_ids)} id lists for {logits.shape[0]} rows")
    vocab = logits.shape[-1]
    # An id past the logits (a tokenizer id the model cannot emit) needs no suppressing.
    pairs = [(i, int(t)) for i, ids in enumerate(row_token_ids) for t in ids if 0 <= int(t) < vocab]
    if not pairs:
        return logits
    rows, cols = zip(*pairs)
    idx = torch.tensor([rows, cols], dtype=torch.int64).to(logits.device)
    out = logits.clone()
    out[idx[0], idx[1]] = -math.inf
    return out


def _log_uniform(shape: tuple[int, int], device: torch.device, generators: Sequence[torch.Generator | None]) -> Tensor:
    """log u, u ~ U[0, 1), a row per generator (-log u ~ Exp(1): the race's q): seeded
    rows from their own generator.

    Each seeded row draws exactly one fresh, contiguous [V] tensor per step, so its
    stream is the same whatever the batch around it. Unseeded rows share one draw from
    the default generator. Uniform draws, not torch's `exponential_`: on the CPU that took
    5x as long (12.5 against 2.4 ms for [256, 2,000] on one thread), a third of a sampled
    step (BENCHMARKS.md, "Sampling on the CPU").
    """
    b, vocab = shape
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if not seeded:
        return torch.rand(shape, device=device).log_()
    unseeded = [i for i, g in enumerate(generators) if g is None]
    r = torch.empty(shape, device=device)
    if unseeded:
        draw = torch.rand(len(unseeded), vocab, device=device).log_()
        r.index_copy_(0, torch.tensor(unseeded, device=device), draw)
    draws = [torch.rand(vocab, device=device, generator=generators[i]) for i in seeded]
    return r.index_copy_(0, torch.tensor(seeded, device=device), torch.stack(draws).log_())


def sample(
    logits: Tensor,
    st: SamplingTensors,
    generators: Sequence[torch.Generator | None],
    processed: Tensor | None = None,
) -> Tensor:
    """One token per row: [B, V] logits (any float dtype) → [B] int64 on logits.device.

    Greedy rows: argmax of `logits` (ties → lowest id). Other rows: an exact draw from
    softmax(process_logits(logits)); pass `processed` if already computed (e.g. for
    processed logprobs) to skip recomputing it. generators[i] must live on logits.device.
    """
    b = logits.shape[0]
    if len(generators) != b or len(st.greedy_rows) != b:
        raise ValueError(f"batch of {b} rows, {len(generators)} generators, {len(st.greedy_rows)} params")
    if not st.sampled_rows:
        return logits.argmax(dim=-1)
    if st.sampled is not None:  # greedy rows too: warp and draw for the sampled rows alone
        index = st.sampled_index
        drawn = sample(logits.index_select(0, index), st.sampled, [generators[i] for i in st.sampled_rows],
                       None if processed is None else processed.index_select(0, index))
        return logits.argmax(dim=-1).index_copy_(0, index, drawn)
    x = process_logits(logits, st) if processed is None else processed.float()
    probs = x.softmax(dim=-1)
    log_u = _log_uniform(tuple(probs.shape), probs.device, generators)  # every row is sampled here
    # argmax(probs / q) with q = -log u is argmin(probs / log u). u = 1 would make log u
    # 0 and a masked token's 0/0 NaN win; rand never gives 1, but a device's may round
    # to it, so log u stays below 0. (u = 0: log u = -inf, and that token cannot win.)
    return probs.div_(log_u.clamp_max_(-torch.finfo(torch.float32).tiny)).argmin(dim=-1)
