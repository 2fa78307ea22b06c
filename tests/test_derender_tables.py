"""Per-id tables (docs/design.md §5.1) and byte-fallback correction (§5.2), both tiny tokenizers."""

from __future__ import annotations

import pytest

from tests.derender_support import FFFD, encode_ids, raw_byte_ids, tables_for, tid, tokenizer_dir
from workers.derender.correction import COMPLETE, INCOMPLETE, INVALID, Corrector, correct_token, utf8_state
from workers.derender.vocab import find_anchor, load_tables

KINDS = ["spm", "bytelevel"]


@pytest.fixture(scope="module", params=KINDS)
def tables(request):
    return tables_for(request.param)


def test_tables_match_single_decodes(tables):
    tok = tables.tokenizer
    assert tables.size == tok.get_vocab_size(with_added_tokens=True)
    for i in range(tables.size):
        s = tables.token_str[i]
        assert bytes(tables.token_bytes[i]) == s.encode("utf-8")
        assert tables.dirty[i] == s.endswith(FFFD)
        alone = tok.decode([i], skip_special_tokens=False)
        # The table string is the lone decode, plus at most the leading space a
        # Metaspace decoder strips at the start of a string.
        assert s == alone or s == " " + alone, (i, s, alone)


def test_metaspace_leading_space_restored():
    spm = tables_for("spm")
    assert spm.token_str[tid(spm, "▁true")] == " true"
    assert spm.token_bytes[tid(spm, "▁true")] == list(b" true")
    assert spm.token_str[tid(spm, "▁")] == " "
    assert spm.tokenizer.decode([tid(spm, "▁true")]) == "true"  # what the decoder alone gives
    assert spm.token_str[tid(spm, "<0x41>")] == "A" and not spm.dirty[tid(spm, "<0x41>")]
    assert spm.token_str[tid(spm, "<0xE4>")] == FFFD and spm.dirty[tid(spm, "<0xE4>")]


def test_bytelevel_strings():
    bl = tables_for("bytelevel")
    assert bl.token_str[tid(bl, "Ġtrue")] == " true"
    assert bl.token_str[tid(bl, "self")] == "self" and bl.token_str[tid(bl, "Ġself")] == " self"
    assert bl.dirty[tid(bl, "ĠðŁ")]  # " " + half an emoji


def test_special_tokens_flagged(tables):
    specials = [i for i in range(tables.size) if tables.special[i]]
    assert specials
    for i in specials:
        assert tables.token_str[i] == tables.tokenizer.id_to_token(i)  # "</s>", "<|endoftext|>"
        assert tables.text_skip[i] == "" and tables.text_keep[i] == tables.token_str[i]


def test_anchor_is_plain(tables):
    a = find_anchor(tables.tokenizer)
    assert a is not None and not tables.special[a] and not tables.dirty[a]


def test_load_from_file_and_missing_dir(tmp_path):
    t = load_tables(tokenizer_dir("spm") / "tokenizer.json")
    assert t.size == tables_for("spm").size
    with pytest.raises(FileNotFoundError):
        load_tables(tmp_path / "nope")


# --- correction ----------------------------------------------------------------------

def corrected(tables, ids):
    """Each id's corrected string against the ids sampled before it."""
    c = Corrector(tables)
    return [c.resolve(ids[:i], t) for i, t in enumerate(ids)]


def test_three_byte_character(tables):
    ids = raw_byte_ids(tables, "中".encode())
    out = corrected(tables, ids)
    assert out == [("", []), ("", []), ("中", [228, 184, 173])]


def test_four_byte_emoji_needs_three_context_ids(tables):
    ids = raw_byte_ids(tables, "🎉".encode())
    out = corrected(tables, ids)
    assert [s for s, _ in out] == ["", "", "", "🎉"]
    assert out[-1][1] == list("🎉".encode())
    # With only two ids of context the character cannot be completed.
    c = Corrector(tables)
    assert c.get(tuple(ids[1:3]), ids[3]) == ("", [])


def test_clean_token_before_bytes():
    spm = tables_for("spm")
    ids = [tid(spm, "▁a")] + raw_byte_ids(spm, "中".encode())
    assert [s for s, _ in corrected(spm, ids)] == [" a", "", "", "中"]


def test_bytelevel_partial_tokens():
    bl = tables_for("bytelevel")
    ids = encode_ids(bl, " 🎉")
    assert [bl.tokenizer.id_to_token(i) for i in ids] == ["ĠðŁ", "İī"]
    # The space travels with the token that completes the character.
    assert [s for s, _ in corrected(bl, ids)] == ["", " 🎉"]
    assert bytes(corrected(bl, ids)[1][1]) == " 🎉".encode()


def test_no_context_gives_empty(tables):
    ids = raw_byte_ids(tables, "中".encode())
    c = Corrector(tables)
    assert c.resolve([], ids[2]) == ("", [])  # a continuation byte with nothing before


def test_candidates_use_sampled_context_not_each_other(tables):
    e4, b8, ad = raw_byte_ids(tables, "中".encode())
    c = Corrector(tables)
    # At the position of <0xB8> (context [E4]), the candidate <0xAD> is corrected
    # against [E4] only, not against the sampled <0xB8> of the same position.
    assert c.resolve([e4], ad) == ("", [])
    # One position later (context [E4, B8]) both candidates complete a character.
    a5 = raw_byte_ids(tables, b"\xa5")[0]
    assert c.resolve([e4, b8], ad)[0] == "中"
    assert c.resolve([e4, b8], a5)[0] == b"\xe4\xb8\xa5".decode()


