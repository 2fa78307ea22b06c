"""Byte-fallback correction of token strings (docs/design.md §5.2).

A token whose own string ends in U+FFFD is part of a character split over several
tokens (a byte piece `<0xE4>`, or a byte-level token holding half of a character). Its
string is recovered from the preceding *sampled* ids of the same request: decode
`context + [id]` with the shortest context (1..4 ids) that no longer ends in U+FFFD and
drop the text the context produced by itself. The ids at the end of the context that
alone end in U+FFFD (the trailing "dirty run") are the ones whose bytes the candidate
completes; their text belongs to the candidate, so only the context's clean prefix is
removed. If no context works the token is "" with no bytes: its bytes are reported by
the later token that completes the character, so each byte is reported exactly once.

Cache key. The result depends only on the ids holding the start of the context's
trailing *incomplete* character (found from the ids' raw bytes, vocab.raw_bytes):
windows that start after its lead byte begin with stray continuation bytes and still end
in U+FFFD, and windows reaching further back decode the completed characters before it
on their own (UTF-8 is self-synchronising), so they end in U+FFFD exactly when the
shortest complete window does. When the context ends on a character boundary there is
nothing to complete and every dirty candidate is "" without a lookup. Where raw bytes
are unknown the key is the context's trailing dirty run (ids that end in U+FFFD alone),
which is exact for the same reason. Either way the cache hits for any text that repeats
a character, whatever came before it. A dirty id that itself holds a lead or ASCII byte
(vocab.needs_context == 1) is "" in every context and needs no lookup at all. All of
this is property-tested against `correct_token` on the full 4-id context.
"""

from __future__ import annotations

from typing import Callable, Sequence

from workers.derender.vocab import REPLACEMENT, VocabTables

MAX_CONTEXT = 4  # a UTF-8 character has at most 4 bytes, so 3 earlier ids always suffice
_EMPTY: tuple[str, list[int]] = ("", [])


def correct_token(
    decode: Callable[[list[int]], str],
    dirty: Sequence[int],
    context: Sequence[int],
    token_id: int,
) -> str:
    """The corrected string of `token_id` after the sampled ids `context` (pure rule).

    `decode(ids)` decodes with special tokens kept; `dirty[id]` says whether an id's own
    string ends in U+FFFD. Shortest context first, as vLLM does.
    """
    n_max = min(MAX_CONTEXT, len(context))
    for n in range(1, n_max + 1):
        ctx = list(context[len(context) - n:])
        full = decode(ctx + [token_id])
        if full.endswith(REPLACEMENT):
            continue
        run = 0
        while run < n and dirty[ctx[n - 1 - run]]:
            run += 1
        clean = ctx[: n - run]
        prefix = decode(clean) if clean else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        # The clean prefix decoded differently inside the longer string (a tokenizer
        # whose decoder is not prefix-stable); a longer context cannot do better.
        return ""
    return ""


def context_key(hist: Sequence[int], dirty: Sequence[int], raw: Sequence[bytes | None]) -> tuple[int, ...]:
    """The part of the sampled ids `hist` a correction depends on (see the module doc)."""
    n = len(hist)
    j = n - 1
    stop = n - MAX_CONTEXT
    after = 0  # bytes of the ids after j
    while j >= 0 and j >= stop:
        tid = hist[j]
        if not dirty[tid]:
            return ()  # ends on a character boundary
        data = raw[tid]
        if data is None:
            return _dirty_run(hist, dirty)
        k = len(data) - 1
        while k >= 0 and 0x80 <= data[k] < 0xC0:
            k -= 1  # skip continuation bytes
        if k >= 0:
            lead = data[k]
            need = 2 if 0xC0 <= lead < 0xE0 else 3 if 0xE0 <= lead < 0xF0 else 4 if 0xF0 <= lead < 0xF8 else 0
            return tuple(hist[j:]) if len(data) - k + after < need else ()
        after += len(data)  # only continuation bytes: the lead is further back
        j -= 1
    return ()  # no lead byte within reach: nothing to complete


COMPLETE, INCOMPLETE, INVALID = 0, 1, 2


# Bytes a character needs, by its first byte (0: cannot start one), and the range its
# second byte must fall in where it is narrower than 80..BF (no overlongs, no surrogates,
# nothing past U+10FFFF) - Python's decoder applies the same rules.
_NEED = bytes(1 if b < 0x80 else 2 if 0xC2 <= b < 0xE0 else 3 if 0xE0 <= b < 0xF0 else 4 if 0xF0 <= b < 0xF5 else 0
              for b in range(256))
_SECOND = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def utf8_state(data: bytes) -> int:
    """COMPLETE (valid UTF-8), INCOMPLETE (valid, but the last character is cut short) or
    INVALID. The common case - one character being spelled byte by byte - is decided
    from tables; otherwise by Python's decoder (whose error says which case it is)."""
    n = len(data)
    if n and n < _NEED[data[0]]:
        if n >= 2:
            lo, hi = _SECOND.get(data[0], (0x80, 0xBF))
            if not lo <= data[1] <= hi or (n == 3 and not 0x80 <= data[2] < 0xC0):
                return INVALID
        return INCOMPLETE
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return INCOMPLETE if exc.reason == "unexpected end of data" else INVALID
    return COMPLETE


