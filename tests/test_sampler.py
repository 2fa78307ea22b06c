"""Sampler: warpers against float64 references, greedy, seeded batch invariance, distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.records import SamplingParams
from workers.generate.sampler import (
    _top_k,
    _top_p,
    make_generator,
    make_sampling_tensors,
    process_logits,
    sample,
    suppress,
)

SP = SamplingParams


def probs64(row, temperature=1.0) -> np.ndarray:
    x = np.asarray(row, dtype=np.float64) / temperature
    e = np.exp(x - x.max())
    return e / e.sum()


def ref_keep(row, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The surviving set, float64, HF order: temperature → top-k → top-p → min-p."""
    x = np.asarray(row, dtype=np.float64) / temperature
    keep = np.ones(len(x), dtype=bool)
    if top_k > 0:
        keep &= x >= np.sort(x)[::-1][min(top_k, len(x)) - 1]
    if top_p < 1.0:
        p = np.where(keep, np.exp(x - x[keep].max()), 0.0)
        p /= p.sum()
        order = sorted(range(len(x)), key=lambda i: -p[i])
        before = 0.0
        for i in order:  # keep a token while the mass above it is still < top_p
            if before >= top_p:
                keep[i] = False
            before += p[i]
    if min_p > 0.0:
        p = np.where(keep, np.exp(x - x[keep].max()), 0.0)
        keep &= p >= min_p * p.max()
    return keep


def ref_dist(row, **kw) -> np.ndarray:
    keep = ref_keep(row, **kw)
    p = np.where(keep, probs64(row, kw.get("temperature", 1.0)), 0.0)
    return p / p.sum()


def randn(*shape, seed=0, scale=2.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


# --- greedy --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_ties_lowest(dtype):
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -3.0, 0.5, 0.5]], dtype=dtype)
    st_ = make_sampling_tensors([SP(temperature=0.0)] * 3, "cpu")
    gens = [make_generator(1, "cpu"), None, None]
    assert sample(logits, st_, gens).tolist() == [1, 0, 2]
    assert sample(logits, st_, gens).dtype == torch.int64


def test_a_batch_of_greedy_rows_sends_nothing_to_the_device():
    # The batch's composition changes on most steps, so its tensors are rebuilt often: a
    # greedy batch (the usual one) needs none of them, only argmax.
    st_ = make_sampling_tensors([SP(temperature=0.0, top_k=5, top_p=0.5)] * 3, "cpu")
    assert st_.temperature is st_.top_p is st_.top_k is st_.log_min_p is st_.sampled is None
    assert (st_.greedy_rows, st_.sampled_rows, st_.max_top_k) == ((True,) * 3, (), 0)
    logits = randn(3, 50, seed=4)
    assert torch.equal(process_logits(logits, st_), logits)
    assert torch.equal(sample(logits, st_, [None] * 3), logits.argmax(dim=-1))
    mixed = make_sampling_tensors([SP(temperature=0.0), SP(temperature=0.7)], "cpu")
    assert mixed.sampled_rows == (1,) and mixed.temperature.tolist() == pytest.approx([1.0, 0.7])


def test_greedy_ignores_filters_and_never_consumes_its_generator():
    logits = randn(4, 50, seed=1)
    st_ = make_sampling_tensors([SP(temperature=0.0, top_k=3, top_p=0.1, min_p=0.5)] * 4, "cpu")
    g = make_generator(7, "cpu")
    state = g.get_state()
    assert torch.equal(sample(logits, st_, [g, None, None, None]), logits.argmax(-1))
    assert torch.equal(g.get_state(), state)
    assert torch.equal(process_logits(logits, st_), logits)  # filters reset for greedy


@pytest.mark.parametrize("params", [SP(top_k=1), SP(top_p=1e-6), SP(top_k=1, temperature=3.0), SP(min_p=1.0)])
def test_degenerate_filters_behave_as_greedy(params):
    logits = randn(8, 100, seed=2)
    st_ = make_sampling_tensors([params] * 8, "cpu")
    for step in range(5):
        gens = [make_generator(step * 8 + i, "cpu") for i in range(8)]
        assert torch.equal(sample(logits, st_, gens), logits.argmax(-1))


# --- the warpers against float64 -----------------------------------------------------


