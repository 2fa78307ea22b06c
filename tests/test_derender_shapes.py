"""OpenAI shapes (docs/design.md §5.4): top-k rules, completion dicts, offsets, usage, ids, and
validation of every record against the official `openai` package types."""

from __future__ import annotations

import pytest

from tests.derender_support import (encode_ids, make_chunks, openai_validate, position, raw_byte_ids, results,
                              roundtrip, run_chunks, streamed_text, tables_for, tid)
from schemas.openai import ChatCompletion, ChatCompletionChunk, Completion
from schemas.records import OutputOptions
from workers.derender.state import Derenderer

KINDS = ["spm", "bytelevel"]
NS = 1_700_000_000_123_456_789


@pytest.fixture(scope="module", params=KINDS)
def tables(request):
    return tables_for(request.param)


def render(tables, ids, positions, *, kind="chat", stream=False, k=0, sizes=None, **opts):
    output = OutputOptions(kind=kind, stream=stream, top_logprobs=k, **opts)
    d = Derenderer(tables, model_name="tiny")
    out = run_chunks(d, make_chunks("r1", ids, sizes, output=output, positions=positions,
                                    prompt_tail=encode_ids(tables, "x")))
    for r in results(out):
        openai_validate(r.value)
        assert roundtrip(r.value) == r.value
    return results(out)


def five_tops(tables):
    words = ["hello", " the", " and", "ok", " x", " y", " z"]
    ids = []
    for w in words:
        for i in encode_ids(tables, w):
            if i not in ids:
                ids.append(i)
    return ids[:6]


@pytest.mark.parametrize("k", [0, 1, 5])
def test_chat_top_k_first_k_entries(tables, k):
    top = five_tops(tables)
    sampled = top[2]  # rank 3: listed first, then ranks 1, 2, 4, ...
    pos = position(sampled, top, n=max(k, 1))
    (res,) = render(tables, [sampled], [pos], k=k)
    (entry,) = res.value.choices[0].logprobs.content
    assert entry.token == tables.token_str[sampled] and entry.logprob == pos.logprob
    assert entry.bytes == list(tables.token_str[sampled].encode())
    want = [tables.token_str[e.token_id] for e in pos.top_logprobs[:k]]
    assert [t.token for t in entry.top_logprobs] == want
    if k:
        assert entry.top_logprobs[0].token == entry.token  # the sampled one first
    if k == 0:
        assert entry.top_logprobs == []


@pytest.mark.parametrize("k", [0, 1, 5])
def test_completion_dict_rank_rule(tables, k):
    top = five_tops(tables)
    sampled_outside = next(i for i in encode_ids(tables, " qu") if i not in top)
    ids = [top[0], sampled_outside]
    positions = [position(top[0], top, n=k + 1), position(sampled_outside, top, n=k + 1)]
    (res,) = render(tables, ids, positions, kind="completion", k=k)
    lp = res.value.choices[0].logprobs
    s = tables.token_str
    assert lp.tokens == [s[ids[0]], s[ids[1]]]
    assert lp.token_logprobs == [positions[0].logprob, positions[1].logprob]
    # Position 0: sampled is rank 1 -> itself, then ranks 2..k.
    assert list(lp.top_logprobs[0]) == [s[t] for t in top[: max(k, 1)]]
    # Position 1: the sampled token (outside the top k) first, then ranks 1..k.
    assert list(lp.top_logprobs[1]) == [s[sampled_outside]] + [s[t] for t in top[:k]]
    assert lp.top_logprobs[1][s[sampled_outside]] == positions[1].logprob


def test_completion_equal_strings_collapse():
    spm = tables_for("spm")
    bang_piece, bang_byte, q = tid(spm, "!"), tid(spm, "<0x21>"), tid(spm, "?")
    assert spm.token_str[bang_piece] == spm.token_str[bang_byte] == "!"
    top = [q, bang_piece, bang_byte]
    pos = position(q, top, n=4, logprobs=[-0.1, -0.2, -0.3])
    (res,) = render(spm, [q], [pos], kind="completion", k=3)
    d = res.value.choices[0].logprobs.top_logprobs[0]
    assert list(d.items()) == [("?", -0.1), ("!", -0.3)]  # key keeps its place, later value wins
    # The same for two lone lead bytes, which both correct to "".
    e4, e5 = tid(spm, "<0xE4>"), tid(spm, "<0xE5>")
    pos = position(q, [q, e4, e5], n=4, logprobs=[-0.1, -0.2, -0.3])
    (res,) = render(spm, [q], [pos], kind="completion", k=3)
    assert list(res.value.choices[0].logprobs.top_logprobs[0].items()) == [("?", -0.1), ("", -0.3)]


def test_leading_space_key_does_not_collide():
    bl = tables_for("bytelevel")
    with_space, plain = tid(bl, "Ġtrue"), tid(bl, "self")
    spaced_self = tid(bl, "Ġself")
    pos = position(with_space, [with_space, plain, spaced_self], n=4)
    (res,) = render(bl, [with_space], [pos], kind="completion", k=3)
    assert list(res.value.choices[0].logprobs.top_logprobs[0]) == [" true", "self", " self"]
    spm = tables_for("spm")
    t = tid(spm, "▁true")
    pos = position(t, [t, tid(spm, "▁name"), tid(spm, "name")], n=4)
    (res,) = render(spm, [t], [pos], kind="completion", k=3)
    assert list(res.value.choices[0].logprobs.top_logprobs[0]) == [" true", " name", "name"]


