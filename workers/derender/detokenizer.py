"""Incremental text of one request, and stop strings (docs/design.md §5.3).

`Detokenizer` works like `tokenizers.decoders.DecodeStream` (keep the ids of the last
emitted piece as a prefix, decode prefix + pending ids, emit what the prefix did not
produce) with two changes:

* Fast paths. A clean id (its own string does not end in U+FFFD) that follows a complete
  piece adds exactly its table string. The ids of a split character are collected as
  raw bytes (vocab.raw_bytes) and emitted as soon as the bytes are valid UTF-8, which is
  what the tokenizer decodes them to. So valid text never calls the tokenizer; only
  broken bytes and the very first id when there is no prompt tail go to it.
* The "Invalid prefix" trap is handled in place. `tokenizers`' ByteFallback decoder
  turns a whole *run* of byte pieces into U+FFFDs once the run is not valid UTF-8, so a
  character already emitted can vanish from a longer decode (DecodeStream raises
  "Invalid prefix encountered" there). We then restart without the context, as vLLM
  does, but keep the pending ids: their bytes come out as replacement characters
  instead of being lost, and the stream never errors.

Incomplete characters are held back (never emitted as U+FFFD while more bytes may come).
A held character that the next bytes show can never complete is settled at once (as the
tokenizer shows it) and the new bytes start afresh, so one stray byte costs one U+FFFD
and never swallows the text after it. `flush()` at the end of the request emits
whatever is left, which is exactly what the full decode shows there.

Guarantee (property-tested against `tokenizer.decode` for both tiny tokenizers): the
concatenated text equals the full decode of the output (after the prompt tail) whenever
that decode has no U+FFFD, and otherwise never holds more U+FFFDs than it.
"""

from __future__ import annotations

from typing import Sequence

from workers.derender.correction import COMPLETE, INCOMPLETE, context_key, utf8_state
from workers.derender.vocab import REPLACEMENT, VocabTables

# No UTF-8 character spans more than 4 byte pieces. More pending ids that still decode to
# a trailing U+FFFD are broken for good (only reachable through ids whose raw bytes are
# unknown or broken on their own); emit them rather than re-decode an ever longer window.
MAX_PENDING = 8


