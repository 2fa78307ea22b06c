"""Incremental text (docs/design.md §5.3): seeding, hold-back, the restart trap, stop strings,
and a property test against the tokenizer's own full decode."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from tests.derender_support import (FFFD, encode_ids, make_chunks, openai_validate, position, raw_byte_ids,
                              results, run_chunks, streamed_text, tables_for, tid)
from schemas.openai import ChatCompletion, ChatCompletionChunk
from schemas.records import OutputOptions
from workers.derender.detokenizer import Detokenizer, StopMatcher
from workers.derender.state import CancelRequest, Derenderer

KINDS = ["spm", "bytelevel"]


@pytest.fixture(scope="module", params=KINDS)
def tables(request):
    return tables_for(request.param)


def steps(det, ids):
    return [det.step(i) for i in ids]


# --- detokenizer ---------------------------------------------------------------------

def test_prompt_tail_keeps_first_space(tables):
    tail = encode_ids(tables, "[assistant]:")
    out = encode_ids(tables, " Hello world")
    det = Detokenizer(tables, prompt_tail=tail)
    assert det.feed(out) == " Hello world"
    # Without a tail the output is decoded on its own, as the full decode does it.
    assert Detokenizer(tables).feed(out) == tables.tokenizer.decode(out)


def test_incomplete_character_held_back(tables):
    ids = raw_byte_ids(tables, "x中🎉".encode())
    det = Detokenizer(tables, prompt_tail=encode_ids(tables, "a"))
    assert steps(det, ids) == ["x", "", "", "中", "", "", "", "🎉"]
    assert det.flush() == ""


def test_character_split_between_prompt_and_output(tables):
    data = "中".encode()
    tail, out = raw_byte_ids(tables, b"a" + data[:1]), raw_byte_ids(tables, data[1:])
    det = Detokenizer(tables, prompt_tail=tail)
    assert steps(det, out) == ["", "中"]


def test_prompt_ending_inside_a_character_keeps_it(tables):
    """A prompt that ends with the first byte(s) of a character the output does not
    complete: the U+FFFD is the prompt's, so the answer does not start with it (it did)."""
    out = encode_ids(tables, " the end")
    plain = Detokenizer(tables, prompt_tail=encode_ids(tables, "a")).feed(out)
    for cut in (1, 2):
        tail = raw_byte_ids(tables, b"a" + "中".encode()[:cut])
        det = Detokenizer(tables, prompt_tail=tail)
        assert "".join(steps(det, out)) + det.flush() == plain
        # one broken byte of the output's own still shows
        det = Detokenizer(tables, prompt_tail=tail)
        own = raw_byte_ids(tables, b"\xe4")
        assert det.feed(out + own) + det.flush() == plain + FFFD


def test_prompt_ending_in_a_merged_piece_with_half_a_character():
    """Byte-level BPE's `Ġ` + the first bytes of a CJK character as one piece (e.g. `Ġåĩ`)."""
    bl = tables_for("bytelevel")
    from workers.derender.correction import INCOMPLETE, utf8_state

    merged = [i for i in range(bl.size) if bl.raw_bytes[i] and len(bl.raw_bytes[i]) >= 2
              and bl.raw_bytes[i][:1] == b" " and utf8_state(bl.raw_bytes[i]) == INCOMPLETE]
    assert merged, "the tiny byte-level vocabulary should have a space + partial character piece"
    out = encode_ids(bl, " the end")
    plain = Detokenizer(bl, prompt_tail=encode_ids(bl, "a")).feed(out)
    det = Detokenizer(bl, prompt_tail=encode_ids(bl, "a") + [merged[0]])
    text = det.feed(out) + det.flush()
    assert not text.startswith(FFFD) and FFFD not in text
    assert text == plain


def test_flush_shows_broken_bytes(tables):
    ids = raw_byte_ids(tables, "ab".encode() + "中".encode()[:2])
    det = Detokenizer(tables, prompt_tail=encode_ids(tables, "x"))
    assert "".join(steps(det, ids)) == "ab"
    assert det.flush().startswith(FFFD)  # what the full decode shows for the stub


def test_invalid_prefix_trap_restarts_without_error():
    spm = tables_for("spm")
    from tokenizers.decoders import DecodeStream

    the = tid(spm, "▁the")
    ids = [the, *raw_byte_ids(spm, "中".encode()), raw_byte_ids(spm, b"\xb8")[0], the, the]
    # tokenizers' own stream breaks here (ByteFallback turns the whole run into U+FFFDs)...
    ds = DecodeStream(skip_special_tokens=True)
    with pytest.raises(Exception, match="Invalid prefix"):
        for i in ids:
            ds.step(spm.tokenizer, i)
    # ...ours restarts from the pending ids and keeps going, showing the stray byte.
    det = Detokenizer(spm)
    assert steps(det, ids) == ["the", "", "", "中", "", FFFD + " the", " the"]


