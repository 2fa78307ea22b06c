"""Helpers shared by the tests/test_derender_*.py files (not collected by pytest)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from schemas.codec import JSON, encode
from schemas.openai import ChatCompletion, ChatCompletionChunk, Completion, ErrorResponse
from schemas.records import (GenerateChunk, GenerateLogProb, GenerateLogProbs, GenerateLogProbsContent,
                             OutputOptions)
from workers.derender.state import CancelRequest, Result

FFFD = "\ufffd"


def build_tokenizer_dir(kind: str, root: Path) -> Path:
    """The tiny model's tokenizer (identical to the one build_tiny_model writes), alone.

    Training the tiny model's weights takes a minute; the derender needs only the
    tokenizer, which `build_tokenizer` makes deterministically in a fraction of a second.
    """
    from workers.models.tinymodel import build_tokenizer

    out = root / f"tiny-{kind}"
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(kind).save(str(out / "tokenizer.json"))
    return out


def position(sampled: int, top_ids: list[int], n: int | None = None, *,
             logprobs: list[float] | None = None, sampled_logprob: float = -30.0) -> GenerateLogProbsContent:
    """A candidate list as generate writes it: sampled first, then rank order, once each.

    `top_ids` are the vocabulary's best ids in rank order (rank 1, 2, ...). `n` cuts the
    list to max(n, 1) entries (default: all).
    """
    lps = logprobs or [-0.25 * (i + 1) for i in range(len(top_ids))]
    if sampled in top_ids:
        s_rank = top_ids.index(sampled) + 1
        s_lp = lps[s_rank - 1]
    else:
        s_rank, s_lp = len(top_ids) + 7, sampled_logprob
    entries = [GenerateLogProb(token_id=sampled, logprob=s_lp, rank=s_rank)]
    entries += [GenerateLogProb(token_id=t, logprob=lps[i], rank=i + 1)
                for i, t in enumerate(top_ids) if t != sampled]
    if n is not None:
        entries = entries[: max(n, 1)]
    return GenerateLogProbsContent(token_id=sampled, logprob=s_lp, rank=s_rank, top_logprobs=entries)


def make_chunks(request_id: str, ids: list[int], sizes: list[int] | None = None, *,
                output: OutputOptions | None = None, attempt: str = "a1",
                positions: list[GenerateLogProbsContent | None] | None = None,
                prompt_tail: list[int] | None = None, prompt_count: int = 5,
                finish_reason: str | None = "length", stop_token_id: int | None = None,
                sampled_at_ns: int = 1_700_000_000_123_456_789,
                reply_topic: str | None = None) -> list[GenerateChunk]:
    """Split `ids` into chunks of `sizes` (default one token each); the last one finishes.

    `positions`: per-token logprobs (None entries make that chunk's logprobs None when
    the whole chunk lacks them); default: no logprobs.
    """
    sizes = list(sizes or [1] * len(ids))
    assert sum(sizes) == len(ids), (sizes, len(ids))
    chunks, start = [], 0
    for seq, size in enumerate(sizes):
        part = ids[start:start + size]
        lp = None
        if positions is not None:
            pos = positions[start:start + size]
            if all(p is not None for p in pos):
                lp = GenerateLogProbs(content=list(pos))
        last = seq == len(sizes) - 1
        chunk = GenerateChunk(
            request_id=request_id, attempt=attempt, seq=seq, token_offset=start, token_ids=part,
            logprobs=lp, finish_reason=finish_reason if last else None,
            stop_token_id=stop_token_id if last else None,
            sampled_at_ns=sampled_at_ns + seq)
        if seq == 0:
            chunk.prompt_token_count = prompt_count
            chunk.prompt_tail_ids = prompt_tail
            chunk.output = output or OutputOptions()
            chunk.reply_topic = reply_topic
        chunks.append(chunk)
        start += size
    return chunks


def run_chunks(derenderer, chunks) -> list:
    out = []
    for chunk in chunks:
        out.extend(derenderer.process(chunk))
    return out


def results(outputs) -> list[Result]:
    return [o for o in outputs if isinstance(o, Result)]


def cancels(outputs) -> list[CancelRequest]:
    return [o for o in outputs if isinstance(o, CancelRequest)]


def streamed_text(outputs) -> str:
    """Concatenated text of a request's results (chat deltas or completion texts)."""
    parts = []
    for r in results(outputs):
        v = r.value
        choice = v.choices[0]
        if isinstance(v, ChatCompletionChunk):
            parts.append(choice.delta.content or "")
        elif isinstance(v, ChatCompletion):
            parts.append(choice.message.content or "")
        else:
            parts.append(choice.text)
    return "".join(parts)


