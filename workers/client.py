"""The genpipe client library: send requests, read OpenAI-shaped results back (the
README's "From Python" shows it in use).

Results arrive at least once (docs/design.md §6): the same (attempt, seq) may come twice,
and a crashed generate worker's request runs again under a new attempt. The client hides
both. Duplicates and records of superseded attempts are dropped; when a new attempt
starts after an older one was delivered, `records()` marks its first record
`restart=True`, `stream()` yields a `Restart` first (discard what was shown), and
`complete()` returns only the winning attempt's result.

One client holds one producer and one follower of its reply topic (every partition, no
group, positioned before any request is sent, so nothing is missed) and dispatches
records to the waiting requests by key; any number of requests may be in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Iterable, Sequence

import msgspec

from schemas import (
    JSON,
    Cancel,
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionLogProbs,
    ChatMessage,
    Completion,
    CompletionChoice,
    CompletionLogProbs,
    DecodeError,
    ErrorInfo,
    ErrorResponse,
    GenerateRequest,
    OutputOptions,
    RecordError,
    SamplingParams,
    encode,
    header_value,
    headers_for,
)
from schemas.codec import HEADER_SCHEMA, content_type_of, decode, schema_header
from schemas.openai import RESULT_TYPES, OpenAIResult, ResultRecord
from schemas.headers import HEADER_ATTEMPT, HEADER_FINAL, HEADER_RESTART, HEADER_SEQ
from workers.kafka.settings import KafkaSettings

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0
# The follower starts this far before "now" (clock skew between client and broker; the
# position is resolved before any request is sent, so nothing sent later is missed).
SINCE_MARGIN_S = 5.0

Result = ResultRecord  # what decode_result returns (schemas/openai.py)


# --- errors ------------------------------------------------------------------------


class GenpipeError(Exception):
    """The pipeline answered the request with an OpenAI error object."""

    def __init__(self, message: str, type: str = "server_error", *, code: int | str | None = None,
                 param: str | None = None, request_id: str | None = None):
        super().__init__(message)
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.request_id = request_id

    def __str__(self) -> str:
        return f"{self.type}: {self.message}"


class GenpipeTimeout(GenpipeError, TimeoutError):
    """No (further) result arrived for a request within the client's timeout."""

    def __init__(self, message: str, *, request_id: str | None = None):
        super().__init__(message, "timeout", request_id=request_id)

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

    def header(self, name: str) -> str | None:
        return header_value(self.headers, name)


# --- decoding result records --------------------------------------------------------

_RESULT_TYPES: dict[str, Any] = {schema_header(t): t for t in RESULT_TYPES}


def decode_result(data: bytes, headers: Iterable[tuple[str, bytes]] | None = None) -> Result:
    """Decode a results-topic value by its `genpipe-schema` header (sniffed when absent).

    Raises schemas DecodeError / ValidationError.
    """
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
    if isinstance(last, ErrorResponse):
        return last
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


# --- building requests ---------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def load_tokenizer(tokenizer_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def _ids(result) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True);
    # 4.x returns the list itself.
    if hasattr(result, "keys") and "input_ids" in result:
        result = result["input_ids"]
    if hasattr(result, "tolist"):
        result = result.tolist()
    if result and isinstance(result[0], list):
        result = result[0]
    return [int(t) for t in result]


def render_chat(tokenizer_dir: str | Path, messages: Sequence[dict]) -> list[int]:
    """Prompt ids of a chat: the model's chat template with the generation prompt."""
    tokenizer = load_tokenizer(str(tokenizer_dir))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer in {tokenizer_dir} has no chat template; "
                         f"send a plain prompt (render_prompt) instead")
    return _ids(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True))


def render_prompt(tokenizer_dir: str | Path, text: str) -> list[int]:
    """Prompt ids of a completion prompt (with the tokenizer's special tokens, e.g. BOS)."""
    tokenizer = load_tokenizer(str(tokenizer_dir))
    return _ids(tokenizer(text)["input_ids"])