def test_broken_characters_settle_without_losing_later_text(tables):
    # Two emoji cut short, then a whole character: the broken ones show as U+FFFD (no
    # more of them than the full decode has), and nothing after them is lost.
    tail = encode_ids(tables, "x")
    end = encode_ids(tables, "ok中")
    ids = raw_byte_ids(tables, "🎉".encode()[:3] * 2 + "中".encode()) + end
    det = Detokenizer(tables, prompt_tail=tail)
    text = "".join(steps(det, ids)) + det.flush()
    dec = tables.tokenizer.decode
    full = dec(tail + ids)[len(dec(tail)):]
    assert text.endswith("中" + dec(tail + end)[len(dec(tail)):]) and FFFD in text
    assert text.count(FFFD) <= full.count(FFFD)


def test_completed_character_followed_by_stray_bytes():
    # Found by the property test: <E4><A1> is held, then one token brings the last byte
    # of "䡏" *and* a stray byte. The held character must not be settled as broken.
    bl = tables_for("bytelevel")
    ids = [tid(bl, "ä"), tid(bl, "¡"), tid(bl, "ı½,")]
    tail = encode_ids(bl, "[assistant]:")
    det = Detokenizer(bl, prompt_tail=tail)
    text = "".join(steps(det, ids)) + det.flush()
    dec = bl.tokenizer.decode
    assert text == dec(tail + ids)[len(dec(tail)):] == "䡏" + FFFD + ","


def eos_of(tables):
    return max(i for i in range(tables.size) if tables.special[i] and tables.token_str[i] in ("</s>", "<|endoftext|>"))


def test_skip_special_tokens(tables):
    eos = eos_of(tables)
    first, second = encode_ids(tables, "hi"), encode_ids(tables, "there")
    ids = first + [eos] + second
    tail = encode_ids(tables, "x")
    hi, there = ("".join(tables.token_str[i] for i in part) for part in (first, second))
    assert Detokenizer(tables, prompt_tail=tail).feed(ids) == hi + there
    kept = Detokenizer(tables, skip_special_tokens=False, prompt_tail=tail).feed(ids)
    assert kept == hi + tables.token_str[eos] + there
    for skip in (True, False):
        full = tables.tokenizer.decode(tail + ids, skip_special_tokens=skip)
        base = tables.tokenizer.decode(tail, skip_special_tokens=skip)
        assert Detokenizer(tables, skip_special_tokens=skip, prompt_tail=tail).feed(ids) == full[len(base):]


def test_long_broken_run_is_not_held_forever():
    spm = tables_for("spm")
    stray = raw_byte_ids(spm, b"A\xb8" + b"\xe4" * 20)
    det = Detokenizer(spm, prompt_tail=encode_ids(spm, "x"))
    text = "".join(steps(det, stray)) + det.flush()
    assert text.startswith("A") and FFFD in text


# --- stop strings ----------------------------------------------------------------------

def test_stop_matcher_holds_back_and_cuts():
    m = StopMatcher(["END", "xyz"])
    assert m.hold == 2
    assert m.feed("abcE") == ("ab", False)
    assert m.feed("N") == ("c", False)  # "EN" could still become "END"
    assert m.feed("Dtail") == ("", True)
    m = StopMatcher(["END"], include_stop_str_in_output=True)
    assert m.feed("abEND more") == ("abEND", True)
    m = StopMatcher(["bc", "abcd"])
    assert m.feed("zabcd") == ("z", True)  # the earliest match wins ("abcd" at 1)
    m = StopMatcher(["Q"])
    assert m.hold == 0 and m.feed("abc") == ("abc", False)


def _stop_run(tables, text, stops, sizes=None, include=False, stream=True, kind="completion"):
    ids = encode_ids(tables, text)
    opts = OutputOptions(kind=kind, stream=stream, stop=stops, include_stop_str_in_output=include)
    d = Derenderer(tables)
    chunks = make_chunks("r", ids, sizes, output=opts, prompt_tail=encode_ids(tables, "x"))
    return d, chunks, run_chunks(d, chunks)


def test_stop_string_across_chunks(tables):
    d, chunks, out = _stop_run(tables, " one two three four five six", [" four"])
    assert streamed_text(out) == " one two three"
    res = results(out)
    assert res[-1].final and res[-1].value.choices[0].finish_reason == "stop"
    assert [o for o in out if isinstance(o, CancelRequest)] == [CancelRequest("r", "stop string matched")]
    assert d.is_finished("r") and not d.is_active("r")
    # The match ended the request: no result after the one that matched.
    assert out[-1] == CancelRequest("r", "stop string matched") and res[-1].headers["genpipe-final"] == "1"
    # No streamed delta ever contained text of the stop string.
    assert all("four" not in r.value.choices[0].text for r in res)
    for r in res:
        openai_validate(r.value)


def test_stop_string_include_and_non_stream(tables):
    _, _, out = _stop_run(tables, " one two three four five", ["three"], include=True, stream=False,
                          kind="chat")
    (res,) = results(out)
    assert isinstance(res.value, ChatCompletion)
    assert res.value.choices[0].message.content == " one two three"
    assert res.value.choices[0].finish_reason == "stop"
    openai_validate(res.value)