# --- validation against the official openai package ---------------------------------

def openai_validate(value) -> None:
    """Validate one result against the `openai` package's own types.

    Every record is validated strictly; only these deviations, all deliberate, are
    tolerated (anything else - fields, types, logprob shapes, usage - must pass):

    * `finish_reason: null` on a streamed `text_completion`. OpenAI's `Completion` type
      declares it a non-optional Literal, yet the API itself streams null on every chunk
      but the last (the client builds stream objects without validation).
    * `finish_reason` "abort" / "error": vLLM's extensions, outside OpenAI's Literal.
    * `null` entries in a completion's `token_logprobs` / `top_logprobs` for positions
      whose chunk had no logprobs (docs/design.md §5.4, as vLLM does); OpenAI's lists allow none.
    """
    import openai.types as ot
    import openai.types.chat as oc
    from pydantic import ValidationError

    data = json.loads(encode(value, JSON))
    if isinstance(value, ErrorResponse):
        assert set(data) == {"error"} and isinstance(data["error"]["message"], str)
        assert set(data["error"]) == {"message", "type", "param", "code"}
        return
    model = {ChatCompletionChunk: oc.ChatCompletionChunk, ChatCompletion: oc.ChatCompletion,
             Completion: ot.Completion}[type(value)]
    try:
        model.model_validate(data)
    except ValidationError as exc:
        fr = data["choices"][0].get("finish_reason")
        for err in exc.errors():
            loc = err["loc"]
            if loc == ("choices", 0, "finish_reason"):
                assert fr in ("abort", "error") or (fr is None and isinstance(value, Completion)), err
            elif loc[:3] == ("choices", 0, "logprobs") and len(loc) == 5 and loc[3] in (
                    "token_logprobs", "top_logprobs"):
                assert isinstance(value, Completion) and err["input"] is None, err
            else:
                raise


def roundtrip(value):
    """Encode as JSON and decode back into our own result type (catches shape drift)."""
    return msgspec.json.decode(encode(value, JSON), type=type(value))


# --- tokenizers, built once per test session ----------------------------------------

_TABLES: dict = {}
_ROOT: list[Path] = []


def tokenizer_dir(kind: str) -> Path:
    """A directory holding the tiny `kind` tokenizer (built once per process)."""
    import tempfile

    if not _ROOT:
        _ROOT.append(Path(tempfile.mkdtemp(prefix="genpipe-derender-tests-")))
    path = _ROOT[0] / f"tiny-{kind}"
    if not (path / "tokenizer.json").exists():
        build_tokenizer_dir(kind, _ROOT[0])
    return path


def tables_for(kind: str):
    from workers.derender.vocab import load_tables

    if kind not in _TABLES:
        _TABLES[kind] = load_tables(tokenizer_dir(kind))
    return _TABLES[kind]


def tid(tables, piece: str) -> int:
    """The id of a vocabulary piece, e.g. '<0xE4>', '▁true', 'Ġtrue'."""
    value = tables.tokenizer.token_to_id(piece)
    assert value is not None, f"{piece!r} not in vocabulary"
    return value


def encode_ids(tables, text: str) -> list[int]:
    return tables.tokenizer.encode(text, add_special_tokens=False).ids


def byte_ids(tables, text: str) -> list[int]:
    """spm byte pieces spelling `text`'s UTF-8."""
    return [tid(tables, f"<0x{b:02X}>") for b in text.encode("utf-8")]


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte -> printable character map (what byte-level vocabularies are made of).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_CHAR = _bytes_to_unicode()


def raw_byte_ids(tables, data: bytes) -> list[int]:
    """One token per byte: `<0xNN>` pieces (spm) or single byte-level characters."""
    vocab = tables.tokenizer
    if vocab.token_to_id("<0x41>") is not None:
        return [tid(tables, f"<0x{b:02X}>") for b in data]
    return [tid(tables, BYTE_CHAR[b]) for b in data]