def make_request(prompt_token_ids: Sequence[int], *, kind: str = "completion", request_id: str | None = None,
                 max_tokens: int | None = 16, min_tokens: int = 0, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
                 stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                 logprobs: bool | int | None = None, top_logprobs: int | None = None,
                 prompt_logprobs: int | None = None, stream: bool = False, include_usage: bool = False,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 model: str | None = None, reply_topic: str | None = None, deadline_s: float | None = None,
                 priority: int = 0, created: int | None = None, echo: bool = False) -> GenerateRequest:
    """A `GenerateRequest` with OpenAI-style logprob options mapped as derender expects.

    `kind="completion"`: `logprobs=k` is OpenAI's completions `logprobs` (the sampled
    token plus the top k per position; generate is asked for k+1 candidates).
    `kind="chat"`: `logprobs=True` turns logprobs on, `top_logprobs=k` lists k candidates
    per position (generate is asked for k). Counts must be >= 0 (build a
    `GenerateRequest` yourself for `sampling.logprobs=-1`, the whole vocabulary).

    Fills `request_id` (a uuid4 hex) and `output.created` (now) when not given;
    `deadline_s` is relative (seconds from now). `echo` (completions): the prompt's text,
    and with `logprobs` its logprobs, in front of the output (`max_tokens=0`: the prompt
    only, what evaluation harnesses score). `prompt_logprobs=k` (vLLM's extension): the
    non-streamed result carries `prompt_logprobs`, per prompt token None (the first) or
    {token id: {logprob, rank, decoded_token}} with the token itself and the top k (on the
    choice for completions, on the response for chat, as vLLM does).
    """
    if kind not in ("chat", "completion"):
        raise ValueError(f"kind must be 'chat' or 'completion', got {kind!r}")
    gen_logprobs: int | None = None
    k = 0
    enabled = (logprobs is not None and logprobs is not False) or top_logprobs is not None
    if enabled:
        as_int = None if isinstance(logprobs, bool) or logprobs is None else int(logprobs)
        if kind == "chat":
            k = top_logprobs if top_logprobs is not None else (as_int or 0)
            gen_logprobs = k
        else:
            k = as_int if as_int is not None else (top_logprobs or 0)
            gen_logprobs = k + 1
        if k < 0:
            raise ValueError(f"logprobs/top_logprobs must be >= 0, got {k}")
    if echo and kind != "completion":
        raise ValueError("echo is for completions")
    if prompt_logprobs is not None and prompt_logprobs < 0:
        raise ValueError(f"prompt_logprobs must be >= 0, got {prompt_logprobs}")
    # The prompt's candidates: for vLLM's field (top prompt_logprobs) and for echo (the
    # same candidates as the output's); generate computes them once for both.
    wanted = [c for c in (prompt_logprobs, gen_logprobs if echo else None) if c is not None]
    sampling = SamplingParams(
        max_tokens=max_tokens, min_tokens=min_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=min_p, seed=seed, stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
        logprobs=gen_logprobs, prompt_logprobs=max(wanted) if wanted else None)
    output = OutputOptions(
        kind=kind, model=model, stream=stream, include_usage=include_usage, top_logprobs=max(k, 0),
        stop=list(stop), include_stop_str_in_output=include_stop_str_in_output,
        skip_special_tokens=skip_special_tokens,
        created=int(time.time()) if created is None else created, echo=echo,
        prompt_logprobs=msgspec.UNSET if prompt_logprobs is None else prompt_logprobs)
    return GenerateRequest(
        request_id=request_id or uuid.uuid4().hex, prompt_token_ids=[int(t) for t in prompt_token_ids],
        sampling=sampling, output=output, reply_topic=reply_topic,
        deadline_ms=None if deadline_s is None else int((time.time() + deadline_s) * 1000),
        priority=priority)


