"""Per-id tables computed once at start-up (docs/design.md §5.1).

The hot path of the derender never calls the tokenizer for a clean token: it looks up
the token's string, its UTF-8 bytes and whether it ends in U+FFFD in plain lists. The
tokenizer is only called for the rare ids that need context (byte pieces, partial
characters) and those results are cached by the caller (see correction.py).

Token strings: the text an id contributes on its own, with the leading space that a
Metaspace decoder strips at the start of a string restored (`▁true` -> " true"). We get
it by decoding `[anchor, id]` and removing the anchor's text: that works for every
decoder that only treats the *start* of the string specially (Metaspace, Strip) and for
byte-level decoders alike, without knowing which one the tokenizer uses.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Sequence

REPLACEMENT = "\ufffd"
_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
# Characters whose single token is a good anchor: plain ASCII letters and digits.
_ANCHOR_TEXTS = tuple("axeo0tnsri") + ("the", "a.")


class VocabTables:
    """Everything the derender needs to know about a vocabulary, as plain lists.

    Attributes (index = token id):
      token_str   str the id contributes on its own (special tokens by their content)
      token_bytes UTF-8 of token_str, as a list of ints (shared; never mutate)
      dirty       1 when token_str ends in U+FFFD (needs context, docs/design.md §5.2)
      needs_context  0 clean, 1 dirty but never completed by context, 2 look it up
      special     1 for special (added) tokens, which skip_special_tokens removes
      alone_skip / alone_keep   decode([id]) as a string with the given skip flag, i.e.
                  with the start-of-string rules applied (the detokenizer's prefixes)
      raw_bytes   the bytes the id puts into the decoded byte stream (a byte piece's one
                  byte, a byte-level token's bytes), or None where unknown; lets the
                  detokenizer complete split characters without calling the tokenizer
    """

    def __init__(self, tokenizer, *, name: str = ""):
        self.tokenizer = tokenizer  # a `tokenizers.Tokenizer`; only slow paths use it
        self.name = name
        self.size = tokenizer.get_vocab_size(with_added_tokens=True)
        ids = range(self.size)
        specials = {i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
        self.special = bytearray(1 if i in specials else 0 for i in ids)

        anchor = find_anchor(tokenizer)
        keep = tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
        skip = tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=True)
        self.alone_keep: list[str] = keep
        self.alone_skip: list[str] = skip
        if anchor is None:
            strings = list(keep)
        else:
            anchor_text = tokenizer.decode([anchor], skip_special_tokens=False)
            with_anchor = tokenizer.decode_batch([[anchor, i] for i in ids], skip_special_tokens=False)
            strings = [
                s[len(anchor_text):] if s.startswith(anchor_text) else alone
                for s, alone in zip(with_anchor, keep)
            ]
        self.token_str: list[str] = strings
        self.token_bytes: list[list[int]] = [list(s.encode("utf-8")) for s in strings]
        self.dirty = bytearray(1 if s.endswith(REPLACEMENT) else 0 for s in strings)
        self.raw_bytes: list[bytes | None] = raw_bytes_table(tokenizer, strings, self.special)
        # 2 = a dirty id that context may complete: its raw bytes are all continuation
        # bytes (or unknown). A dirty id holding a lead or ASCII byte decodes the same
        # from that byte on whatever precedes it (UTF-8 resynchronises there), so its
        # string stays cut short in every context: "" without a lookup (correction.py).
        self.needs_context = bytearray(
            (2 if raw is None or all(0x80 <= b < 0xC0 for b in raw) else 1) if d else 0
            for d, raw in zip(self.dirty, self.raw_bytes))
        # What an id adds to the *text* after a clean context, per skip_special_tokens:
        # the token string, or "" for a special token that is skipped.
        self.text_keep: list[str] = strings
        self.text_skip: list[str] = [
            "" if self.special[i] else s for i, s in enumerate(strings)
        ]

    # --- slow-path helpers ---------------------------------------------------------
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def in_vocab(self, token_id: int) -> bool:
        return 0 <= token_id < self.size

    def __repr__(self) -> str:
        return f"VocabTables({self.name or 'tokenizer'}, size={self.size})"


def decoder_types(tokenizer) -> set[str]:
    """The `type`s of the tokenizer's decoder, looking inside Sequence decoders."""
    try:
        spec = json.loads(tokenizer.to_str()).get("decoder") or {}
    except ValueError:
        return set()
    found: set[str] = set()
    stack = [spec]
    while stack:
        d = stack.pop()
        if isinstance(d, dict):
            found.add(d.get("type", ""))
            stack.extend(d.get("decoders") or [])
    return found


def raw_bytes_table(tokenizer, strings: list[str], special: bytearray) -> list[bytes | None]:
    """Per id, the raw bytes it contributes, checked against the id's own decode.

    Byte-fallback pieces `<0xNN>` give one byte, byte-level tokens map back through the
    GPT-2 byte alphabet; other ids give the UTF-8 of their string. An id whose bytes do
    not decode (with U+FFFD for broken bytes) to its own string gets None, so the
    detokenizer falls back to the tokenizer for it.
    """
    types = decoder_types(tokenizer)
    byte_fallback = "ByteFallback" in types
    byte_level = "ByteLevel" in types
    inverse = {c: b for b, c in _gpt2_byte_chars().items()} if byte_level else {}
    table: list[bytes | None] = []
    for i, s in enumerate(strings):
        raw: bytes | None
        if special[i]:
            raw = None  # handled by skip_special_tokens / breaks byte runs: slow path
        else:
            piece = tokenizer.id_to_token(i) or ""
            if byte_fallback and _BYTE_PIECE.match(piece):
                raw = bytes([int(piece[3:5], 16)])
            elif byte_level:
                try:
                    raw = bytes(inverse[c] for c in piece)
                except KeyError:
                    raw = None
            else:
                raw = s.encode("utf-8")
        if raw is not None and raw.decode("utf-8", "replace") != s:
            raw = None
        table.append(raw)
    return table


def _gpt2_byte_chars() -> dict[int, str]:
    # GPT-2's byte -> printable character map, which byte-level vocabularies are spelled in.
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def find_anchor(tokenizer) -> int | None:
    """A non-special id whose text is clean, non-empty and simply concatenates.

    `decode([a, a]) == decode([a]) * 2` rules out anchors the start-of-string rules
    change (a Metaspace `▁x` would lose its space only the first time) and byte pieces
    (which could join a following byte run, so must not be anchors either).
    """
    specials = {i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
    for text in _ANCHOR_TEXTS:
        tid = tokenizer.token_to_id(text)
        if tid is None or tid in specials:
            continue
        piece = tokenizer.id_to_token(tid) or ""
        if _BYTE_PIECE.match(piece):
            continue
        one = tokenizer.decode([tid], skip_special_tokens=False)
        if one and REPLACEMENT not in one and tokenizer.decode([tid, tid], skip_special_tokens=False) == one * 2:
            return tid
    return None


def load_tokenizer(path: str | os.PathLike):
    """A `tokenizers.Tokenizer` from a model directory (or a tokenizer.json file).

    Reads `tokenizer.json` directly: it is what AutoTokenizer's fast tokenizers wrap, and
    avoids importing transformers. Falls back to AutoTokenizer for directories with only
    a slow tokenizer that transformers can convert.
    """
    from tokenizers import Tokenizer

    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if file.is_file():
        return Tokenizer.from_file(str(file))
    if not p.exists():
        raise FileNotFoundError(f"tokenizer directory {p} does not exist")
    from transformers import AutoTokenizer  # heavy; only for unusual directories

    hf = AutoTokenizer.from_pretrained(str(p))
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{p}: only fast (tokenizers-backed) tokenizers are supported")
    return backend


def load_tables(path: str | os.PathLike) -> VocabTables:
    return VocabTables(load_tokenizer(path), name=str(path))

