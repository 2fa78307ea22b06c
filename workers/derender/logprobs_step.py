"""The logprobs step of rendering a chunk (docs/design.md §5.4): the kept positions'
logprobs in the request's OpenAI shape. Split from state.py, whose other steps (text,
shaping the result) read and advance the same RequestState."""

from __future__ import annotations

from schemas.openai import CompletionLogProbs
from schemas.records import GenerateChunk
from workers.derender import shaping
from workers.derender.correction import Corrector


class BadChunk(Exception):
    """A chunk breaks the rules in a way only found while rendering it."""


def chunk_logprobs(req, chunk: GenerateChunk, n_keep: int, corrector: Corrector):
    """The kept positions' logprobs in the request's OpenAI shape: chat entries (or
    None), or completion logprobs (or None; the request's running object when not
    streamed). Advances the correction context and the token count either way. Raises
    BadChunk for a chat candidate id outside the vocabulary (chat range-checks the
    first k candidates here, where it looks them up anyway; check_chunk the rest)."""
    size = corrector.tables.size
    ids = chunk.token_ids
    kept = ids if n_keep == len(ids) else ids[:n_keep]
    content = chunk.logprobs.content if chunk.logprobs is not None else None
    if content is not None:
        req.has_lp = True
        if n_keep != len(content):
            content = content[:n_keep]
    hist = req.hist
    req.generated += n_keep
    result = None
    if req.chat and content is not None:
        try:
            result = shaping.chat_logprobs(kept, content, req.k, corrector, hist)
        except IndexError:  # a candidate id past the vocabulary (checked here, once)
            bad = next(e.token_id for pos in content for e in pos.top_logprobs
                       if not 0 <= e.token_id < size)
            raise BadChunk(f"top_logprobs id {bad} out of vocabulary (size {size})") from None
    elif not req.chat and (content is not None or req.has_lp):
        result = req.comp_lp if not req.stream else (req.echo_lp or CompletionLogProbs())
        req.echo_lp = None
        req.offset = shaping.completion_logprobs(kept, content, req.k, corrector, hist, result, req.offset)
    else:
        hist.extend(kept)
    if len(hist) > 64:
        del hist[:-shaping.CTX]
    return result