class Detokenizer:
    __slots__ = ("_tables", "_skip", "_text", "_alone", "_dirty", "_raw", "_ctx", "_ctx_text",
                 "_pending", "_bytes", "_decode", "_prompt_held")

    def __init__(self, tables: VocabTables, *, skip_special_tokens: bool = True,
                 prompt_tail: Sequence[int] | None = None):
        self._tables = tables
        self._skip = skip_special_tokens
        self._text = tables.text_skip if skip_special_tokens else tables.text_keep
        self._alone = tables.alone_skip if skip_special_tokens else tables.alone_keep
        self._dirty = tables.dirty
        self._raw = tables.raw_bytes
        tok = tables.tokenizer
        self._decode = lambda ids: tok.decode(ids, skip_special_tokens=skip_special_tokens)
        self._ctx: list[int] = []  # ids of the last emitted piece (the prefix)
        self._ctx_text: str | None = ""  # decode(_ctx), computed lazily
        self._pending: list[int] = []  # ids not yet emitted (an incomplete character)
        self._bytes: bytes | None = b""  # their raw bytes; None once one is unknown
        self._prompt_held = 0  # leading pending ids that are the prompt's (an incomplete character)
        if prompt_tail:
            # Seed with the prompt tail so the first token's Metaspace space survives and
            # a character split between prompt and output completes; the text is dropped.
            self.feed(prompt_tail)
            # A prompt that ends inside a character keeps it: if the output does not
            # complete it, its U+FFFD is the prompt's and never starts the answer
            # (vLLM's rule: the seeded prefix decodes to the same U+FFFD).
            self._prompt_held = len(self._pending)

    def feed(self, ids: Sequence[int]) -> str:
        """The new text produced by `ids` (may be "" while a character is incomplete)."""
        text = self._text
        dirty = self._dirty
        special = self._tables.special
        skip = self._skip
        out: list[str] = []
        last = -1
        for tid in ids:
            if skip and special[tid]:
                continue  # removed before decoding, so invisible to byte runs as well
            if not dirty[tid] and not self._pending and (last >= 0 or self._ctx):
                out.append(text[tid])
                last = tid
                continue
            if last >= 0:
                self._ctx = [last]
                self._ctx_text = None
                last = -1
            piece = self._step_slow(tid)
            if piece:
                out.append(piece)
        if last >= 0:
            self._ctx = [last]
            self._ctx_text = None
        return "".join(out)

    def step(self, tid: int) -> str:
        return self.feed((tid,))

    def flush(self) -> str:
        """Everything still held back (the request is over): U+FFFD for broken bytes."""
        if not self._pending:
            return ""
        return self._emit(self._decode(self._ctx + self._pending))

    @property
    def holding(self) -> bool:
        return bool(self._pending)

    # --- split characters ------------------------------------------------------------
    def _step_slow(self, tid: int) -> str:
        held = self._bytes
        raw = self._raw[tid]
        if held is not None and raw is not None and self._ctx:
            data = held + raw
            state = utf8_state(data)
            if state == COMPLETE:
                self._pending.append(tid)
                self._done()
                return data.decode("utf-8")
            if state == INCOMPLETE:
                self._pending.append(tid)
                self._bytes = data  # a character still being spelled: hold it back
                return ""
            if held and _first_error(data) == 0:
                # The held character can no longer complete: settle it (U+FFFD, as the
                # tokenizer shows it), then treat this id as the start of a new one.
                text = self._emit(self._decode(self._ctx + self._pending))
                return text + self._step_slow(tid)
            # The held character completed but stray bytes follow, or this id is broken
            # on its own: the tokenizer decides what they show as.
        self._pending.append(tid)
        self._bytes = None
        pending = self._pending
        full = self._decode(self._ctx + pending)
        if full.endswith(REPLACEMENT):
            if len(pending) < MAX_PENDING:
                return ""  # maybe an incomplete character: hold it back
            # Too long to be one character: emit all but a trailing incomplete character.
            keep = len(context_key(pending, self._dirty, self._raw))
            if 0 < keep < len(pending):
                tail = pending[-keep:]
                self._pending = pending[:-keep]
                text = self._emit(self._decode(self._ctx + self._pending))
                self._pending, self._bytes = tail, None
                return text
        return self._emit(full)

    def _emit(self, full: str) -> str:
        prefix = self._prefix()
        if self._prompt_held:
            prefix = self._decode(self._ctx + self._pending[:self._prompt_held])
        if full.startswith(prefix):
            new = full[len(prefix):]
        else:
            # The trap: the context's text changed inside the longer decode. Restart from
            # the pending ids alone; their broken bytes show as U+FFFD.
            new = self._decode(self._pending)
        self._done()
        return new

    def _done(self) -> None:
        self._ctx = self._pending
        self._ctx_text = None
        self._pending = []
        self._bytes = b""
        self._prompt_held = 0

    def _prefix(self) -> str:
        if self._ctx_text is None:
            ctx = self._ctx
            self._ctx_text = self._alone[ctx[0]] if len(ctx) == 1 else self._decode(ctx)
        return self._ctx_text


def _first_error(data: bytes) -> int:
    """Where the first invalid sequence of (invalid) `data` starts."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start
    return len(data)


class StopMatcher:
    """Stop strings over streamed text, holding back what could start a match.

    Holds back `len(longest stop) - 1` characters until the request finishes. The
    earliest match wins (then the first listed); the text is cut before it, or after it
    with include_stop_str_in_output.
    """

    __slots__ = ("stops", "include", "hold", "_buf")

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self._buf = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text that is safe to emit, whether a stop string matched)."""
        if not text:
            return "", False
        buf = self._buf + text
        # Every earlier window was already searched, so a match must use new text.
        best = -1
        best_stop = ""
        for stop in self.stops:
            i = buf.find(stop)
            if i >= 0 and (best < 0 or i < best):
                best, best_stop = i, stop
        if best >= 0:
            self._buf = ""
            return buf[: best + len(best_stop) if self.include else best], True
        keep = min(self.hold, len(buf))
        self._buf = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        buf, self._buf = self._buf, ""
        return buf
