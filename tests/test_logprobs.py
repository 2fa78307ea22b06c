"""Integer logprobs (docs/design.md §3, §4): every rule against a float64 recomputation in numpy."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.records import GenerateLogProbsContent
import workers.generate.logprobs as lp_mod
from workers.generate.logprob_entries import build_position
from workers.generate.logprobs import (
    FLOOR,
    LogprobTensors,
    _order_key,
    _packed_to_host,
    _topk_cpu,
    batch_positions,
    logprobs_to_host,
    prompt_positions,
    step_to_host,
    topk_logprobs,
)

# --- an independent reference: float64 numpy, the rules spelled out again ----------


def ref_logprobs(row) -> np.ndarray:
    x = np.asarray(row, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def ref_rank(lp: np.ndarray, sampled: int) -> int:
    return int((lp >= lp[sampled]).sum())


def ref_order(lp: np.ndarray) -> list[int]:
    return sorted(range(len(lp)), key=lambda i: (-lp[i], i))  # value desc, id asc


def ref_entries(row, sampled: int, k: int) -> list[tuple[int, float, int]]:
    """(id, logprob, rank) as docs/design.md §4 states it, for finite logits."""
    lp = ref_logprobs(row)
    v = len(lp)
    k = v if k == -1 else min(k, v)
    out = [(sampled, lp[sampled], ref_rank(lp, sampled))]
    for slot, tid in enumerate(ref_order(lp)[:k], start=1):
        if tid != sampled:
            out.append((tid, lp[tid], slot))
    return out[: max(k, 1)]


def as_tuples(content: GenerateLogProbsContent) -> list[tuple[int, float, int | None]]:
    return [(e.token_id, e.logprob, e.rank) for e in content.top_logprobs]


def assert_matches(content, row, sampled, k, atol=1e-5):
    want = ref_entries(row, sampled, k)
    got = as_tuples(content)
    assert [(t, r) for t, _, r in got] == [(t, r) for t, _, r in want]
    np.testing.assert_allclose([v for _, v, _ in got], [v for _, v, _ in want], atol=atol, rtol=0)
    assert (content.token_id, content.rank) == (sampled, want[0][2])
    assert content.logprob == got[0][1]


def wire_values(content) -> list:
    """Everything as it would be written to JSON (NaN/inf would come back as None)."""
    d = msgspec.json.decode(msgspec.json.encode(content))
    return [d["logprob"]] + [e["logprob"] for e in d["top_logprobs"]]


def assert_wire_safe(content):
    for v in wire_values(content):
        assert isinstance(v, float) and math.isfinite(v) and v >= FLOOR


# --- values and ranks ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_values_are_float32_log_softmax(dtype):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(4, 50, generator=g) * 4).to(dtype)
    sampled = torch.tensor([0, 7, 49, 13])
    t = topk_logprobs(logits, sampled, 5)
    assert t.sampled_logprob.dtype == torch.float32 and t.top_logprobs.dtype == torch.float32
    assert t.sampled_rank.dtype == torch.int64 and t.top_ids.dtype == torch.int64
    assert t.top_ids.shape == (4, 5)
    for b in range(4):
        row = logits[b].float().numpy()  # the values the model gave, in float64 below
        lp = ref_logprobs(row)
        assert abs(t.sampled_logprob[b].item() - lp[sampled[b]]) < 1e-5
        assert t.sampled_rank[b].item() == ref_rank(lp, int(sampled[b]))
        assert t.top_ids[b].tolist() == ref_order(lp)[:5]
        np.testing.assert_allclose(t.top_logprobs[b].numpy(), lp[ref_order(lp)[:5]], atol=1e-5)


def test_rank_counts_ties_against_the_sampled_token():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0]])
    # sampled id 2 (value 2.0): two 3.0s and three 2.0s (itself included) are >= it.
    t = topk_logprobs(logits, torch.tensor([2]), 0)
    assert t.sampled_rank.item() == 5
    assert ref_rank(ref_logprobs(logits[0]), 2) == 5
    # all equal: every token has rank V
    t = topk_logprobs(torch.zeros(1, 9), torch.tensor([4]), 3)
    assert t.sampled_rank.item() == 9
    assert t.top_ids[0].tolist() == [0, 1, 2]  # ties in id order, deterministic


def test_ties_order_by_id_whatever_k_max():
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0, 1.0, 5.0, 1.0, -1.0]])
    for k_max in range(1, 9):
        ids = topk_logprobs(logits, torch.tensor([0]), k_max).top_ids[0].tolist()
        assert ids == [1, 3, 5, 2, 4, 6, 0, 7][:k_max]


# --- the entry shape -----------------------------------------------------------------


def _logits_with_ranks(order: list[int], v: int = 8) -> torch.Tensor:
    """Logits whose rank-1 token is order[0], rank-2 order[1] ..., well separated."""
    x = torch.full((v,), -10.0)
    for r, tid in enumerate(order):
        x[tid] = 5.0 - r
    rest = [i for i in range(v) if i not in order]
    for j, tid in enumerate(rest):
        x[tid] = -3.0 - j
    return x


def test_sampled_outside_top_k():
    row = _logits_with_ranks([3, 6, 1, 0, 5])  # id 5 has rank 5
    [c] = batch_positions(row[None], torch.tensor([5]), [3])
    assert [(e.token_id, e.rank) for e in c.top_logprobs] == [(5, 5), (3, 1), (6, 2)]
    assert_matches(c, row.numpy(), 5, 3)


def test_sampled_inside_top_k_appears_once_first():
    row = _logits_with_ranks([3, 6, 1, 0, 5])
    [c] = batch_positions(row[None], torch.tensor([6]), [3])
    assert [(e.token_id, e.rank) for e in c.top_logprobs] == [(6, 2), (3, 1), (1, 3)]
    assert_matches(c, row.numpy(), 6, 3)
    [c] = batch_positions(row[None], torch.tensor([3]), [3])  # the top token itself
    assert [(e.token_id, e.rank) for e in c.top_logprobs] == [(3, 1), (6, 2), (1, 3)]


def test_duplicate_keeps_first_position_and_its_ge_rank():
    # ids 0 and 1 tie for the max; sampled 0 sits at slot 1 but its >= rank is 2.
    row = torch.tensor([4.0, 4.0, 1.0, 0.0])
    [c] = batch_positions(row[None], torch.tensor([0]), [2])
    assert [(e.token_id, e.rank) for e in c.top_logprobs] == [(0, 2), (1, 2)]
    assert_matches(c, row.numpy(), 0, 2)


def test_k_zero_is_exactly_the_sampled_entry():
    row = _logits_with_ranks([3, 6, 1])
    for sampled in (3, 6, 7):
        [c] = batch_positions(row[None], torch.tensor([sampled]), [0])
        assert len(c.top_logprobs) == 1 and c.top_logprobs[0].token_id == sampled
        assert_matches(c, row.numpy(), sampled, 0)


def test_k_minus_one_is_the_whole_vocabulary():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 37, generator=g)
    out = batch_positions(logits, torch.tensor([11, 0]), [-1, -1])
    for b, c in enumerate(out):
        ids = [e.token_id for e in c.top_logprobs]
        assert len(ids) == 37 and sorted(ids) == list(range(37))
        assert_matches(c, logits[b].numpy(), [11, 0][b], -1)


def test_k_above_vocab_is_cut_to_vocab_and_bad_k_raises():
    logits = torch.randn(1, 6)
    [c] = batch_positions(logits, torch.tensor([2]), [50])
    assert len(c.top_logprobs) == 6
    with pytest.raises(ValueError):
        batch_positions(logits, torch.tensor([2]), [-2])


def test_sampled_id_missing_from_candidates():
    c = build_position(99, -7.5, 40, [4, 5, 6, 7], [-0.1, -0.2, -0.3, -0.4], 3)
    assert [(e.token_id, e.rank) for e in c.top_logprobs] == [(99, 40), (4, 1), (5, 2)]
    # candidates longer than k (batch k_max > this row's k): only the first k count
    c = build_position(5, -0.2, 2, [4, 5, 6, 7], [-0.1, -0.2, -0.3, -0.4], 2)
    assert [(e.token_id, e.rank) for e in c.top_logprobs] == [(5, 2), (4, 1)]
    c = build_position(7, -0.4, 4, [4, 5, 6, 7], [-0.1, -0.2, -0.3, -0.4], 2)
    assert [(e.token_id, e.rank) for e in c.top_logprobs] == [(7, 4), (4, 1)]


# --- NaN and infinities --------------------------------------------------------------


def test_nan_logits_give_floor_and_rank_none():
    logits = torch.tensor([[0.0, float("nan"), 1.0, 2.0]])
    [c] = batch_positions(logits, torch.tensor([2]), [2])
    assert c.logprob == FLOOR and c.rank is None
    assert all(e.logprob == FLOOR and e.rank is None for e in c.top_logprobs)
    assert len(c.top_logprobs) == 2
    assert_wire_safe(c)


def test_nan_values_on_the_host_side():
    nan = float("nan")
    c = build_position(3, nan, 0, [1, 3, 2], [-0.5, nan, nan], 3)
    assert [(e.token_id, e.logprob, e.rank) for e in c.top_logprobs] == [
        (3, FLOOR, None),
        (1, -0.5, 1),
        (2, FLOOR, None),
    ]
    assert (c.logprob, c.rank) == (FLOOR, None)
    assert_wire_safe(c)


def test_nan_orders_below_everything():
    lp = torch.tensor([[float("nan"), -1.0, float("-inf"), 0.0, float("nan"), -1.0]])
    order = _order_key(lp).topk(6).indices[0].tolist()
    assert order == [3, 1, 5, 2, 0, 4]
    # a +inf logit turns the whole row NaN (inf - inf): ids in order, all on the floor
    t = topk_logprobs(torch.tensor([[float("inf"), 0.0, 1.0]]), torch.tensor([1]), 3)
    assert t.top_ids[0].tolist() == [0, 1, 2] and t.top_logprobs.isnan().all()
    [c] = batch_positions(torch.tensor([[float("inf"), 0.0, 1.0]]), torch.tensor([1]), [2])
    assert [(e.token_id, e.logprob, e.rank) for e in c.top_logprobs] == [(1, FLOOR, None), (0, FLOOR, None)]


def test_neg_inf_logits_are_clamped_never_inf():
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf"), -20000.0]])
    [c] = batch_positions(logits, torch.tensor([1]), [-1])
    assert c.logprob == FLOOR
    assert c.rank == 5  # every entry is >= -inf
    got = {e.token_id: e.logprob for e in c.top_logprobs}
    assert got[1] == got[3] == got[4] == FLOOR  # -20000 is below the floor too
    assert_wire_safe(c)
    # +inf can only come from a NaN-ish input; build_position still keeps it finite
    c = build_position(0, float("inf"), 1, [0, 1], [float("inf"), float("-inf")], 2)
    assert_wire_safe(c)


# --- batches and the host copy -------------------------------------------------------


def test_batch_with_mixed_ks_matches_rows_alone_and_reference():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40, generator=g) * 3
    sampled = torch.tensor([5, 1, 39, 0, 17, 22])
    ks = [3, None, 0, -1, 20, None]
    ids, out = step_to_host(logits, sampled, ks)
    assert ids == sampled.tolist()
    assert out[1] is None and out[5] is None
    for b, k in enumerate(ks):
        if k is None:
            continue
        assert_matches(out[b], logits[b].numpy(), int(sampled[b]), k)
        [alone] = batch_positions(logits[b : b + 1], sampled[b : b + 1], [k])
        assert alone == out[b]


def test_all_none_costs_nothing_but_returns_ids():
    ids, out = step_to_host(torch.randn(3, 10), torch.tensor([1, 2, 3]), [None] * 3)
    assert ids == [1, 2, 3] and out == [None] * 3


def test_processed_logprobs_switch():
    raw = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    processed = torch.tensor([[4.0, 2.0, float("-inf"), float("-inf")]])  # T=0.5, top-k 2
    [r] = batch_positions(raw, torch.tensor([1]), [3])
    [p] = batch_positions(raw, torch.tensor([1]), [3], processed=processed)
    assert_matches(r, raw[0].numpy(), 1, 3)
    assert abs(p.logprob - ref_logprobs([4.0, 2.0])[1]) < 1e-6
    assert [(e.token_id, e.rank) for e in p.top_logprobs] == [(1, 2), (0, 1), (2, 3)]
    assert p.top_logprobs[2].logprob == FLOOR
    assert_wire_safe(p)


def test_host_copy_is_exact():
    t = LogprobTensors(
        torch.tensor([-1.2345678, float("nan")], dtype=torch.float32),
        torch.tensor([3, 0]),
        torch.tensor([[2**31 + 5, 0], [7, 151935]]),
        torch.tensor([[-0.1, -9.87654321], [-1e-30, float("-inf")]], dtype=torch.float32),
    )
    lps, ranks, ids, tops = logprobs_to_host(t)
    assert lps[0] == t.sampled_logprob[0].item() and math.isnan(lps[1])
    assert ranks == [3, 0] and ids == [[2**31 + 5, 0], [7, 151935]]
    assert all(type(i) is int for row in ids for i in row)
    assert tops == t.top_logprobs.tolist()
    empty = logprobs_to_host(topk_logprobs(torch.randn(2, 5), torch.tensor([0, 1]), 0))
    assert empty[2] == [[], []] and empty[3] == [[], []]


def test_packed_copy_is_exact():
    """The one-copy packing used off the CPU (run here on CPU tensors)."""
    ints = torch.tensor([[2**62 + 3, -1, 0], [7, 151935, 2**31 + 5]])
    vals = torch.tensor([[-1.2345678, float("nan"), float("-inf")], [-1e-30, 0.0, -9999.0]])
    head = torch.tensor([5, 6], dtype=torch.int32)
    got_head, got_ints, got_vals = _packed_to_host([head, ints, vals])
    assert got_head == [5, 6] and got_ints == ints.tolist()
    assert all(type(i) is int for row in got_ints for i in row)
    flat, want = sum(got_vals, []), sum(vals.tolist(), [])
    assert [x for x in flat if x == x] == [x for x in want if x == x] and math.isnan(flat[1])
    assert _packed_to_host([torch.empty(2, 0, dtype=torch.int64)]) == [[[], []]]


# --- the fast CPU path against the exact path and the per-value reference -----------


@pytest.mark.parametrize("v", [7, 50, 2000, 2003, 4099])
@pytest.mark.parametrize("k", [1, 5, 21])
def test_topk_cpu_same_values_as_topk(v, k):
    g = torch.Generator().manual_seed(v * 31 + k)
    x = torch.randn(12, v, generator=g)  # 12 rows: big enough for the chunked path
    x[1] = torch.randint(0, 4, (v,), generator=g).float()  # runs of equal values
    x[2, : v // 2] = float("-inf")
    x[3, v // 2 :] = float("-inf")
    k = min(k, v)
    vals, ids = _topk_cpu(x, k)
    assert torch.equal(vals, x.topk(k).values)
    assert torch.equal(x.gather(1, ids), vals)
    assert all(len(set(row)) == k and max(row) < v for row in ids.tolist())


def reference_positions(logits, sampled, ks, processed=None):
    """Row by row through topk_logprobs + build_position (the per-value rules)."""
    src = logits if processed is None else processed
    v = src.shape[1]
    out = []
    for i, k in enumerate(ks):
        if k is None:
            out.append(None)
            continue
        t = topk_logprobs(src[i : i + 1], sampled[i : i + 1], v if k == -1 else min(k, v))
        lps, ranks, ids, tops = logprobs_to_host(t)
        out.append(build_position(int(sampled[i]), lps[0], ranks[0], ids[0], tops[0], k))
    return out


def awkward_batch(v: int = 2003, seed: int = 0):
    """Rows that exercise every branch of the CPU fast path (chunked topk included)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, v, generator=g) * 3
    x[1] = x[1].round()  # runs of equal values everywhere: redone exactly
    x[2, 5:] = float("-inf")  # top-k masked: -inf (floor) ties inside the top
    x[3] = float("-inf")  # all -inf: a NaN row
    x[4, 7] = float("nan")
    x[5, 3] = float("inf")
    x[6, :] = -30000.0
    x[6, :4] = torch.tensor([0.0, -1.0, -2.0, -3.0])  # values below the floor: clamp ties
    x[7, 10], x[7, 11] = 50.0, 50.0  # a tie at the very top only
    x[8, 20], x[8, 21] = 40.0, 39.0
    sampled = x.nan_to_num(nan=0.0).argmax(-1)
    sampled[9] = x[9].argmin()  # far outside the top: rank counted over the row
    sampled[10] = x[10].topk(3).indices[2]
    sampled[11] = x[11].topk(25).indices[24]  # just past the top k_max + 1
    return x, sampled