def test_stop_string_usage_counts_tokens_up_to_match(tables):
    ids = encode_ids(tables, " one two three four five")
    opts = OutputOptions(kind="chat", stream=True, include_usage=True, stop=["two"])
    out = run_chunks(Derenderer(tables), make_chunks("r", ids, [len(ids)], output=opts,
                                                      prompt_tail=encode_ids(tables, "x")))
    v = results(out)[-1].value
    assert isinstance(v, ChatCompletionChunk)
    n_upto = next(n for n in range(1, len(ids) + 1)
                  if "two" in tables.tokenizer.decode(ids[:n]))
    assert v.usage.completion_tokens == n_upto
    assert v.choices[0].delta.content == " one "


def test_stop_string_in_flushed_tail(tables):
    # The finishing chunk's held-back text still goes through stop matching.
    _, _, out = _stop_run(tables, " abc defg", ["defg"], sizes=None)
    assert streamed_text(out) == " abc "


def test_stop_token_excluded_from_text(tables):
    eos = eos_of(tables)
    ids = encode_ids(tables, " ok") + [eos]
    opts = OutputOptions(stream=False, skip_special_tokens=False)
    out = run_chunks(Derenderer(tables), make_chunks("r", ids, output=opts, finish_reason="stop",
                                                      stop_token_id=eos, prompt_tail=encode_ids(tables, "x")))
    assert streamed_text(out) == " ok"
    assert results(out)[0].value.usage.completion_tokens == len(ids)
    opts = OutputOptions(stream=False, skip_special_tokens=False, include_stop_str_in_output=True)
    out = run_chunks(Derenderer(tables), make_chunks("r", ids, output=opts, finish_reason="stop",
                                                      stop_token_id=eos, prompt_tail=encode_ids(tables, "x")))
    assert streamed_text(out) == " ok" + tables.token_str[eos]


# --- property: streamed text vs the tokenizer's full decode -------------------------------

ALPHABET = "ab xyz.,\n'éïñ中文字日本🎉👍🏽ß"
texts = st.text(alphabet=ALPHABET, max_size=12)


@st.composite
def id_sequences(draw, kind):
    tables = tables_for(kind)
    plain = [i for i in range(tables.size) if not tables.special[i]]
    parts = []
    for _ in range(draw(st.integers(1, 5))):
        how = draw(st.sampled_from(["encode", "bytes", "random", "split"]))
        if how == "encode":
            parts += encode_ids(tables, draw(texts))
        elif how == "bytes":
            parts += raw_byte_ids(tables, draw(texts).encode())
        elif how == "split":  # a character cut short: its first byte(s) only
            data = draw(st.sampled_from(["中", "🎉", "é", "文"])).encode()
            parts += raw_byte_ids(tables, data[: draw(st.integers(1, len(data) - 1))])
        else:
            parts += draw(st.lists(st.sampled_from(plain), max_size=4))
    return parts


def _random_sizes(draw, n):
    sizes, left = [], n
    while left:
        s = draw(st.integers(1, min(left, 5)))
        sizes.append(s)
        left -= s
    return sizes or [0]


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_streamed_text_matches_full_decode(kind, data):
    tables = tables_for(kind)
    tok = tables.tokenizer
    ids = data.draw(id_sequences(kind))
    tail = encode_ids(tables, data.draw(st.sampled_from(["", "[assistant]:", "Q: 中文?", "x"])))[-8:]
    sizes = _random_sizes(data.draw, len(ids)) if ids else [0]
    chat = data.draw(st.booleans())
    positions = [position(i, [i]) for i in ids]
    streams = {}
    for stream in (True, False):
        opts = OutputOptions(kind="chat" if chat else "completion", stream=stream, top_logprobs=1)
        d = Derenderer(tables)
        out = run_chunks(d, make_chunks("p", ids, sizes, output=opts, prompt_tail=tail, positions=positions))
        assert results(out)[-1].final and not d.active_requests()
        for r in results(out):
            openai_validate(r.value)
        streams[stream] = out
    text = streamed_text(streams[True])
    assert text == streamed_text(streams[False])

    base = tok.decode(tail)
    full = tok.decode(tail + ids)
    assume(full.startswith(base))
    expected = full[len(base):]
    event("broken UTF-8" if FFFD in expected else "valid UTF-8")
    if FFFD not in expected:
        assert text == expected  # valid UTF-8: exactly the coupled endpoint's text
    else:
        assert text.count(FFFD) <= expected.count(FFFD)  # never a U+FFFD it lacks

    # bytes of the sampled tokens spell the text wherever corrections succeeded.
    if chat:
        content = [c for r in results(streams[False]) for c in r.value.choices[0].logprobs.content]
        tokens = [(c.token, c.bytes) for c in content]
    else:
        lp = results(streams[False])[0].value.choices[0].logprobs
        tokens = [(t, None) for t in lp.tokens]
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    if base and FFFD not in text and not any(FFFD in t for t, _ in tokens):
        event("token strings checked")
        assert "".join(t for t, _ in tokens) == text
        if chat:
            assert bytes(b for _, bs in tokens for b in bs) == text.encode()