def test_temperature_scales_and_leaves_other_rows_untouched():
    logits = randn(3, 20, seed=3)
    st_ = make_sampling_tensors([SP(temperature=0.5), SP(), SP(temperature=2.0)], "cpu")
    out = process_logits(logits, st_)
    np.testing.assert_allclose(out[0].numpy(), logits[0].double().numpy() / 0.5, rtol=1e-6)
    assert torch.equal(out[1], logits[1])
    np.testing.assert_allclose(out[2].numpy(), logits[2].double().numpy() / 2.0, rtol=1e-6)
    assert out.data_ptr() != logits.data_ptr()


@pytest.mark.parametrize(
    "kw",
    [
        dict(top_k=5),
        dict(top_k=1000),
        dict(top_p=0.3),
        dict(top_p=0.9, temperature=0.7),
        dict(min_p=0.1),
        dict(min_p=0.02, temperature=1.5),
        dict(top_k=10, top_p=0.5),
        dict(top_k=20, top_p=0.95, min_p=0.05, temperature=0.8),
    ],
)
def test_masks_match_float64_reference(kw):
    logits = randn(6, 64, seed=4)
    params = [SP(**kw), SP(), SP(top_k=-1), SP(**kw), SP(top_k=0, min_p=0.0), SP(**kw)]
    out = process_logits(logits, make_sampling_tensors(params, "cpu"))
    for i, p in enumerate(params):
        if p is params[1] or p is params[2] or p is params[4]:
            assert torch.equal(out[i], logits[i]), "disabled rows are untouched"
            continue
        want = ref_keep(logits[i].numpy(), **kw)
        assert np.array_equal(torch.isfinite(out[i]).numpy(), want), (i, kw)


def test_top_k_keeps_ties_at_the_kth_value():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    out = process_logits(logits, make_sampling_tensors([SP(top_k=2)], "cpu"))
    assert torch.isfinite(out[0]).tolist() == [True, False, True, True, True, False]


@pytest.mark.parametrize("on_host", [True, False], ids=["cpu path", "device path"])
def test_top_k_rows_of_different_k_each_keep_their_own(on_host):
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0],
                           [0.0, 5.0, 4.0, 3.0, 2.0, 1.0],
                           [0.0, 5.0, 4.0, 3.0, 2.0, 1.0],
                           [0.0, 5.0, 4.0, 3.0, 2.0, 1.0]])
    x = logits.clone()
    _top_k(x, make_sampling_tensors([SP(top_k=2), SP(top_k=4), SP(), SP(top_k=99)], "cpu"), on_host=on_host)
    kept = [torch.isfinite(row).nonzero().view(-1).tolist() for row in x]
    assert kept == [[0, 2, 3, 4], [1, 2, 3, 4], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]
    assert torch.equal(x[torch.isfinite(x)], logits[torch.isfinite(x)]), "kept values untouched"


@pytest.mark.parametrize("on_host", [True, False], ids=["cpu path", "device path"])
def test_top_p_keeps_the_lowest_ids_of_a_tie_at_the_cut(on_host):
    """Only values are sorted; equal values at the cut keep the lowest ids, as a stable
    sort by (value desc, id asc) would, on the CPU's path and a device's (run here)."""
    logits = torch.tensor([[1.0, 0.0, 1.0, 2.0, 1.0, 1.0],  # the cut falls inside the tie of ids 0, 2, 4, 5
                           [0.5, 0.5, 0.5, 0.5, 3.0, -1.0],
                           [1.0, 0.0, 1.0, 2.0, 1.0, 1.0],
                           [4.0, 1.0, 0.0, 3.0, -2.0, 2.0]])  # no tie at the cut
    params = [SP(top_p=0.6), SP(top_p=0.9), SP(), SP(top_p=0.8)]
    x = logits.clone()
    _top_p(x, make_sampling_tensors(params, "cpu"), on_host=on_host)
    kept = [torch.isfinite(row).nonzero().view(-1).tolist() for row in x]
    assert kept == [[0, 2, 3], [0, 1, 2, 4], [0, 1, 2, 3, 4, 5], [0, 3]]
    for i, p in enumerate(params):
        assert np.array_equal(torch.isfinite(x[i]).numpy(), ref_keep(logits[i].numpy(), top_p=p.top_p))
    assert torch.equal(x[torch.isfinite(x)], logits[torch.isfinite(x)]), "kept values untouched"


def test_min_p_masks_relative_to_the_max():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.1, 0.049, 0.151]]))
    out = process_logits(logits, make_sampling_tensors([SP(min_p=0.1)], "cpu"))
    # threshold 0.1 * 0.5 = 0.05: 0.049 is masked, 0.1 is kept
    assert torch.isfinite(out[0]).tolist() == [True, True, True, False, True]


