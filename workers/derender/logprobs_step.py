"""The logprobs step of rendering a chunk (docs/design.md §5.4, §5.5): the kept
positions' logprobs in the request's OpenAI shape, and the candidate ids' range check
folded into it.

Candidate ids are range-checked where the shaping looks them up anyway, not in a pass of
their own over every candidate (`chunk_rules.check_chunk` with `checked_later`): at k = 5
that separate pass cost a completion chunk about a third of its shaping time (profiled).
Chat checks the first k candidates there, completion all of them. When the shaping finds
a bad id, a completion chunk is checked again in full, so its error is word for word the
one `check_chunk` gives (the record the old order wrote); chat keeps its own message.
"""

from __future__ import annotations

from schemas.openai import CompletionLogProbs
from schemas.records import GenerateChunk
from workers.derender import shaping
from workers.derender.chunk_rules import check_chunk
from workers.derender.correction import Corrector

ALL = 1 << 30  # check_chunk's `checked_later`: the shaping checks every candidate


class BadChunk(Exception):
    """A chunk breaks the rules in a way only found while rendering it."""


def checked_by_shaping(chat: bool, k: int, finish_reason: str | None) -> int:
    """How many candidates of each position the shaping range-checks (the rest are
    check_chunk's): chat looks up the first k, completion every one. An error chunk is
    never shaped: check_chunk checks what it always did."""
    return k if chat else 0 if finish_reason == "error" else ALL


def chunk_logprobs(req, chunk: GenerateChunk, n_keep: int, corrector: Corrector, max_logprobs: int):
    """The kept positions' logprobs in the request's OpenAI shape: chat entries (or
    None), or completion logprobs (or None; the request's running object when not
    streamed). Advances the correction context and the token count either way. Raises
    BadChunk for a candidate id outside the vocabulary (before advancing anything the
    request would keep: a bad chunk ends its request)."""
    size = corrector.tables.size
    ids = chunk.token_ids
    kept = ids if n_keep == len(ids) else ids[:n_keep]
    content = chunk.logprobs.content if chunk.logprobs is not None else None
    generated = req.generated
    if content is not None:
        req.has_lp = True
        if n_keep != len(content):
            if not req.chat:  # the positions a stop string cut off are not looked up: check them here
                problem = check_chunk(chunk, size, max_logprobs, generated)
                if problem is not None:
                    raise BadChunk(problem)
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
        try:
            req.offset = shaping.completion_logprobs(kept, content, req.k, corrector, hist, result, req.offset,
                                                     checked=True)
        except IndexError:
            raise BadChunk(check_chunk(chunk, size, max_logprobs, generated)) from None
    else:
        hist.extend(kept)
    if len(hist) > 64:
        del hist[:-shaping.CTX]
    return result