@pytest.mark.parametrize("ks_kind", ["all20", "mixed"])
def test_fast_cpu_path_matches_reference(ks_kind):
    x, sampled = awkward_batch()
    ks = [20] * 12 if ks_kind == "all20" else [20, 3, None, 0, 1, 20, 5, 2, 19, 20, None, 23]
    ids, got = step_to_host(x, sampled, ks)
    assert ids == sampled.tolist()
    assert got == reference_positions(x, sampled, ks)
    assert step_to_host(x, sampled.int().view(-1, 1), ks) == (ids, got)  # any int dtype/shape
    for c in got:
        if c is not None:
            assert_wire_safe(c)
    assert got[3].rank is None and got[4].rank is None  # NaN rows
    # the tie at the top: slots in id order, the sampled (first) id counts the other
    assert [(e.token_id, e.rank) for e in got[7].top_logprobs[:2]] == [(10, 2), (11, 2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_dtypes_match_reference(dtype):
    x, sampled = awkward_batch(seed=2)
    x = x.to(dtype)
    ks = [20, 3, None, 0, 1, 20, 5, 2, 19, 20, None, 23]
    assert batch_positions(x, sampled, ks) == reference_positions(x, sampled, ks)


def test_processed_fast_path_matches_reference():
    x, sampled = awkward_batch(seed=1)
    processed = x.clone()
    processed[:, 1500:] = float("-inf")  # e.g. top-k masking
    ks = [20] * 12
    assert batch_positions(x, sampled, ks, processed=processed) == reference_positions(x, sampled, ks, processed)


@pytest.mark.parametrize("kind", ["other", "cuda"])
def test_non_cpu_paths_match_cpu(monkeypatch, kind):
    """The paths taken off the CPU, run on CPU tensors by patching the device kind.

    "cuda" trusts the kernel to take the lowest ids of a run of equal values at the cut,
    which the CPU kernel does not do, so its input ties only inside the top."""
    x, sampled = awkward_batch()
    ks = [20, 3, 7, 0, 1, 20, 5, 2, 19, 20, None, 23]
    if kind == "cuda":
        x = torch.randn(12, 2003, generator=torch.Generator().manual_seed(5))
        x[:, 40], x[:, 41], x[:, 7] = 30.0, 30.0, 30.0  # equal values inside every top
        sampled = torch.tensor([41, 40, 7, 0, 299, 150] * 2)
        ks = [20, 3, 7, 0, 1, 20] * 2
    want = step_to_host(x, sampled, ks)
    monkeypatch.setattr(lp_mod, "_device_kind", lambda device: kind)
    assert step_to_host(x, sampled, ks) == want


# --- prompt logprobs -----------------------------------------------------------------


def test_prompt_positions_alignment_and_chunks():
    g = torch.Generator().manual_seed(4)
    prompt = [5, 9, 2, 2, 0, 7]
    logits = torch.randn(len(prompt), 12, generator=g)  # includes the row past the prompt
    out = prompt_positions(logits, prompt, 2)
    assert len(out) == len(prompt) and out[0] is None
    for i in range(1, len(prompt)):
        assert out[i].token_id == prompt[i]
        assert_matches(out[i], logits[i - 1].numpy(), prompt[i], 2)
    # chunked prefill: [0, 2) then [2, 6) concatenate to the same list
    chunked = prompt_positions(logits[:2], prompt, 2) + prompt_positions(logits[2:], prompt, 2, start=2)
    assert chunked == out
    assert prompt_positions(logits[:5], prompt, 2) == out  # the extra row is optional
    assert prompt_positions(logits, prompt, None) == [None] * len(prompt)
    assert prompt_positions(logits[:1], [5], 3) == [None]


def test_prompt_positions_in_blocks(monkeypatch):
    import workers.generate.logprobs as lp_mod

    prompt = list(range(9))
    logits = torch.randn(9, 10, generator=torch.Generator().manual_seed(8))
    whole = prompt_positions(logits, prompt, 3)
    monkeypatch.setattr(lp_mod, "PROMPT_BLOCK_ELEMS", 25)  # two rows per block
    assert prompt_positions(logits, prompt, 3) == whole


# --- a real model --------------------------------------------------------------------


def test_tiny_llama_logits_against_float64():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    )
    model = LlamaForCausalLM(cfg).eval()
    prompt = [1, 17, 254, 3, 99, 42, 42, 7]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]  # [T, 300]
    sampled = logits.argmax(-1)
    sampled[2] = 0  # something far down the ranking too
    ks = [5, 0, 20, -1, None, 1, 3, 300]
    out = batch_positions(logits, sampled, ks)
    for t, k in enumerate(ks):
        if k is None:
            assert out[t] is None
            continue
        assert_matches(out[t], logits[t].double().numpy(), int(sampled[t]), k)
        assert_wire_safe(out[t])
    pp = prompt_positions(logits, prompt, 4)
    for i in range(1, len(prompt)):
        assert_matches(pp[i], logits[i - 1].double().numpy(), prompt[i], 4)


