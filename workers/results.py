"""Result records as a client reads them: errors, decoding, the dedupe/restart rule,
assembling a stream into one object, and the JSON form of a record (`genpipe tail`).
Pure functions and plain types; `workers/client.py` puts them to work on Kafka."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import msgspec

from schemas import (
    JSON,
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionLogProbs,
    ChatMessage,
    Completion,
    CompletionChoice,
    CompletionLogProbs,
    ErrorResponse,
    RecordError,
    header_value,
)
from schemas.codec import HEADER_SCHEMA, content_type_of, decode, schema_header
from schemas.errors import DecodeError
from schemas.openai import RESULT_TYPES, OpenAIResult, ResultRecord
from schemas.records import GenerateRequest

log = logging.getLogger(__name__)

Result = ResultRecord  # what decode_result returns (schemas/openai.py)


# --- errors ------------------------------------------------------------------------


class GenpipeError(Exception):
    """The pipeline answered the request with an OpenAI error object.

    `public_message` is what the HTTP gateway shows its caller: `message` less what only an
    operator needs (the bootstrap servers, the topic prefix, a `genpipe` command), which
    the gateway logs instead. Most errors have nothing to hide: the same text."""

    def __init__(self, message: str, type: str = "server_error", *, code: int | str | None = None,
                 param: str | None = None, request_id: str | None = None, public_message: str | None = None):
        super().__init__(message)
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.request_id = request_id
        self.public_message = message if public_message is None else public_message

    def __str__(self) -> str:
        return f"{self.type}: {self.message}"


class GenpipeTimeout(GenpipeError, TimeoutError):
    """No (further) result arrived for a request within the client's timeout."""

    def __init__(self, message: str, *, request_id: str | None = None, public_message: str | None = None):
        super().__init__(message, "timeout", request_id=request_id, public_message=public_message)

    def __str__(self) -> str:
        return self.message


class GenpipeOverflow(GenpipeError):
    """A request's reader fell `max_unread` records behind; the client gave the request up
    and cancelled it when that happened."""

    def __init__(self, message: str, *, request_id: str | None = None):
        super().__init__(message, "server_error", code=500, request_id=request_id)

    def __str__(self) -> str:
        return self.message


class GenpipeUnavailable(GenpipeError, ConnectionError):
    """Kafka did not acknowledge a request (or a cancel) within the client's send timeout."""

    def __init__(self, message: str, *, request_id: str | None = None, public_message: str | None = None):
        super().__init__(message, "service_unavailable", code=503, request_id=request_id,
                         public_message=public_message)

    def __str__(self) -> str:
        return self.message


# --- what the client hands out ------------------------------------------------------


@dataclass(frozen=True)
class Restart:
    """Yielded by `GenpipeClient.stream()` when the request started over.

    Everything yielded for the request before this marker belongs to an attempt that was
    abandoned (its generate worker died); discard it. The records that follow are the new
    attempt's, from its beginning.
    """

    request_id: str
    attempt: str | None


@dataclass(frozen=True)
class ResultMessage:
    """One accepted (deduplicated) result record, as `GenpipeClient.records()` yields it."""

    request_id: str
    value: Result  # the decoded OpenAI object or error
    raw: bytes  # the record value exactly as published
    headers: list[tuple[str, bytes]]
    attempt: str | None
    seq: int | None
    final: bool
    restart: bool  # first record of an attempt that replaces one already delivered
    topic: str
    partition: int
    offset: int
    timestamp: int  # ms
    received_at: float = 0.0  # when the client's reader handed it over (the event loop's clock, s)

    def header(self, name: str) -> str | None:
        return header_value(self.headers, name)


# --- decoding result records --------------------------------------------------------

_RESULT_TYPES: dict[str, Any] = {schema_header(t): t for t in RESULT_TYPES}


def decode_result(data: bytes, headers: Iterable[tuple[str, bytes]] | None = None) -> Result:
    """Decode a results-topic value by its `genpipe-schema` header (sniffed when absent).

    Raises schemas DecodeError / ValidationError.
    """
    if data is None:  # (a tombstone: sniffing its content type raised AttributeError)
        raise DecodeError("a result record without a value")
    headers = list(headers or ())
    content_type = content_type_of(data, headers)
    record_type = _RESULT_TYPES.get(header_value(headers, HEADER_SCHEMA) or "")
    if record_type is not None:
        return decode(data, record_type, content_type)
    try:
        return decode(data, OpenAIResult, content_type)
    except RecordError:
        return decode(data, ErrorResponse, content_type)