def test_process_logits_casts_bf16_to_float32_without_touching_input():
    logits = randn(2, 30, seed=5).bfloat16()
    before = logits.clone()
    out = process_logits(logits, make_sampling_tensors([SP(top_k=3), SP(temperature=0.5)], "cpu"))
    assert out.dtype == torch.float32 and torch.equal(logits, before)


# --- suppression ---------------------------------------------------------------------


def test_suppress_copies_and_masks_per_row():
    logits = randn(3, 10, seed=6)
    assert suppress(logits, [[], [], []]) is logits
    out = suppress(logits, [[2, 9], [], [0]])
    assert out is not logits and torch.isfinite(logits).all()
    assert out[0, 2] == out[0, 9] == out[2, 0] == -math.inf
    assert torch.isfinite(out).sum() == 30 - 3
    assert suppress(logits, [[10, 99], [], []]) is logits  # ids the model cannot emit
    # a suppressed id is never picked, greedy or sampled
    hot = torch.zeros(2, 10)
    hot[:, 4] = 50.0
    out = suppress(hot, [[4], [4]])
    st_ = make_sampling_tensors([SP(temperature=0.0), SP()], "cpu")
    for s in range(20):
        toks = sample(out, st_, [None, make_generator(s, "cpu")])
        assert 4 not in toks.tolist()


# --- seeded determinism --------------------------------------------------------------


def test_seeded_row_same_alone_or_in_any_batch_position():
    target = SP(temperature=0.8, top_k=40, top_p=0.9, seed=1234)
    others = [SP(top_k=5, seed=1), SP(temperature=0.0), SP(min_p=0.2), SP(top_p=0.5, top_k=200)]
    g_alone, g_batch, g_front = (make_generator(1234, "cpu") for _ in range(3))
    other_gens = [make_generator(1, "cpu"), None, None, make_generator(99, "cpu")]
    st_alone = make_sampling_tensors([target], "cpu")
    st_batch = make_sampling_tensors(others[:3] + [target] + others[3:], "cpu")  # row 3 of 5
    st_front = make_sampling_tensors([target, others[2]], "cpu")
    alone, batched, front = [], [], []
    for step in range(50):
        row = randn(1, 300, seed=1000 + step, scale=3.0)
        noise = randn(5, 300, seed=2000 + step, scale=3.0)
        batch = torch.cat([noise[:3], row, noise[4:]])
        alone.append(sample(row, st_alone, [g_alone]).item())
        gens = other_gens[:3] + [g_batch] + other_gens[3:]
        batched.append(sample(batch, st_batch, gens)[3].item())
        front.append(sample(torch.cat([row, noise[:1]]), st_front, [g_front, None])[0].item())
    assert alone == batched == front
    assert len(set(alone)) > 5  # it really sampled


def test_greedy_rows_in_a_batch_take_argmax_and_leave_the_sampled_rows_draws_as_they_were():
    """A batch of greedy and sampled rows: the greedy rows take argmax, and the sampled
    ones (their own generators or the default one) draw what they would with no greedy
    row around; `processed` logits are taken for the sampled rows alike."""
    sampled = [SP(temperature=0.8, top_p=0.9), SP(temperature=1.2, top_k=20, seed=7), SP(min_p=0.1)]
    mixed = [SP(temperature=0.0), sampled[0], SP(temperature=0.0, top_k=3), sampled[1], sampled[2],
             SP(temperature=0.0)]
    st_mixed, st_sampled = make_sampling_tensors(mixed, "cpu"), make_sampling_tensors(sampled, "cpu")
    for step in range(30):
        logits = randn(6, 300, seed=3000 + step, scale=3.0)
        logits[5, 17] = logits[5].max() + 1.0  # a greedy row whose argmax is known
        torch.manual_seed(step)
        alone = sample(logits[[1, 3, 4]], st_sampled, [None, make_generator(7 + step, "cpu"), None])
        torch.manual_seed(step)
        gens = [None, None, None, make_generator(7 + step, "cpu"), None, None]
        together = sample(logits, st_mixed, gens)
        assert together[[1, 3, 4]].tolist() == alone.tolist()
        assert together[[0, 2, 5]].tolist() == logits[[0, 2, 5]].argmax(-1).tolist()
        assert together[5].item() == 17
        torch.manual_seed(step)
        gens[3] = make_generator(7 + step, "cpu")
        processed = process_logits(logits, st_mixed)
        assert sample(logits, st_mixed, gens, processed=processed).tolist() == together.tolist()