def test_byte_position_candidates_and_bytes(tables):
    ids = raw_byte_ids(tables, "中".encode())
    a5 = raw_byte_ids(tables, b"\xa5")[0]
    positions = [position(i, [i, a5]) for i in ids]
    (res,) = render(tables, ids, positions, k=2)
    content = res.value.choices[0].logprobs.content
    assert [(c.token, c.bytes) for c in content] == [("", []), ("", []), ("中", [228, 184, 173])]
    # At the last position the candidate <0xA5> completes "严" from the same context.
    assert [t.token for t in content[2].top_logprobs] == ["中", b"\xe4\xb8\xa5".decode()]
    assert [t.token for t in content[1].top_logprobs] == ["", ""]


def test_text_offset_code_points(tables):
    text = "a中🎉b é"
    ids = encode_ids(tables, text)
    positions = [position(i, [i]) for i in ids]
    (res,) = render(tables, ids, positions, kind="completion", k=0)
    lp = res.value.choices[0].logprobs
    out = res.value.choices[0].text
    assert "".join(lp.tokens) == out and out.lstrip(" ") == text  # spm encodes "a" as "▁a"
    text = out
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets
    assert lp.text_offset[-1] + len(lp.tokens[-1]) == len(text)  # code points, not bytes


def test_streamed_offsets_continue_across_chunks(tables):
    ids = encode_ids(tables, " one 中文 two")
    positions = [position(i, [i]) for i in ids]
    streamed = render(tables, ids, positions, kind="completion", stream=True, k=0)
    (final,) = render(tables, ids, positions, kind="completion", stream=False, k=0)
    offsets = [o for r in streamed for o in r.value.choices[0].logprobs.text_offset]
    assert offsets == final.value.choices[0].logprobs.text_offset


def test_missing_logprobs(tables):
    ids = encode_ids(tables, " a b c d")
    positions = [position(i, [i]) for i in ids]
    positions[1] = None  # chunk 1 (one token each) has logprobs=None
    res = render(tables, ids, positions, kind="completion", stream=True, k=1)
    lp1 = res[1].value.choices[0].logprobs
    assert lp1.tokens == [tables.token_str[ids[1]]]
    assert lp1.token_logprobs == [None] and lp1.top_logprobs == [None]
    (final,) = render(tables, ids, positions, kind="completion", k=1)
    assert final.value.choices[0].logprobs.token_logprobs[1] is None
    # Chat has no null entries: the position is left out.
    (chat,) = render(tables, ids, positions, kind="chat", k=1)
    assert len(chat.value.choices[0].logprobs.content) == len(ids) - 1
    streamed = render(tables, ids, positions, kind="chat", stream=True, k=1)
    assert streamed[1].value.choices[0].logprobs is None


def test_no_logprobs_requested(tables):
    ids = encode_ids(tables, " hi")
    for kind in ("chat", "completion"):
        (res,) = render(tables, ids, None, kind=kind)
        assert res.value.choices[0].logprobs is None


def test_chat_stream_shape(tables):
    ids = encode_ids(tables, " hello there")
    res = render(tables, ids, None, stream=True, include_usage=True)
    assert len(res) == len(ids)
    assert all(isinstance(r.value, ChatCompletionChunk) for r in res)
    assert res[0].value.choices[0].delta.role == "assistant"
    assert all(r.value.choices[0].delta.role is None for r in res[1:])
    assert [r.value.choices[0].finish_reason for r in res] == [None] * (len(ids) - 1) + ["length"]
    assert [r.value.usage for r in res[:-1]] == [None] * (len(ids) - 1)
    u = res[-1].value.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (5, len(ids), 5 + len(ids))
    assert {r.value.id for r in res} == {"chatcmpl-r1"}
    assert {r.value.created for r in res} == {NS // 10**9}
    assert {r.value.model for r in res} == {"tiny"}
    assert streamed_text(res) == " hello there"
    assert [r.final for r in res] == [False] * (len(ids) - 1) + [True]
    assert [r.headers.get("genpipe-final") for r in res][-1] == "1"
    assert [r.headers["genpipe-seq"] for r in res] == [str(i) for i in range(len(ids))]


def test_completion_final_shape_and_names(tables):
    ids = encode_ids(tables, " hi")
    (res,) = render(tables, ids, None, kind="completion", model="my-model", created=123)
    v = res.value
    assert isinstance(v, Completion) and v.id == "cmpl-r1" and v.model == "my-model" and v.created == 123
    assert v.usage.completion_tokens == len(ids)  # non-streamed results always carry usage
    (chat,) = render(tables, ids, None, kind="chat")
    assert isinstance(chat.value, ChatCompletion) and chat.value.usage is not None
    assert chat.value.choices[0].message.role == "assistant"


def test_streamed_completion_usage_only_if_asked(tables):
    ids = encode_ids(tables, " hi there")
    res = render(tables, ids, None, kind="completion", stream=True)
    assert all(r.value.usage is None for r in res)


def test_abort_and_empty_last_chunk(tables):
    ids = encode_ids(tables, " hi")
    output = OutputOptions(kind="chat", stream=True)
    chunks = make_chunks("r1", ids, output=output, finish_reason=None,
                         prompt_tail=encode_ids(tables, "x"))
    chunks += make_chunks("r1", [], [0], finish_reason="abort")
    chunks[-1].seq, chunks[-1].token_offset = len(ids), len(ids)
    chunks[-1].output = chunks[-1].prompt_tail_ids = chunks[-1].prompt_token_count = None
    res = results(run_chunks(Derenderer(tables), chunks))
    assert res[-1].value.choices[0].finish_reason == "abort" and res[-1].value.choices[0].delta.content == ""
    for r in res:
        openai_validate(r.value)  # "abort" is vLLM's extension; tolerated as documented
