"""OpenAI-shaped results from sampled ids and integer logprobs (docs/design.md §5.4).

Pure functions: they take the positions of one chunk (already validated, see state.py)
and the request's running values, and build the result Structs directly (no dicts in
between, no tokenizer calls for clean tokens).

Candidate lists arrive as generate writes them: the sampled token first, then the top
tokens in rank order, the sampled id once.

* Chat, k = top_logprobs: the first k entries of that list (k = 0 gives []).
* Completion, k = logprobs: a dict with the sampled token, then every entry of rank <= k,
  keyed by token string in that order. Equal strings collapse the way a dict does: the
  key keeps its first place and the later value wins (vLLM builds the same dict).
* `text_offset` counts Python code points and advances by each token string's length,
  carried across chunks so streamed and final offsets agree.

Token strings of dirty ids (partial characters) are corrected against the preceding
sampled ids `hist` (the last 4), the same context for every candidate of a position.
"""

from __future__ import annotations

from typing import Sequence

import msgspec

from schemas.openai import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionStreamChoice,
    ChatMessage,
    Completion,
    CompletionChoice,
    CompletionLogProbs,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    PromptLogprob,
    PromptLogprobs,
    UsageInfo,
)
from schemas.records import GenerateLogProbsContent
from workers.derender.correction import Corrector, context_key

CTX = 4  # correction context: the last 4 sampled ids
_EMPTY = ("", [])  # a dirty token with nothing to complete (shared; never mutated)


def chat_logprobs(
    token_ids: Sequence[int],
    content: Sequence[GenerateLogProbsContent] | None,
    k: int,
    corrector: Corrector,
    hist: list[int],
) -> list[ChatCompletionLogProbsContent]:
    """Chat logprob entries for `token_ids`; appends the ids to `hist`.

    A position without logprobs has no entry: OpenAI's chat shape has no null entries.
    Raises IndexError for a candidate id outside the vocabulary (the caller checked the
    sampled ids and the candidates past the first k; these are checked here, where they
    are looked up anyway, to keep the hot path to one pass).
    """
    strs, byts, dirty, raw, need, entries, fill = corrector.hot
    LP, LPC = ChatCompletionLogProb, ChatCompletionLogProbsContent
    out: list[ChatCompletionLogProbsContent] = []
    append = out.append
    for i, tid in enumerate(token_ids):
        pos = content[i] if content is not None else None
        if pos is not None:
            ctx = sub = None  # the position's context key and its cache entries, once needed
            fix = need[tid]
            if not fix:
                s, b = strs[tid], byts[tid]
            elif fix == 1:
                s, b = _EMPTY
            else:
                ctx = context_key(hist, dirty, raw)
                if ctx:
                    sub = entries(ctx)
                    s, b = sub.get(tid) or fill(ctx, tid)
                else:
                    s, b = _EMPTY
            tops = []
            if k:
                for e in pos.top_logprobs[:k]:
                    eid = e.token_id
                    if eid < 0:  # (ids past the vocabulary raise IndexError just below)
                        raise IndexError(eid)
                    fix = need[eid]
                    if not fix:
                        tops.append(LP(token=strs[eid], logprob=e.logprob, bytes=byts[eid]))
                    elif fix == 1:
                        tops.append(LP(token="", logprob=e.logprob, bytes=[]))
                    else:
                        if ctx is None:
                            ctx = context_key(hist, dirty, raw)
                            sub = entries(ctx) if ctx else None
                        es, eb = (sub.get(eid) or fill(ctx, eid)) if sub is not None else _EMPTY
                        tops.append(LP(token=es, logprob=e.logprob, bytes=eb))
            append(LPC(token=s, logprob=pos.logprob, bytes=b, top_logprobs=tops))
        hist.append(tid)
    return out


def completion_logprobs(
    token_ids: Sequence[int],
    content: Sequence[GenerateLogProbsContent] | None,
    k: int,
    corrector: Corrector,
    hist: list[int],
    out: CompletionLogProbs,
    offset: int,
) -> int:
    """Append the positions of `token_ids` to `out`; returns the next text_offset.

    A position without logprobs still gets its token and offset, with None for the
    logprob and the top dict (vLLM does the same).
    """
    strs, _, dirty, raw, need, entries, fill = corrector.hot
    tokens, token_lps, tops, offsets = out.tokens, out.token_logprobs, out.top_logprobs, out.text_offset
    for i, tid in enumerate(token_ids):
        pos = content[i] if content is not None else None
        ctx = sub = None  # the position's context key and its cache entries, once needed
        fix = need[tid]
        if not fix:
            s = strs[tid]
        elif fix == 1:
            s = ""
        else:
            ctx = context_key(hist, dirty, raw)
            if ctx:
                sub = entries(ctx)
                s = (sub.get(tid) or fill(ctx, tid))[0]
            else:
                s = ""
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if pos is None:
            token_lps.append(None)
            tops.append(None)
        else:
            lp = pos.logprob
            token_lps.append(lp)
            d = {s: lp}
            for e in pos.top_logprobs:
                eid = e.token_id
                if eid == tid:
                    continue  # the sampled entry (listed first) is already the first key
                rank = e.rank
                if rank is None or rank > k:
                    continue
                fix = need[eid]
                if not fix:
                    d[strs[eid]] = e.logprob
                elif fix == 1:
                    d[""] = e.logprob
                else:
                    if ctx is None:
                        ctx = context_key(hist, dirty, raw)
                        sub = entries(ctx) if ctx else None
                    d[(sub.get(eid) or fill(ctx, eid))[0] if sub is not None else ""] = e.logprob
            tops.append(d)
        hist.append(tid)
    return offset


