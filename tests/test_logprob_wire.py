"""Logprob entries encoded a step at a time (workers/generate/logprob_wire.py): whatever
the rows, a reader decodes exactly the entries the reference assembly
(`RowLogprobs.content`, pinned to the rules in tests/test_logprobs.py) builds, and a
chunk that carries them decodes to the chunk built from those structs."""

from __future__ import annotations

import msgspec
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.records import GenerateChunk, GenerateLogProbs
from workers.generate.logprob_entries import FLOOR, RowLogprobs, decode_entry, logprobs_raw
from workers.generate.logprob_wire import encode_entries
from workers.generate.logprobs import step_to_entries, step_to_host
from workers.generate.synthetic import synthetic_entries, synthetic_row


def reference(sid, rank, value, top_ids, top_values, k):
    return RowLogprobs(sid, rank, value, tuple(top_ids[:k]), tuple(top_values[:k])).content()


@st.composite
def steps(draw):
    """A step's rows as the engine has them: distinct top ids in rank order, values
    descending and wire-safe, the sampled id inside the top or not, NaN rows (rank 0)."""
    vocab = draw(st.sampled_from([40, 300, 70_000, 300_000]))  # ids and ranks past 16 bits too
    k_max = min(vocab, draw(st.sampled_from([0, 1, 2, 5, 20, 130])))  # ranks past a fixint too
    n = draw(st.integers(1, 8))
    one_k = draw(st.booleans())
    k_all = draw(st.integers(0, k_max))
    rows = []
    for _ in range(n):
        top = draw(st.lists(st.integers(0, vocab - 1), min_size=k_max, max_size=k_max, unique=True))
        values = sorted(draw(st.lists(st.one_of(st.just(FLOOR), st.just(0.0), st.floats(-50, 0)),
                                      min_size=k_max, max_size=k_max)), reverse=True)
        sid = draw(st.sampled_from(top)) if top and draw(st.booleans()) else draw(st.integers(0, vocab - 1))
        nan_row = draw(st.integers(0, 9)) == 0
        rank = 0 if nan_row else draw(st.integers(1, vocab))
        value = FLOOR if nan_row else draw(st.floats(-9999.0, 0.0))
        rows.append((sid, rank, value, top, values, k_all if one_k else draw(st.integers(0, k_max))))
    return k_max, rows, draw(st.sampled_from([None, vocab]))  # the ints' width: scanned, or from the vocabulary


@settings(max_examples=300, deadline=None)
@given(steps())
def test_every_row_decodes_to_the_reference_entry(step):
    k_max, rows, vocab_size = step
    sids, ranks, values, tops, top_values, ks = zip(*rows)
    got = encode_entries(np.array(sids), np.array(ranks), np.array(values, dtype=np.float64),
                         np.array(tops, dtype=np.int64).reshape(len(rows), k_max),
                         np.array(top_values, dtype=np.float64).reshape(len(rows), k_max), list(ks), vocab_size)
    assert [decode_entry(entry) for entry in got] == [reference(*row) for row in rows]


def test_a_chunk_with_encoded_entries_decodes_like_one_built_from_structs():
    rows = [RowLogprobs(7, 1, -0.25, (7, 9, 300), (-0.25, -1.5, -2.0)),
            RowLogprobs(70_000, 12, -3.5, (1, 2, 3), (-0.1, -0.2, -0.3)),
            RowLogprobs(5, 0, FLOOR, (5, 6, 8), (FLOOR, FLOOR, FLOOR))]  # a NaN row
    entries = encode_entries(np.array([r.sampled_id for r in rows]), np.array([r.rank for r in rows]),
                             np.array([r.value for r in rows]), np.array([r.top_ids for r in rows]),
                             np.array([r.top_values for r in rows]), [3, 3, 3])
    fields = dict(request_id="r", attempt="a", seq=1, token_offset=4, token_ids=[7, 70_000, 5])
    by_structs = GenerateChunk(**fields, logprobs=GenerateLogProbs(content=[r.content() for r in rows]))
    by_entries = GenerateChunk(**fields, logprobs=logprobs_raw(entries))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(by_entries), type=GenerateChunk)
    assert decoded == by_structs
    assert decoded.logprobs.content[2].rank is None and decoded.logprobs.content[1].rank == 12
    # Fixed-width ints where msgspec writes the shortest form: a few bytes more (small ids
    # and ranks here; a real vocabulary's ids take 3-5 bytes either way).
    sizes = len(msgspec.msgpack.encode(by_entries)), len(msgspec.msgpack.encode(by_structs))
    assert sizes[1] <= sizes[0] <= sizes[1] * 1.25, sizes


def test_a_long_chunk_gets_a_long_array_header():
    entries = [bytes(e) for e in synthetic_entries(list(range(3, 23)), [2] * 20, 2000)]  # 20: past a fixarray
    content = msgspec.msgpack.decode(msgspec.msgpack.encode(logprobs_raw(entries)), type=GenerateLogProbs).content
    assert [c.token_id for c in content] == list(range(3, 23))


def test_the_engine_step_encodes_what_the_reference_step_builds():
    """`step_to_entries` (the engine's) against `step_to_host` (structs), on rows that take
    every branch: ties, NaN and -inf rows, sampled ids far outside the top, mixed k."""
    from tests.test_logprobs import awkward_batch

    x, sampled = awkward_batch(seed=3)
    for ks in ([20] * 12, [20, 3, None, 0, 1, 20, 5, 2, 19, 20, None, 23], [None] * 12, [-1] + [None] * 11):
        ids, want = step_to_host(x, sampled, ks)
        got_ids, got = step_to_entries(x, sampled, ks)
        assert got_ids == ids
        assert [None if e is None else decode_entry(e) for e in got] == want
    assert decode_entry(step_to_entries(x, sampled, [5] * 12)[1][3]).rank is None  # row 3 is NaN


def test_synthetic_entries_are_the_synthetic_rows():
    tokens, ks = [3, 1999, 500, 42], [1, 5, 5, 20]
    got = synthetic_entries(tokens, ks, 2000)
    assert [decode_entry(e) for e in got] == [synthetic_row(t, k, 2000).content() for t, k in zip(tokens, ks)]


def test_the_one_copy_off_the_cpu_gives_the_arrays_the_cpu_path_reads():
    """The engine's host arrays off the CPU come from one packed copy (`_packed_copy`); on
    CPU tensors both ways must give the same values and types."""
    from workers.generate.logprobs import _arrays_to_host, _packed_copy

    tensors = (torch.tensor([3, 70_000]), torch.tensor([-0.25, FLOOR], dtype=torch.float32),
               torch.tensor([[1, 2], [3, 4]]), torch.tensor([[-0.5, -1.5], [-2.5, -3.5]], dtype=torch.float32))
    direct = _arrays_to_host(*tensors)
    packed = [part.numpy() for part in _packed_copy(tensors)]
    for a, b in zip(direct, packed):
        assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all()
    assert [a.dtype for a in direct] == [np.int64, np.float64, np.int64, np.float64]