def test_correct_token_pure_rule(tables):
    tok = tables.tokenizer

    def dec(ids):
        return tok.decode(ids, skip_special_tokens=False)

    ids = raw_byte_ids(tables, "x🎉".encode())
    # Shortest context that works; the clean prefix ("x") is removed.
    assert correct_token(dec, tables.dirty, ids[:4], ids[4]) == "🎉"
    assert correct_token(dec, tables.dirty, ids[:2], ids[2]) == ""


def test_corrector_cache(tables):
    e4, b8, ad = raw_byte_ids(tables, "中".encode())
    a5 = raw_byte_ids(tables, b"\xa5")[0]
    c = Corrector(tables, max_entries=2)
    first = c.get((e4, b8), ad)
    assert c.get((e4, b8), ad) is first and (c.hits, c.misses) == (1, 1)
    assert c.get((), ad) == ("", []) and c.misses == 1  # empty key: no lookup at all
    c.get((e4, b8), a5)
    c.get((e4,), b8)  # over the bound: the cache is dropped, never grows past it
    assert len(c._cache) <= 2


# --- the cache key is exact ------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from workers.derender.correction import context_key  # noqa: E402


def _interesting_ids(tables):
    tok = tables.tokenizer
    ids = set()
    for text in ["中文字", "🎉👍🏽", "éïñß", " the a", "x\n", "日本語"]:
        ids.update(tok.encode(text, add_special_tokens=False).ids)
        ids.update(raw_byte_ids(tables, text.encode()))
    ids.update(raw_byte_ids(tables, bytes(range(0x80, 0x100, 7))))
    return sorted(ids)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_context_key_gives_the_rule_result(kind, data):
    """Correcting against the short cache key == the docs/design.md §5.2 rule on the last 4 sampled ids."""
    tables = tables_for(kind)
    pool = _interesting_ids(tables)
    hist = data.draw(st.lists(st.sampled_from(pool), max_size=7))
    cand = data.draw(st.sampled_from([i for i in pool if tables.dirty[i]]))

    def dec(ids):
        return tables.tokenizer.decode(ids, skip_special_tokens=False)

    want = correct_token(dec, tables.dirty, hist[-4:], cand)
    key = context_key(hist, tables.dirty, tables.raw_bytes)
    assert len(key) <= 4 and tuple(hist[len(hist) - len(key):]) == key
    assert Corrector(tables).get(key, cand)[0] == want
    # What the shaping uses (the "never completable" shortcut included) agrees as well.
    assert Corrector(tables).resolve(hist, cand)[0] == want
    # The generic key (no raw bytes known) is exact too.
    generic = context_key(hist, tables.dirty, [None] * tables.size)
    assert Corrector(tables).get(generic, cand)[0] == want


def test_context_key_examples():
    spm = tables_for("spm")
    d, r = spm.dirty, spm.raw_bytes
    e4, b8, ad = raw_byte_ids(spm, "中".encode())
    f0, x9f, x8e, _ = raw_byte_ids(spm, "🎉".encode())
    the = tid(spm, "▁the")
    assert context_key([the], d, r) == ()  # clean end: nothing to complete
    assert context_key([the, e4, b8, ad], d, r) == ()  # a complete character
    assert context_key([the, e4, b8], d, r) == (e4, b8)
    assert context_key([ad, e4], d, r) == (e4,)
    assert context_key([the, f0, x9f, x8e], d, r) == (f0, x9f, x8e)


@pytest.mark.parametrize("data,state", [
    (b"", COMPLETE), (b"a", COMPLETE), ("中".encode(), COMPLETE), ("🎉".encode(), COMPLETE),
    (b"\xe4", INCOMPLETE), (b"\xe4\xb8", INCOMPLETE), (b"a\xf0\x9f\x8e", INCOMPLETE), (b"\xe0", INCOMPLETE),
    (b"\xb8", INVALID), (b"a\xb8", INVALID), (b"\xe4a", INVALID), (b"\xe0\x80", INVALID),
    (b"\xed\xa0", INVALID), (b"\xff", INVALID), (b"\xf0\x9f\x8e\xf0", INVALID), (b"\xb8\xe4", INVALID),
])
def test_utf8_state(data, state):
    assert utf8_state(data) == state


def test_utf8_state_against_the_decoder():
    """Every 1..3 byte string over boundary bytes: INCOMPLETE iff some continuation
    bytes make it valid, as Python's own decoder judges."""
    import itertools

    conts = [0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF]

    def slow(d):
        try:
            d.decode()
            return COMPLETE
        except UnicodeDecodeError:
            for extra in range(1, 4):
                for tail in itertools.product(conts, repeat=extra):
                    try:
                        (d + bytes(tail)).decode()
                        return INCOMPLETE
                    except UnicodeDecodeError:
                        pass
            return INVALID

    edges = [0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC2, 0xDF, 0xE0, 0xE4, 0xED, 0xEF,
             0xF0, 0xF4, 0xF5, 0xFF]
    for n in (1, 2, 3):
        for t in itertools.product(edges, repeat=n):
            assert utf8_state(bytes(t)) == slow(bytes(t)), bytes(t)
