"""One HTTP request, several genpipe requests: `n` > 1 and several prompts (pure).

OpenAI's rule: choice `index` = prompt index × n + sample index, every choice under the
HTTP request's one `id`; usage counts each prompt's tokens once and every choice's
completion tokens. Each genpipe request answers with its own id and index 0; these
functions put its records in the HTTP response's place.
"""

from __future__ import annotations

import msgspec

from schemas.openai import UsageInfo

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