# --- dedupe / restart rules (pure) ---------------------------------------------------


class AttemptFilter:
    """Which records of one request to show: drops duplicates and superseded attempts.

    `accept(attempt, seq, restart_header)` returns None to drop the record, else whether
    it starts a new attempt that replaces one already shown (a restart).
    """

    def __init__(self) -> None:
        self.current: str | None = None
        self.last_seq = -1
        self.superseded: set[str] = set()
        self.accepted = 0

    def accept(self, attempt: str | None, seq: int | None, restart_header: bool = False) -> bool | None:
        if attempt is None or seq is None:  # not a genpipe derender record: nothing to go by
            self.accepted += 1
            return False
        if self.current is None:
            self.current, self.last_seq = attempt, seq
            self.accepted += 1
            return False  # nothing shown yet: nothing to discard
        if attempt == self.current:
            if seq <= self.last_seq:
                return None  # duplicate
            self.last_seq = seq
            self.accepted += 1
            return False
        if attempt in self.superseded:
            return None
        if restart_header or seq == 0:
            self.superseded.add(self.current)
            self.current, self.last_seq = attempt, seq
            self.accepted += 1
            return True
        log.debug("dropping record of unknown attempt %r seq %d (current %r)", attempt, seq, self.current)
        return None


# --- assembling a final object from a stream -----------------------------------------


def assemble(items: Sequence[Result]) -> Result:
    """The final object of one attempt's records.

    A single `chat.completion` / `text_completion` / error is returned as is; streamed
    `chat.completion.chunk`s become one `chat.completion`, streamed `text_completion`s one
    `text_completion` (text and logprobs concatenated; finish_reason and usage from the
    last record that has them).
    """
    if not items:
        raise ValueError("no result records to assemble")
    last = items[-1]
    if len(items) == 1 and not isinstance(last, ChatCompletionChunk):
        return last
    error = next((i for i in reversed(items) if isinstance(i, ErrorResponse)), None)
    if error is not None:  # (an unreadable record among them, not only the last: it crashed below)
        return error
    first = items[0]
    usage = next((i.usage for i in reversed(items) if getattr(i, "usage", None) is not None), None)
    finish = next((i.choices[0].finish_reason for i in reversed(items)
                   if i.choices and i.choices[0].finish_reason is not None), None)
    if isinstance(first, ChatCompletionChunk):
        text, content, has_lp = [], [], False
        for item in items:
            for choice in item.choices:
                text.append(choice.delta.content or "")
                if choice.logprobs is not None:
                    has_lp = True
                    content.extend(choice.logprobs.content or ())
        return ChatCompletion(
            id=first.id, created=first.created, model=first.model,
            choices=[ChatCompletionChoice(
                message=ChatMessage(content="".join(text)),
                logprobs=ChatCompletionLogProbs(content=content) if has_lp else None,
                finish_reason=finish)],
            usage=usage)
    if isinstance(first, Completion):
        text, lp = [], None
        for item in items:
            for choice in item.choices:
                text.append(choice.text)
                if choice.logprobs is not None:
                    lp = lp or CompletionLogProbs()
                    lp.text_offset.extend(choice.logprobs.text_offset)
                    lp.token_logprobs.extend(choice.logprobs.token_logprobs)
                    lp.tokens.extend(choice.logprobs.tokens)
                    lp.top_logprobs.extend(choice.logprobs.top_logprobs)
        return Completion(
            id=first.id, created=first.created, model=first.model,
            choices=[CompletionChoice(text="".join(text), logprobs=lp, finish_reason=finish)],
            usage=usage)
    return last


# --- a non-streamed answer too large for one record ------------------------------------

