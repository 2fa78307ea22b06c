"""OpenAI-shaped results (topic `<prefix>.results` or a request's reply_topic).

Field names are OpenAI's (and vLLM's protocol) exactly, so any OpenAI client type can
parse the values. `None` fields are written as `null`, as OpenAI does.
"""

from __future__ import annotations

from typing import Literal

import msgspec

OpenAIFinishReason = Literal["stop", "length", "abort", "error"]


class ChatCompletionLogProb(msgspec.Struct, kw_only=True, gc=False):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb, kw_only=True, gc=False):
    top_logprobs: list[ChatCompletionLogProb] = msgspec.field(default_factory=list)


class ChatCompletionLogProbs(msgspec.Struct, kw_only=True, gc=False):
    content: list[ChatCompletionLogProbsContent] | None = None


class PromptLogprob(msgspec.Struct, kw_only=True, gc=False):
    """One candidate of one prompt position in vLLM's `prompt_logprobs` (its `Logprob`)."""

    logprob: float
    rank: int | None = None  # 1 = the most likely; None only when the logprob was NaN
    decoded_token: str | None = None


# vLLM's extension: one entry per prompt token, the first None, the others
# {token id as a string: PromptLogprob} with the prompt token itself and the top k.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogProbs(msgspec.Struct, kw_only=True, gc=False):
    text_offset: list[int] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    tokens: list[str] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)


class UsageInfo(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# --- chat --------------------------------------------------------------------------


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class DeltaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    # omit_defaults: OpenAI's deltas leave out what did not change (role after the first)
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionStreamChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: OpenAIFinishReason | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True, tag_field="object", tag="chat.completion.chunk"):
    # `object` is the tag field: written first, and it tells the three apart on decode
    id: str
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ChatCompletionChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: OpenAIFinishReason | None = None


class ChatCompletion(msgspec.Struct, kw_only=True, tag_field="object", tag="chat.completion"):
    # `object` is the tag field: written first, and it tells the three apart on decode
    id: str
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    # vLLM puts chat's prompt_logprobs on the response, not the choice. UNSET (left out
    # of the JSON) unless the request asked for them (`output.prompt_logprobs`).
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET


# --- completion (the same object streamed and final, as OpenAI does) ---------------


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: OpenAIFinishReason | None = None
    # vLLM's extension (non-streamed only), UNSET (left out of the JSON) unless asked for
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET


class Completion(msgspec.Struct, kw_only=True, tag_field="object", tag="text_completion"):
    # `object` is the tag field: written first, and it tells the three apart on decode
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# --- errors ------------------------------------------------------------------------


class ErrorInfo(msgspec.Struct, kw_only=True):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: ErrorInfo


# The OpenAI objects tell themselves apart by their `object` field, so msgspec can decode
# this union directly. An error result (`ErrorResponse`, untagged) is told apart by the
# `genpipe-schema` header instead.
OpenAIResult = ChatCompletionChunk | ChatCompletion | Completion

# Every value a results topic may hold, told apart by the `genpipe-schema` header.
RESULT_TYPES = (ChatCompletionChunk, ChatCompletion, Completion, ErrorResponse)
ResultRecord = ChatCompletionChunk | ChatCompletion | Completion | ErrorResponse