def test_make_generator_reproduces():
    a, b = make_generator(42, "cpu"), make_generator(42, "cpu")
    logits = randn(1, 50, seed=7)
    st_ = make_sampling_tensors([SP()], "cpu")
    assert [sample(logits, st_, [a]).item() for _ in range(20)] == [
        sample(logits, st_, [b]).item() for _ in range(20)
    ]
    make_generator(-1, "cpu")  # any int seed is accepted (masked to uint64)
    make_generator(2**70, "cpu")


# --- distribution --------------------------------------------------------------------


def chi_square(counts: np.ndarray, expected_p: np.ndarray) -> float:
    n = counts.sum()
    live = expected_p > 0
    assert counts[~live].sum() == 0, "a masked token was sampled"
    e = expected_p[live] * n
    return float(((counts[live] - e) ** 2 / e).sum())


@pytest.mark.parametrize(
    "kw", [dict(), dict(temperature=0.5), dict(top_k=3), dict(top_p=0.8), dict(min_p=0.2, temperature=1.3)]
)
def test_unseeded_rows_follow_softmax(kw):
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.25, -2.0])
    n = 20000
    torch.manual_seed(123)
    toks = sample(row.expand(n, -1), make_sampling_tensors([SP(**kw)] * n, "cpu"), [None] * n)
    counts = np.bincount(toks.numpy(), minlength=8)
    dof = int((ref_dist(row.numpy(), **kw) > 0).sum()) - 1
    # loose: the 99.99% quantile for <= 7 dof is < 30; fixed seed keeps it deterministic
    assert chi_square(counts, ref_dist(row.numpy(), **kw)) < 30, (counts, dof)


def test_seeded_rows_follow_softmax():
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    n = 3000
    gens = [make_generator(s, "cpu") for s in range(n)]
    toks = sample(row.expand(n, -1), make_sampling_tensors([SP(temperature=0.9)] * n, "cpu"), gens)
    counts = np.bincount(toks.numpy(), minlength=6)
    assert chi_square(counts, ref_dist(row.numpy(), temperature=0.9)) < 30


def test_draws_at_the_ends_of_the_uniform_range_never_pick_a_masked_token(monkeypatch):
    """The race is argmin(probs / log u). u = 1 (log u = 0) would make a masked token's
    0/0 NaN, which argmin takes; u = 0 (log u = -inf) only makes its token lose."""
    from workers.generate import sampler

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0], [2.0, 1.0, 0.5, 0.0]])
    st_ = make_sampling_tensors([SP(top_k=2), SP(top_k=2)], "cpu")  # ids 2 and 3 masked
    monkeypatch.setattr(sampler, "_log_uniform", lambda *a: torch.tensor([[-0.5, -0.1, 0.0, 0.0],
                                                                           [-math.inf, -2.0, 0.0, -1.0]]))
    # row 0: id 0's p/q = p0/0.5 against id 1's p1/0.1, ~0.73/0.5 < ~0.27/0.1: id 1 wins the race
    # row 1: id 0 drew u = 0 (q = inf) and cannot win; id 1 can
    assert sample(logits, st_, [None, None]).tolist() == [1, 1]


# --- properties ----------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.floats(-20, 20, allow_nan=False, width=32), min_size=5, max_size=5), min_size=1, max_size=4
    ),
    data=st.data(),
)
def test_filters_keep_the_argmax_and_never_empty_a_row(rows, data):
    logits = torch.tensor(rows)
    params = data.draw(
        st.lists(
            st.builds(
                SP,
                temperature=st.sampled_from([0.0, 0.3, 1.0, 2.0]),
                top_k=st.integers(-1, 7),
                top_p=st.floats(0.01, 1.0),
                min_p=st.floats(0.0, 1.0),
            ),
            min_size=len(rows),
            max_size=len(rows),
        )
    )
    st_ = make_sampling_tensors(params, "cpu")
    out = process_logits(logits, st_)
    keep = torch.isfinite(out)
    assert keep.any(dim=-1).all()
    assert keep.gather(1, logits.argmax(-1, keepdim=True)).all()
    gens = [make_generator(i, "cpu") for i in range(len(rows))]
    toks = sample(logits, st_, gens)
    assert keep.gather(1, toks.view(-1, 1)).all()