def _dirty_run(hist: Sequence[int], dirty: Sequence[int]) -> tuple[int, ...]:
    n = len(hist)
    run = 0
    while run < MAX_CONTEXT and run < n and dirty[hist[n - 1 - run]]:
        run += 1
    return tuple(hist[n - run:]) if run else ()


class Corrector:
    """`correct_token` with a bounded cache keyed by (context key, id).

    One Corrector can be shared by every request (and every partition) of a worker:
    the result depends only on the key. The cache is two-level, {key: {id: value}}: every
    candidate of a position shares its context key, so the shaping loops fetch the key's
    dict once per position (`entries`) and look each candidate up by id alone, with no
    (key, id) tuple built per candidate (profiled: that and the call per candidate were
    most of a CJK chunk's shaping time).
    """

    def __init__(self, tables: VocabTables, max_entries: int = 200_000):
        self.tables = tables
        self.max_entries = max_entries
        self._cache: dict[tuple[int, ...], dict[int, tuple[str, list[int]]]] = {}
        self._size = 0  # values held, over all keys
        tok = tables.tokenizer
        self._decode = lambda ids: tok.decode(ids, skip_special_tokens=False)
        self.hits = 0  # counted by get/lookup only (the shaping loops' hits go uncounted)
        self.misses = 0
        # Everything the shaping loops need, unpacked in one go per chunk.
        self.hot = (tables.token_str, tables.token_bytes, tables.dirty, tables.raw_bytes,
                    tables.needs_context, self.entries, self.fill)

    def get(self, key: tuple[int, ...], token_id: int) -> tuple[str, list[int]]:
        """(string, bytes) of a dirty `token_id` after a context whose key is `key`.

        Any key works (the rule is applied to it as the context); keys made by
        `context_key` should go through `lookup`, which skips re-checking them.
        """
        return self.lookup(key, token_id, trusted=False)

    def lookup(self, key: tuple[int, ...], token_id: int, trusted: bool = True) -> tuple[str, list[int]]:
        """`get` for a key made by `context_key`."""
        if not key:
            return _EMPTY  # nothing to complete: the character is cut short
        hit = self.entries(key).get(token_id)
        if hit is not None:
            self.hits += 1
            return hit
        return self.fill(key, token_id, trusted)

    def entries(self, key: tuple[int, ...]) -> dict[int, tuple[str, list[int]]]:
        """The cached values of a (non-empty) key, by id: the hot path's lookup. A miss
        in it goes to `fill(key, id)`, which computes the value and stores it there."""
        entries = self._cache.get(key)
        if entries is None:
            entries = self._cache[key] = {}
        return entries

    def fill(self, key: tuple[int, ...], token_id: int, trusted: bool = True) -> tuple[str, list[int]]:
        self.misses += 1
        text = None
        if trusted or context_key(key, self.tables.dirty, self.tables.raw_bytes) == key:
            text = self._from_bytes(key, token_id)
        if text is None:
            text = correct_token(self._decode, self.tables.dirty, key, token_id)
        value = (text, list(text.encode("utf-8"))) if text else _EMPTY
        if self._size >= self.max_entries:
            # Dropping everything is cheaper than LRU bookkeeping on every hit, and the
            # working set (recent contexts) refills within a few tokens. (A shaping
            # loop may still hold a dropped key's dict; it only reads from it.)
            self._cache.clear()
            self._size = 0
        self.entries(key)[token_id] = value
        self._size += 1
        return value

    def _from_bytes(self, key: tuple[int, ...], token_id: int) -> str | None:
        """The rule's result from raw bytes when they settle it, else None (ask the tokenizer).

        `key` must be minimal (start at the id holding the incomplete character's lead
        byte). Every id of `key + [id]` is dirty, so the clean prefix is empty and the
        result is the window's decode: valid UTF-8 decodes the same everywhere, and a
        window that is valid but ends inside a character is "" (longer windows cannot do
        better, shorter ones start with stray continuation bytes).
        """
        raw = self.tables.raw_bytes
        parts = [raw[t] for t in key]
        parts.append(raw[token_id])
        if None in parts:
            return None
        data = b"".join(parts)
        state = utf8_state(data)
        if state == COMPLETE:
            return data.decode("utf-8")
        return "" if state == INCOMPLETE else None

    def resolve(self, context: Sequence[int], token_id: int) -> tuple[str, list[int]]:
        """(string, bytes) of any id after the sampled ids `context`."""
        t = self.tables
        fix = t.needs_context[token_id]
        if not fix:
            return t.token_str[token_id], t.token_bytes[token_id]
        if fix == 1:
            return _EMPTY
        return self.lookup(context_key(context, t.dirty, t.raw_bytes), token_id)
