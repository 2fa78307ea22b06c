"""One HTTP request, several genpipe requests: `n` > 1 and several prompts.

OpenAI's rule: choice `index` = prompt index × n + sample index, every choice under the
HTTP request's one `id`; usage counts each prompt's tokens once and every choice's
completion tokens. Each genpipe request answers with its own id and index 0; these
functions put its records in the HTTP response's place (pure), and `choice_records`
reads the records of a request's choices as one series.
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec

from schemas.openai import UsageInfo
from workers.mailbox import KEEPALIVE

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


def choice_records(client, choices: list, keepalive_s: float):
    """The records of a request's choices as (index, record) (`GenpipeClient.records`,
    with its KEEPALIVE marks), until every choice's final one."""
    return _one(client, choices[0], keepalive_s) if len(choices) == 1 else _merged(client, choices, keepalive_s)


async def _one(client, choice, keepalive_s: float):
    """A single choice's records as (0, record): straight from the client's inbox, no
    task or queue between (the common case, on every token)."""
    async with contextlib.aclosing(client.records(choice, keepalive_s=keepalive_s)) as records:
        async for record in records:
            yield 0, record


async def _merged(client, choices: list, keepalive_s: float):
    """Several choices' records as (index, record), interleaved as they come: a reader
    task per choice, one bounded queue (a slow HTTP reader slows the readers)."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=256)

    async def read(index: int, choice) -> None:
        try:
            async with contextlib.aclosing(client.records(choice, keepalive_s=keepalive_s)) as records:
                async for record in records:
                    await queue.put((index, record))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            await queue.put((index, exc))

    readers = [asyncio.ensure_future(read(i, c)) for i, c in enumerate(choices)]
    try:
        open_choices = len(choices)
        while open_choices:
            index, record = await queue.get()
            if isinstance(record, BaseException):
                raise record
            if record is not KEEPALIVE and record.final:
                open_choices -= 1
            yield index, record
    finally:
        for reader in readers:
            reader.cancel()