# --- the client --------------------------------------------------------------------------


async def queue_get(queue: asyncio.Queue, timeout: float):
    """`queue.get()` within `timeout` seconds (TimeoutError), on every result's path: an
    item already there is taken at once, and the wait is `asyncio.timeout`, not
    `asyncio.wait_for`, which on Python 3.11 wraps the get in a new Task each time
    (ops/bench/gateway.py found it among the gateway's largest costs)."""
    if not queue.empty():
        return queue.get_nowait()
    async with asyncio.timeout(timeout):
        return await queue.get()


class _Closed:
    """Queue item: the client stopped (or its follower failed) under a waiting request."""

    def __init__(self, error: BaseException | None):
        self.error = error


class GenpipeClient:
    """Send `GenerateRequest`s and read their results (see the module docstring).

    `bootstrap_servers` overrides `settings.bootstrap_servers`; `settings` defaults to
    `KafkaSettings.from_env()` (GENPIPE_* variables). `reply_topic` is the topic this
    client listens on: by default the shared results topic `<prefix>.results`
    (filtered by request id); with another one, requests without a `reply_topic` are
    sent with this one. `timeout_s` bounds the wait for each next result record of a
    request (a request that keeps producing results never times out).
    """

    def __init__(self, bootstrap_servers: str | None = None, *, settings: KafkaSettings | None = None,
                 reply_topic: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 cancel_on_abandon: bool = True):
        settings = settings if settings is not None else KafkaSettings.from_env()
        if bootstrap_servers:
            settings = dataclasses.replace(settings, bootstrap_servers=bootstrap_servers)
        self.settings = settings
        self.reply_topic = reply_topic or settings.topic("results")
        self.timeout_s = float(timeout_s)
        self.cancel_on_abandon = cancel_on_abandon
        self._producer = None
        self._consumer = None
        self._dispatcher: asyncio.Task | None = None
        self._waiting: dict[str, asyncio.Queue] = {}
        self._closed: _Closed | None = None

    # --- lifecycle -------------------------------------------------------------------

    async def __aenter__(self) -> "GenpipeClient":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        from workers.kafka.clients import make_consumer, make_producer, start_client
        from workers.kafka.follow import assign_all

        if self._producer is not None:
            return
        producer = make_producer(self.settings)
        consumer = None
        try:
            await start_client(producer, self.settings)
            # The default fetch wait: a reply landing ends a waiting fetch at once, and an
            # idle client then asks the broker twice a second, not a hundred times.
            consumer = make_consumer(self.settings, group_id=None, auto_offset_reset="latest")
            await consumer.start()
            since = int((time.time() - SINCE_MARGIN_S) * 1000)
            # Positions are resolved before this returns: every record produced from
            # here on is seen, whatever the clocks say.
            await assign_all(consumer, self.reply_topic, since, timeout_s=30.0)
        except BaseException:
            if consumer is not None:
                await consumer.stop()
            await producer.stop()
            raise
        self._producer, self._consumer = producer, consumer
        self._closed = None
        self._dispatcher = asyncio.ensure_future(self._dispatch())

    async def close(self) -> None:
        dispatcher, self._dispatcher = self._dispatcher, None
        if dispatcher is not None:
            dispatcher.cancel()
            await asyncio.gather(dispatcher, return_exceptions=True)
        self._fail_waiting(None)
        producer, consumer = self._producer, self._consumer
        self._producer = self._consumer = None
        if consumer is not None:
            await consumer.stop()
        if producer is not None:
            await producer.stop()

    def _fail_waiting(self, error: BaseException | None) -> None:
        self._closed = _Closed(error)
        for queue in self._waiting.values():
            queue.put_nowait(self._closed)

    async def _dispatch(self) -> None:
        from workers.kafka.follow import batches

        try:
            async for records in batches(self._consumer):
                for message in records:
                    if message.key is None:
                        continue
                    queue = self._waiting.get(message.key.decode("utf-8", "replace"))
                    if queue is not None:
                        queue.put_nowait(message)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the follower broke: wake every waiting request
            log.error("genpipe client: reading %s failed: %s", self.reply_topic, exc)
            self._fail_waiting(exc)
            raise

    # --- sending ---------------------------------------------------------------------

    def _prepare(self, request: GenerateRequest) -> GenerateRequest:
        default = self.settings.topic("results")
        if request.reply_topic is None and self.reply_topic != default:
            request = msgspec.structs.replace(request, reply_topic=self.reply_topic)
        wanted = request.reply_topic or default
        if wanted != self.reply_topic:
            raise ValueError(f"request {request.request_id!r} asks for replies on {wanted!r} but this "
                             f"client listens on {self.reply_topic!r}: use GenpipeClient(reply_topic={wanted!r})")
        return request

    def _require_started(self) -> None:
        if self._producer is None:
            raise RuntimeError("GenpipeClient is not started: use `async with GenpipeClient(...) as client`")

    async def submit(self, request: GenerateRequest) -> None:
        """Send a request without waiting for its results (they go to its reply topic)."""
        self._require_started()
        await self._producer.send_and_wait(
            self.settings.topic("requests"), encode(request), key=request.request_id.encode(),
            headers=headers_for(request))

    async def cancel(self, request_id: str, reason: str = "cancelled by client") -> None:
        """Ask the generate workers to stop a request (it ends with finish_reason=abort)."""
        self._require_started()
        record = Cancel(request_id=request_id, reason=reason)
        await self._producer.send_and_wait(self.settings.topic("cancel"), encode(record),
                                           key=request_id.encode(), headers=headers_for(record))

    # --- receiving -------------------------------------------------------------------

    async def records(self, request: GenerateRequest, *, timeout_s: float | None = None) -> AsyncIterator[ResultMessage]:
        """Send `request`, then yield its result records, deduplicated, until the final one.

        A record that starts a new attempt after records of an older one were yielded has
        `restart=True`. Raises GenpipeTimeout when no next record arrives within the
        timeout; error results are yielded, not raised. Leaving early (break, timeout,
        an exception) cancels the request unless `cancel_on_abandon=False`.
        """
        self._require_started()
        request = self._prepare(request)
        rid = request.request_id
        if rid in self._waiting:
            raise ValueError(f"request {rid!r} is already in flight on this client")
        if self._closed is not None and self._closed.error is not None:
            raise RuntimeError(f"the client's reader of {self.reply_topic} failed: {self._closed.error}")
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        queue: asyncio.Queue = asyncio.Queue()
        self._waiting[rid] = queue  # before sending: no result can slip past
        finished = False
        try:
            await self.submit(request)
            filt = AttemptFilter()
            while True:
                try:
                    message = await queue_get(queue, timeout)
                except asyncio.TimeoutError:
                    raise GenpipeTimeout(self._timeout_message(rid, timeout, filt.accepted),
                                         request_id=rid) from None
                if isinstance(message, _Closed):
                    if message.error is not None:
                        raise RuntimeError(f"the client's reader of {self.reply_topic} failed: "
                                           f"{message.error}") from message.error
                    raise RuntimeError(f"GenpipeClient closed while request {rid!r} was waiting")
                item = self._accept(filt, rid, message)
                if item is None:
                    continue
                if item.final:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if self._waiting.get(rid) is queue:
                del self._waiting[rid]
            if not finished and self.cancel_on_abandon and self._producer is not None:
                try:
                    await self.cancel(rid, "client gave up waiting")
                except Exception as exc:  # best effort
                    log.debug("could not cancel %s: %s", rid, exc)

    def _accept(self, filt: AttemptFilter, rid: str, message) -> ResultMessage | None:
        headers = list(message.headers or ())
        attempt = header_value(headers, HEADER_ATTEMPT)
        seq_text = header_value(headers, HEADER_SEQ)
        try:
            seq = int(seq_text) if seq_text is not None else None
        except ValueError:
            seq = None
        restart = filt.accept(attempt, seq, header_value(headers, HEADER_RESTART) == "1")
        if restart is None:
            return None
        try:
            value = decode_result(message.value, headers)
        except (RecordError, DecodeError) as exc:
            value = ErrorResponse(error=_error_info(
                f"unreadable result record at {message.topic}[{message.partition}]@{message.offset}: {exc}"))
        return ResultMessage(
            request_id=rid, value=value, raw=message.value, headers=headers, attempt=attempt, seq=seq,
            final=header_value(headers, HEADER_FINAL) == "1", restart=restart, topic=message.topic,
            partition=message.partition, offset=message.offset, timestamp=message.timestamp)

    def _timeout_message(self, rid: str, timeout: float, received: int) -> str:
        where = (f"are a generate and a derender worker running on topic prefix "
                 f"{self.settings.topic_prefix!r} (bootstrap {self.settings.bootstrap_servers})?")
        if received == 0:
            return f"no result for request {rid} within {timeout:g} s: {where}"
        return (f"request {rid}: no further result within {timeout:g} s after {received} "
                f"result record(s): {where}")

    async def stream(self, request: GenerateRequest, *, timeout_s: float | None = None,
                     raise_errors: bool = True) -> AsyncIterator[Result | Restart]:
        """Send `request` and yield its OpenAI objects in order, without duplicates.

        Yields `ChatCompletionChunk`s / `Completion`s for a streamed request, one
        `ChatCompletion` / `Completion` for a non-streamed one. When the request started
        over (a generate worker died mid-stream), a `Restart` is yielded first: discard
        everything yielded before it. An error result raises `GenpipeError` (or is
        yielded as an `ErrorResponse` with `raise_errors=False`); no result within the
        timeout raises `GenpipeTimeout`.
        """
        async with contextlib.aclosing(self.records(request, timeout_s=timeout_s)) as records:
            async for record in records:
                if record.restart:
                    yield Restart(record.request_id, record.attempt)
                if raise_errors:
                    raise_for_error(record.value, record.request_id)
                yield record.value

    async def complete(self, request: GenerateRequest, *, timeout_s: float | None = None) -> ChatCompletion | Completion:
        """Send `request` and return its final `ChatCompletion` / `Completion`.

        For a streamed request the chunks of the winning attempt are assembled into the
        final object (usage only if `include_usage` was asked). Raises `GenpipeError` on
        an error result and `GenpipeTimeout` when the pipeline does not answer.
        """
        items: list[Result] = []
        async with contextlib.aclosing(self.stream(request, timeout_s=timeout_s)) as stream:
            async for item in stream:
                if isinstance(item, Restart):
                    items.clear()
                else:
                    items.append(item)
        return assemble(items)


def _error_info(message: str) -> ErrorInfo:
    return ErrorInfo(message=message, type="server_error")


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
    try:
        if data is None:
            out["value"] = None
        elif content_type_of(data, message.headers) == JSON:
            msgspec.json.decode(data)  # valid JSON: embed the bytes untouched
            out["value"] = msgspec.Raw(data)
        else:
            out["value"] = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecordError) as exc:
        out["value"] = None
        out["value_error"] = str(exc)
        out["value_base64"] = base64.b64encode(data).decode()
    if include_position:
        out.update(topic=message.topic, partition=message.partition, offset=message.offset,
                   timestamp=message.timestamp)
    return msgspec.json.encode(out)


__all__ = [
    "GenpipeClient", "GenpipeError", "GenpipeTimeout", "Restart", "ResultMessage", "AttemptFilter",
    "assemble", "decode_result", "make_request", "render_chat", "render_prompt", "record_json",
    "text_of", "raise_for_error", "load_tokenizer",
]