def echo_prompt(tables, corrector: Corrector, prompt_ids: Sequence[int],
                prompt_logprobs: Sequence[GenerateLogProbsContent | None] | None, k: int,
                skip_special_tokens: bool) -> tuple[str, CompletionLogProbs | None, int]:
    """`echo` (completions, vLLM's rules): the prompt's text, its logprobs when the
    request asked for them (the first position has none), and the text offset where the
    generated tokens' logprobs continue."""
    from workers.derender.detokenizer import Detokenizer

    detok = Detokenizer(tables, skip_special_tokens=skip_special_tokens)
    text = detok.feed(prompt_ids) + detok.flush()
    if prompt_logprobs is None:
        return text, None, 0
    out = CompletionLogProbs()
    offset = completion_logprobs(prompt_ids, prompt_logprobs, k, corrector, [], out, 0)
    return text, out, offset


def prompt_logprobs(prompt_ids: Sequence[int], content: Sequence[GenerateLogProbsContent | None],
                    k: int, corrector: Corrector) -> PromptLogprobs:
    """vLLM's `prompt_logprobs` field: per prompt position None (the first, or no
    logprobs) or {token id as a string: PromptLogprob} with the prompt token itself, then
    the candidates of rank <= k in rank order. `decoded_token` is the token's text in its
    place, as echo's `tokens` has it (a partial character corrected against the ids before
    it; candidates in the same context). `content` is aligned with `prompt_ids`."""
    strs, _, dirty, raw, need, _, _ = corrector.hot
    get = corrector.lookup
    size = len(need)
    hist: list[int] = []
    out: PromptLogprobs = []
    for tid, pos in zip(prompt_ids, content):
        if pos is None:
            out.append(None)
        else:
            ctx = context_key(hist, dirty, raw) if hist else None
            d = {}
            for e in (pos, *pos.top_logprobs):
                eid = e.token_id
                if not 0 <= eid < size or e is not pos and (eid == tid or e.rank is None or e.rank > k):
                    continue
                fix = need[eid]
                text = strs[eid] if not fix else "" if fix == 1 or not ctx else get(ctx, eid)[0]
                d[str(eid)] = PromptLogprob(logprob=e.logprob, rank=e.rank, decoded_token=text)
            out.append(d)
        hist.append(tid)
        if len(hist) > 64:
            del hist[:-CTX]
    return out


# --- result records ----------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def chat_chunk(rid: str, created: int, model: str, text: str, first: bool,
               content: list[ChatCompletionLogProbsContent] | None,
               finish_reason: str | None, usage_info: UsageInfo | None) -> ChatCompletionChunk:
    return ChatCompletionChunk(
        id="chatcmpl-" + rid, created=created, model=model,
        choices=[ChatCompletionStreamChoice(
            delta=DeltaMessage(role="assistant", content=text) if first else DeltaMessage(content=text),
            logprobs=None if content is None else ChatCompletionLogProbs(content=content),
            finish_reason=finish_reason)],
        usage=usage_info)


def chat_final(rid: str, created: int, model: str, text: str,
               content: list[ChatCompletionLogProbsContent] | None,
               finish_reason: str | None, usage_info: UsageInfo,
               prompt_lp: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET) -> ChatCompletion:
    return ChatCompletion(
        id="chatcmpl-" + rid, created=created, model=model,
        choices=[ChatCompletionChoice(
            message=ChatMessage(content=text),
            logprobs=None if content is None else ChatCompletionLogProbs(content=content),
            finish_reason=finish_reason)],
        usage=usage_info, prompt_logprobs=prompt_lp)


def completion(rid: str, created: int, model: str, text: str, logprobs: CompletionLogProbs | None,
               finish_reason: str | None, usage_info: UsageInfo | None,
               prompt_lp: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET) -> Completion:
    """`text_completion`, streamed (one per chunk) and final alike, as OpenAI does."""
    return Completion(
        id="cmpl-" + rid, created=created, model=model,
        choices=[CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish_reason,
                                  prompt_logprobs=prompt_lp)],
        usage=usage_info)


def error_response(message: str, type_: str = "server_error", code: int | str | None = 500,
                   param: str | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))