# --- properties ----------------------------------------------------------------------

finite_or_odd = st.one_of(
    st.floats(min_value=-1e5, max_value=0.0),
    st.just(float("nan")),
    st.just(float("-inf")),
    st.just(float("inf")),
)


@settings(max_examples=200, deadline=None)
@given(
    v=st.integers(min_value=1, max_value=12),
    data=st.data(),
)
def test_build_position_invariants(v, data):
    perm = data.draw(st.permutations(list(range(v))))
    k = data.draw(st.integers(min_value=-1, max_value=v + 2))
    k_max = v if k == -1 else data.draw(st.integers(min_value=min(k, v), max_value=v))
    top_ids = perm[:k_max]
    top_lps = sorted(data.draw(st.lists(finite_or_odd, min_size=k_max, max_size=k_max)), reverse=True)
    sampled = data.draw(st.integers(min_value=0, max_value=v - 1))
    c = build_position(sampled, data.draw(finite_or_odd), data.draw(st.integers(1, v)), top_ids, top_lps, k)
    ids = [e.token_id for e in c.top_logprobs]
    want_len = v if k == -1 else min(max(k, 1), v)
    assert len(ids) == want_len
    assert ids[0] == sampled == c.token_id and len(set(ids)) == len(ids)
    assert (c.logprob, c.rank) == (c.top_logprobs[0].logprob, c.top_logprobs[0].rank)
    for e in c.top_logprobs:
        assert math.isfinite(e.logprob) and e.logprob >= FLOOR
        if e.rank is None:
            assert e.logprob == FLOOR  # rank None only for NaN, which went to the floor
    for e in c.top_logprobs[1:]:
        if e.rank is not None:
            assert top_ids[e.rank - 1] == e.token_id  # slot j has rank j
    assert_wire_safe(c)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.0]), min_size=6, max_size=6),
        min_size=1,
        max_size=4,
    ),
    data=st.data(),
)
def test_device_path_matches_reference_with_many_ties(rows, data):
    logits = torch.tensor(rows)
    b = len(rows)
    sampled = data.draw(st.lists(st.integers(0, 5), min_size=b, max_size=b))
    ks = data.draw(st.lists(st.one_of(st.none(), st.integers(-1, 7)), min_size=b, max_size=b))
    out = batch_positions(logits, torch.tensor(sampled), ks)
    for i, k in enumerate(ks):
        if k is None:
            assert out[i] is None
        else:
            assert_matches(out[i], rows[i], sampled[i], k)