# A non-streamed answer comes in one result record; with logprobs a few hundred tokens can
# pass Kafka's ~1 MB (a chat's at top 20), and the derender ends such a request with a 400
# telling the caller to stream. `GenpipeClient.complete` (the gateway's non-streamed
# answers too) asks for it streamed and assembles its records instead (docs/design.md §9).
#
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
    """Whether `request`, not streamed, might get an answer too large for one record of
    `limit` bytes, by its `max_tokens`. Only one with logprobs can: text alone takes ~4-16
    bytes a token (1 MB is ~100k tokens), and streaming every answer inside would cost a
    result record per chunk, not one. Nor one without `max_tokens` (a chat's default: to
    the end of the context): guessed to the end of a long context, every such chat with
    logprobs would be switched, most of them short; it comes in one record, as before.
    Nor one with vLLM's `prompt_logprobs`: streamed results have no such field."""
    tokens = request.sampling.max_tokens
    if (request.output.stream or request.sampling.logprobs is None or tokens is None
            or request.output.prompt_logprobs is not msgspec.UNSET):
        return False
    if request.output.echo:  # (the prompt's tokens, with their logprobs, in front)
        tokens += len(request.prompt_token_ids)
    position, candidate = ANSWER_BYTES[request.output.kind]
    return tokens * (position + (1 + max(0, request.output.top_logprobs)) * candidate) > limit


@dataclass
class AnswerBudget:
    """Bytes of result records that answers assembled from streamed records may hold, all
    told (`GenpipeClient.complete`): one budget shared by several calls bounds them
    together, as the gateway's --max-answer-mib bounds the choices of one HTTP request.
    Held to its end, an answer of any size took the caller's memory (the gateway's)."""

    limit: int
    used: int = 0

    def take(self, nbytes: int) -> bool:
        """Count `nbytes` more; False once past the limit."""
        self.used += nbytes
        return self.used <= self.limit


def streamed_inside(request: GenerateRequest) -> GenerateRequest:
    """`request` asked for streamed, with its usage at the end, for an answer assembled
    from its records (`assemble`): the answer its one record would have been."""
    output = msgspec.structs.replace(request.output, stream=True, include_usage=True, continuous_usage=False)
    return msgspec.structs.replace(request, output=output)


def text_of(item: Result) -> str:
    """The text an item adds (a delta, a completion piece, or a final message)."""
    if isinstance(item, ChatCompletionChunk):
        return "".join(c.delta.content or "" for c in item.choices)
    if isinstance(item, ChatCompletion):
        return "".join(c.message.content or "" for c in item.choices)
    if isinstance(item, Completion):
        return "".join(c.text for c in item.choices)
    return ""


def raise_for_error(value: Result, request_id: str | None = None) -> None:
    if isinstance(value, ErrorResponse):
        err = value.error
        raise GenpipeError(err.message, err.type, code=err.code, param=err.param, request_id=request_id)


def record_json(message, *, include_position: bool = True) -> bytes:
    """A consumed record as one JSON line: key, headers, value (+ topic/partition/offset/timestamp).

    A JSON value is embedded as is; a msgpack value is converted; anything else is given
    as `value_base64` with `value_error`.
    """
    import base64

    headers = {k: (v.decode("utf-8", "replace") if v is not None else None) for k, v in (message.headers or ())}
    out: dict[str, Any] = {"key": message.key.decode("utf-8", "replace") if message.key is not None else None,
                           "headers": headers}
    data = message.value
    position = dict(topic=message.topic, partition=message.partition, offset=message.offset,
                    timestamp=message.timestamp) if include_position else {}
    try:
        if data is None:
            out["value"] = None
        elif content_type_of(data, message.headers) == JSON:
            msgspec.json.decode(data)  # valid JSON: embed the bytes untouched
            out["value"] = msgspec.Raw(data)
        else:
            out["value"] = msgspec.msgpack.decode(data)
        return msgspec.json.encode({**out, **position})
    except (msgspec.DecodeError, RecordError, TypeError, ValueError, RecursionError) as exc:
        # Whatever a producer wrote, the DLQ's records above all (msgpack with an
        # extension value or a map key JSON has not, nesting past the decoder's depth):
        # the line says so, and the command goes on to the next record (it stopped there)
        out["value"] = None
        out["value_error"] = " ".join(str(exc).split()) or type(exc).__name__
        out["value_base64"] = base64.b64encode(data).decode()
        return msgspec.json.encode({**out, **position})
