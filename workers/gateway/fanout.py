"""One HTTP request, several genpipe requests: `n` > 1 and several prompts (pure).

OpenAI's rule: choice `index` = prompt index × n + sample index, every choice under the
HTTP request's one `id`; usage counts each prompt's tokens once and every choice's
completion tokens. Each genpipe request answers with its own id and index 0; these
functions put its records in the HTTP response's place.

A choice not streamed whose answer may not fit one result record (its logprobs: at top
20, a chat's pass Kafka's ~1 MB at several hundred tokens) is asked for streamed and its
records assembled into the one answer (`answer_may_outgrow`, `streamed_inside`; the
gateway bounds its time and size as the one record's): the derender ended such a
request with a 400 telling the caller to stream (docs/design.md §9).
"""

from __future__ import annotations

import msgspec

from schemas.openai import UsageInfo
from schemas.records import GenerateRequest

# Guesses of what a position of an answer takes in its result, as JSON (bytes), by kind:
# the position itself (a completion's token, logprob and text offset; a chat's text) and
# each candidate listed (the token's own, and its top k): a completion's `"token":
# logprob` entry, a chat's object with the token's bytes. Measured: 79-163 bytes a
# position for a completion at top 5, 434 for a chat (BENCHMARKS.md, "Answers too large
# for a record"); the guesses are 1.8-4.5x those, not a bound (a chat's long tokens pass
# them: a token of 32 spaces takes ~185 bytes a candidate). An answer switched that would
# have fit costs its gateway ~6x the CPU (a record a chunk, not one), its derender ~1.75x.
ANSWER_BYTES = {"completion": (64, 48), "chat": (16, 128)}  # (a position, a listed candidate)


def answer_may_outgrow(request: GenerateRequest, limit: int) -> bool:
    """Whether `request`'s answer in one record might pass `limit` bytes, by its
    `max_tokens`. Only one with logprobs can: text alone takes ~4-16 bytes a token (1 MB
    is ~100k tokens), and streaming every answer inside would cost a result record per
    chunk, not one. Nor one without `max_tokens` (a chat's default: to the end of the
    context): guessed to the end of a long context, every such chat with logprobs would be
    switched, most of them short; it comes in one record, as before."""
    tokens = request.sampling.max_tokens
    if request.sampling.logprobs is None or tokens is None:
        return False
    if request.output.echo:  # (the prompt's tokens, with their logprobs, in front)
        tokens += len(request.prompt_token_ids)
    position, candidate = ANSWER_BYTES[request.output.kind]
    return tokens * (position + (1 + max(0, request.output.top_logprobs)) * candidate) > limit


def streamed_inside(request: GenerateRequest) -> GenerateRequest:
    """`request` asked for streamed, with its usage at the end, for an answer assembled
    from its records (`workers/results.py` `assemble`). Not for one with prompt logprobs:
    streamed results have no such field."""
    output = msgspec.structs.replace(request.output, stream=True, include_usage=True, continuous_usage=False)
    return msgspec.structs.replace(request, output=output)


def reindex(item, index: int, response_id: str):
    """A result object (final or streamed chunk) as choice `index` of `response_id`."""
    return msgspec.structs.replace(item, id=response_id, choices=[
        msgspec.structs.replace(choice, index=index) for choice in item.choices])


def total_usage(usages: list[UsageInfo | None], prompt_of: list[int]) -> UsageInfo | None:
    """`usages[i]` of choice i, whose prompt is `prompt_of[i]`; None if any is missing."""
    if any(u is None for u in usages):
        return None
    prompt_tokens = {}
    for usage, prompt in zip(usages, prompt_of):
        prompt_tokens[prompt] = usage.prompt_tokens
    prompt = sum(prompt_tokens.values())
    completion = sum(u.completion_tokens for u in usages)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def merge_final(results: list, prompt_of: list[int]):
    """The final objects of every choice as one response (choices in index order)."""
    first = results[0]
    choices = [msgspec.structs.replace(choice, index=i) for i, result in enumerate(results) for choice in result.choices]
    return msgspec.structs.replace(first, choices=choices,
                                   usage=total_usage([r.usage for r in results], prompt_of))
