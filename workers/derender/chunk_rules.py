"""What a chunk must satisfy before it is rendered (docs/design.md §5.5, §8): pure.

A chunk comes from a topic anyone with write access can produce to; one that breaks a
rule ends its request with an error result instead of crashing the derender.
"""

from __future__ import annotations

from schemas.errors import ValidationError
from schemas.records import GenerateChunk
from schemas.validation import ANSWERABLE_ID_CHARS, MAX_REQUEST_ID_LENGTH, candidate_cap, validate_output


def prompt_problem(chunk: GenerateChunk, vocab_size: int) -> str | None:
    """Why seq 0's prompt fields cannot be rendered (echo, prompt_logprobs), or None:
    every id a prompt position names, the candidates' too, must index the vocabulary (one
    past it crashed the derender; a negative one picked a token from the end)."""
    echo, entries = chunk.prompt_token_ids, chunk.prompt_logprobs
    if echo is not None and entries is not None and len(entries) != len(echo):
        return f"prompt_logprobs has {len(entries)} entries for {len(echo)} prompt ids"
    for i, entry in enumerate(entries or ()):
        if entry is None:
            continue
        for e in (entry, *entry.top_logprobs):
            if not 0 <= e.token_id < vocab_size:
                return f"prompt_logprobs[{i}] holds id {e.token_id}, out of vocabulary (size {vocab_size})"
    return None


def unanswerable_id(chunk: GenerateChunk) -> str | None:
    """Why a chunk's request_id is too long to keep (as a finished request's, 100,000 of
    them) or answer, or None: no generate worker writes one, and the worker sends such a
    chunk to the DLQ (a replay skips it)."""
    if len(chunk.request_id) > ANSWERABLE_ID_CHARS:
        return f"request_id of {len(chunk.request_id)} characters: no generate worker writes one over " \
               f"{MAX_REQUEST_ID_LENGTH}"
    return None


def output_problem(chunk: GenerateChunk, max_logprobs: int) -> str | None:
    """Why seq 0's output options break the rules a request's do (docs/design.md §8), or
    None. Generate checks them on the request, but a chunk may come from elsewhere: its
    stop strings are searched for in every token's text, and 100,000 of them took ~7 ms
    a token, a whole long answer's worth in one call, with the worker's loop held. A final
    chunk without tokens is passed on as generate wrote it (nothing is matched in it): an
    error, often about these very options, or the abort of a request cancelled or past its
    deadline before its options were checked."""
    if chunk.output is None or chunk.finish_reason is not None and not chunk.token_ids:
        return None
    try:
        validate_output(chunk.output, max_logprobs=max_logprobs)
    except ValidationError as exc:
        return str(exc)
    return None


_UNCHECKED = object()


def check_chunk(chunk: GenerateChunk, vocab_size: int, max_logprobs: int, generated: int,
                checked_later: int = 0, kind: str = "chat", prompt: object = _UNCHECKED) -> str | None:
    """Why `chunk` breaks the rules, or None (pure; docs/design.md §5.5 "bad chunks").

    `max_logprobs` is the deployment's cap on what a client asks for; a position may hold
    `candidate_cap(kind, max_logprobs)` entries (a completion's k needs k+1).

    `checked_later`: the first n candidates of each position are range-checked by the
    chat shaping, which looks them up anyway; only the rest are checked here.

    `prompt`: `prompt_problem(chunk, vocab_size)` when the caller has it already (a loop
    over every prompt position's candidates: ~11 ms for 8,000 positions of 20).
    """
    ids = chunk.token_ids
    if chunk.token_offset != generated:
        return f"token_offset {chunk.token_offset} but {generated} tokens came before"
    for t in ids:
        if t >= vocab_size or t < 0:
            return f"token id {t} out of vocabulary (size {vocab_size})"
    tail = chunk.prompt_tail_ids
    # An error chunk is passed on as generate wrote it: its tail seeds nothing, and a bad
    # prompt id is often the very error it reports.
    if tail and chunk.finish_reason != "error" and (min(tail) < 0 or max(tail) >= vocab_size):
        return f"prompt_tail_ids hold an id out of vocabulary (size {vocab_size})"
    echo = chunk.prompt_token_ids
    if echo and chunk.finish_reason != "error" and (min(echo) < 0 or max(echo) >= vocab_size):
        return f"prompt_token_ids hold an id out of vocabulary (size {vocab_size})"
    problem = prompt_problem(chunk, vocab_size) if prompt is _UNCHECKED else prompt
    if problem is not None:
        return problem
    lp = chunk.logprobs
    if lp is None or lp.content is None:
        return None
    content = lp.content
    cap = candidate_cap(kind, max_logprobs)
    if len(content) != len(ids):
        return f"logprobs.content has {len(content)} entries for {len(ids)} token ids"
    for i, pos in enumerate(content):
        if pos.token_id != ids[i]:
            return f"logprobs.content[{i}].token_id {pos.token_id} is not the sampled id {ids[i]}"
        tops = pos.top_logprobs
        if len(tops) > cap:
            allows = f"{cap}, max_logprobs={max_logprobs} + the sampled token" if cap != max_logprobs \
                else f"max_logprobs={max_logprobs}"
            return f"position {i} has {len(tops)} top entries, more than a {kind} may hold ({allows})"
        if len(tops) > checked_later:
            for e in tops[checked_later:] if checked_later else tops:
                if e.token_id >= vocab_size or e.token_id < 0:
                    return f"top_logprobs id {e.token_id} at position {i} out of vocabulary (size {vocab_size})"
    return None
