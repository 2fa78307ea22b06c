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
import logging
import time
from typing import AsyncIterator

import msgspec

from schemas import (Cancel, ChatCompletion, Completion, DecodeError, ErrorInfo, ErrorResponse, GenerateRequest,
                     RecordError, encode, header_value, headers_for)
from schemas.headers import HEADER_ATTEMPT, HEADER_FINAL, HEADER_RESTART, HEADER_SEQ
from workers.kafka.settings import MAX_RECORD_BYTES, KafkaSettings
from workers.log_digest import LogDigest
from workers.mailbox import KEEPALIVE, OVERFLOW, TIMED_OUT, Mailbox
# The library's public names live in two modules of their own; `workers.client` is
# where users import them from (README "From Python").
from workers.requests import load_tokenizer, make_request, render_chat, render_prompt
from workers.results import (AttemptFilter, GenpipeError, GenpipeOverflow, GenpipeTimeout, GenpipeUnavailable,
                             AnswerBudget, Restart, Result, ResultMessage, answer_may_outgrow, assemble, decode_result,
                             raise_for_error, record_json, streamed_inside, text_of)

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0
# Kafka must acknowledge a sent request within this long; a producer left to itself keeps
# retrying an unreachable broker for minutes, and a caller needs to hear it is down.
DEFAULT_SEND_TIMEOUT_S = 15.0
# The follower starts this far before "now" (clock skew between client and broker; the
# position is resolved before any request is sent, so nothing sent later is missed).
SINCE_MARGIN_S = 5.0
# close(): how long the producer may wait for Kafka to acknowledge the records it holds.
CLOSE_WAIT_S = 10.0


# --- the client --------------------------------------------------------------------------


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
    request (a request that keeps producing results never times out). `send_timeout_s`
    bounds the wait for Kafka to acknowledge a request or a cancel: past it the call
    raises `GenpipeUnavailable` (the record may still be delivered once Kafka is back).
    `max_unread` bounds the records one request may have waiting unread (None: no
    bound); a request whose reader falls that far behind, its oldest record not taken
    for 5 s (`mailbox.STALLED_AFTER_S`), is cancelled at once and its
    reader gets `GenpipeOverflow` (a `GenpipeError`, code 500): the HTTP gateway sets it,
    so a client that stops reading its stream cannot make the gateway grow without end.
    `max_record_bytes`: the largest request record it sends (default ~1 MB, under
    Kafka's default limit; the workers' --max-record-bytes, raised with the broker's), and
    the result record `complete()` judges a non-streamed answer's size against.
    """

    def __init__(self, bootstrap_servers: str | None = None, *, settings: KafkaSettings | None = None,
                 reply_topic: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 cancel_on_abandon: bool = True, send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
                 max_unread: int | None = None, max_record_bytes: int | None = None):
        settings = settings if settings is not None else KafkaSettings.from_env()
        if bootstrap_servers:
            settings = dataclasses.replace(settings, bootstrap_servers=bootstrap_servers)
        self.settings = settings
        self.reply_topic = reply_topic or settings.topic("results")
        if self.reply_topic != settings.topic("results"):
            from workers.kafka.reply_topics import check_client_reply_topic

            check_client_reply_topic(self.reply_topic, settings.topic_prefix)
        self.timeout_s = float(timeout_s)
        self.send_timeout_s = float(send_timeout_s)
        self.cancel_on_abandon = cancel_on_abandon
        if max_unread is not None and max_unread < 1:
            raise ValueError(f"max_unread must be at least 1 (or None), got {max_unread}")
        self.max_unread = max_unread
        self.max_record_bytes = max_record_bytes  # the producer's; None: MAX_RECORD_BYTES (~1 MB)
        self._producer = None
        self._consumer = None
        self._dispatcher: asyncio.Task | None = None
        self._waiting: dict[str, Mailbox] = {}
        self._background: set[asyncio.Task] = set()  # cancels sent on their own (cancel_soon)
        # (with Kafka away every choice of every request fails its cancel: a line each)
        self._cancels_failed = LogDigest(log, logging.WARNING, "cancels not sent")
        self._closed: _Closed | None = None

    # --- lifecycle -------------------------------------------------------------------

    async def __aenter__(self) -> "GenpipeClient":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        from aiokafka.errors import KafkaTimeoutError

        from workers.kafka.clients import make_producer, start_client
        from workers.kafka.follow import assign_all, make_follower
        from workers.kafka.publisher import request_size_for

        if self._producer is not None:
            return
        producer = make_producer(self.settings, max_request_size=request_size_for(
            self.max_record_bytes or MAX_RECORD_BYTES))
        consumer = None
        try:
            await start_client(producer, self.settings)
            # The default fetch wait: a reply landing ends a waiting fetch at once, and an
            # idle client then asks the broker twice a second, not a hundred times.
            consumer = make_follower(self.settings)
            await consumer.start()
            since = int((time.time() - SINCE_MARGIN_S) * 1000)
            # Positions are resolved before this returns: every record produced from
            # here on is seen, whatever the clocks say.
            await assign_all(consumer, self.reply_topic, since, timeout_s=30.0)
        except BaseException as exc:
            if consumer is not None:
                await consumer.stop()
            await producer.stop()
            if isinstance(exc, KafkaTimeoutError):  # (a library's start does not wait like a worker's)
                raise GenpipeUnavailable(
                    f"genpipe client: could not find where to read {self.reply_topic} from ({exc}): does every "
                    f"partition of it have a leader? (a broker of the cluster may be away; try again once it "
                    f"is back)", public_message="the results could not be read (a Kafka broker may be away)") from exc
            raise
        self._producer, self._consumer = producer, consumer
        self._closed = None
        self._dispatcher = asyncio.ensure_future(self._dispatch())

    async def close(self, *, cancel_waiting: bool | None = None) -> None:
        """Stop the client. Requests still waiting for their answers are cancelled first
        (`cancel_waiting`; None: unless `cancel_on_abandon=False`), as a reader that gives
        up cancels its own: their readers then raise, with the producer gone, and the
        requests ran on for nobody. Cancels already under way (`cancel_soon`) go out too,
        and the producer's records: all within one wait, `CLOSE_WAIT_S` (the producer's stop
        dropped those cancels; and waits one after another, with Kafka away, made a
        gateway's stop pass an orchestrator's grace period)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSE_WAIT_S
        if cancel_waiting is None:
            cancel_waiting = self.cancel_on_abandon
        if cancel_waiting and self._producer is not None:
            for rid, mailbox in list(self._waiting.items()):
                if mailbox.started and not mailbox.answered and not mailbox.overflowed:
                    self.cancel_soon(rid, "the client closed")
        while self._background and loop.time() < deadline:  # (a cancel may start while we wait)
            await asyncio.wait(set(self._background), timeout=deadline - loop.time())
        if self._background:  # (each one logs its own failure)
            log.warning("could not send %d cancels within %g s of closing", len(self._background), CLOSE_WAIT_S)
        dispatcher, self._dispatcher = self._dispatcher, None
        if dispatcher is not None:
            dispatcher.cancel()
            await asyncio.gather(dispatcher, return_exceptions=True)
        self._fail_waiting(None)
        self._cancels_failed.flush()
        from workers.kafka.clients import stop_consumer, stop_producer

        producer, consumer = self._producer, self._consumer
        self._producer = self._consumer = None
        try:
            if consumer is not None:
                await stop_consumer(consumer, "genpipe client")
        finally:
            if producer is not None:  # (what is left of the wait; a second at least)
                await stop_producer(producer, max(1.0, deadline - loop.time()), "genpipe client")

    @property
    def reader_error(self) -> BaseException | None:
        """Why the reader of the reply topic stopped, once it has failed (every request
        then raises); None while it reads, or after a plain close()."""
        return self._closed.error if self._closed is not None else None

    def _fail_waiting(self, error: BaseException | None) -> None:
        self._closed = _Closed(error)
        for mailbox in self._waiting.values():
            mailbox.put(self._closed)

    async def _dispatch(self) -> None:
        from workers.kafka.follow import batches

        try:
            async for records in batches(self._consumer, follow=self.reply_topic):
                for message in records:
                    if message.key is None:
                        continue
                    mailbox = self._waiting.get(message.key.decode("utf-8", "replace"))
                    if mailbox is not None:
                        mailbox.put(message)
                if records:
                    await asyncio.sleep(0)  # the requests' readers take them before the next poll
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
        """Send a request without waiting for its results (they go to its reply topic:
        this client's, when the request names none and the client has one of its own; it
        went to the shared results topic, in sight of every tenant)."""
        self._require_started()
        if request.reply_topic is None and self.reply_topic != self.settings.topic("results"):
            request = msgspec.structs.replace(request, reply_topic=self.reply_topic)
        await self._send("requests", request, request.request_id)

    async def cancel(self, request_id: str, reason: str = "cancelled by client") -> None:
        """Ask the generate workers to stop a request (it ends with finish_reason=abort)."""
        self._require_started()
        await self._send("cancel", Cancel(request_id=request_id, reason=reason), request_id)

    async def _send(self, role: str, record, request_id: str) -> None:
        from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError, MessageSizeTooLargeError

        topic = self.settings.topic(role)
        try:
            await asyncio.wait_for(self._producer.send_and_wait(
                topic, encode(record), key=request_id.encode(), headers=headers_for(record)), self.send_timeout_s)
        except MessageSizeTooLargeError as exc:  # (the producer's limit, or the topic's): the request's fault
            raise GenpipeError(f"the {role} record of request {request_id} is too large for Kafka ({exc}): send a "
                               f"shorter prompt, or fewer stop strings or ids", "invalid_request_error", code=413,
                               request_id=request_id) from exc
        except (asyncio.TimeoutError, KafkaTimeoutError, KafkaConnectionError) as exc:
            # (other Kafka errors, e.g. a topic the ACLs refuse, are the caller's to see as they are)
            why = "no acknowledgement" if isinstance(exc, asyncio.TimeoutError) else repr(exc)
            raise GenpipeUnavailable(
                f"Kafka at {self.settings.bootstrap_servers} did not take the {role} record of request "
                f"{request_id} within {self.send_timeout_s:g} s ({why}); is it reachable?", request_id=request_id,
                public_message=f"Kafka did not take request {request_id} within {self.send_timeout_s:g} s: "
                               f"genpipe cannot be reached now; retry later") from exc

    # --- receiving -------------------------------------------------------------------

    async def records(self, request: GenerateRequest, *, timeout_s: float | None = None,
                      keepalive_s: float | None = None) -> AsyncIterator[ResultMessage]:
        """Send `request`, then yield its result records, deduplicated, until the final one.

        A record that starts a new attempt after records of an older one were yielded has
        `restart=True`. Raises GenpipeTimeout when no record arrives for the timeout (after
        the send, or after the previous record); error results are yielded, not raised.
        With `keepalive_s`, `KEEPALIVE` is yielded after each such quiet spell (a relay,
        such as the HTTP gateway, sends its client a sign of life). Leaving early (break,
        timeout, an exception) cancels the request unless `cancel_on_abandon=False`.
        """
        self._require_started()
        request = self._prepare(request)
        rid = request.request_id
        if rid in self._waiting:
            raise ValueError(f"request {rid!r} is already in flight on this client")
        if self._closed is not None and self._closed.error is not None:
            raise RuntimeError(f"the client's reader of {self.reply_topic} failed: {self._closed.error}")
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        mailbox = Mailbox(timeout, keepalive_s, self.max_unread,
                          on_overflow=lambda: self.cancel_soon(rid, self._overflow_message(rid, mailbox)))
        self._waiting[rid] = mailbox  # before sending: no result can slip past
        finished = sent = unsure = False
        try:
            try:
                await self.submit(request)
            except (GenpipeUnavailable, asyncio.CancelledError):
                unsure = True  # (not acknowledged in time, or not waited for: Kafka may still take it)
                raise
            sent = True
            mailbox.start()
            filt = AttemptFilter()
            while True:
                message = await mailbox.get()
                if message is KEEPALIVE:
                    yield message
                    continue
                if message is TIMED_OUT:
                    raise self._timed_out(rid, timeout, filt.accepted)
                if message is OVERFLOW:
                    raise GenpipeOverflow(self._overflow_message(rid, mailbox), request_id=rid)
                if isinstance(message, _Closed):
                    if message.error is not None:
                        raise RuntimeError(f"the client's reader of {self.reply_topic} failed: "
                                           f"{message.error}") from message.error
                    raise RuntimeError(f"GenpipeClient closed while request {rid!r} was waiting")
                item = self._accept(filt, rid, message, mailbox.received_at)
                if item is None:
                    continue
                if item.final:
                    finished = mailbox.answered = True
                yield item
                if finished:
                    return
        finally:
            mailbox.close()
            if self._waiting.get(rid) is mailbox:
                del self._waiting[rid]
            # (a reader that fell behind was cancelled when it happened: cancel_soon)
            if (not finished and not mailbox.overflowed and self.cancel_on_abandon and self._producer is not None
                    and (sent or unsure)):
                # (one Kafka refused, as too large, needs none: remembered by generate, a
                # cancel aborted a corrected request sent again with the same id)
                if unsure:
                    # Kafka did not take the request in time (it may still, once back): the
                    # cancel goes in the background, as the caller already waited the send
                    # timeout once (awaited, a second one doubled what `submit` raised after).
                    self.cancel_soon(rid, "client gave up waiting")
                else:
                    try:
                        await self.cancel(rid, "client gave up waiting")
                    except Exception as exc:  # best effort
                        log.debug("could not cancel %s: %s", rid, exc)

    def _accept(self, filt: AttemptFilter, rid: str, message, received_at: float = 0.0) -> ResultMessage | None:
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
            partition=message.partition, offset=message.offset, timestamp=message.timestamp,
            received_at=received_at)

    def _overflow_message(self, rid: str, mailbox: Mailbox) -> str:
        return (f"request {rid}: its reader fell {self.max_unread} result records behind (the client's "
                f"max_unread); the request was given up and cancelled ({mailbox.overflowed} records dropped)")

    def cancel_soon(self, request_id: str, reason: str = "cancelled by client") -> None:
        """`cancel` from code that cannot await: a reader that fell behind (its own task may
        be parked until its HTTP client reads again), a response being torn down. Sent in
        the background; a failure is logged (the request then runs to its end)."""
        if self._producer is None:
            return
        task = asyncio.ensure_future(self.cancel(request_id, reason[:500]))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or self._cancels_failed.log(
            "could not cancel %s: %s", request_id, t.exception()))

    def _timed_out(self, rid: str, timeout: float, received: int, whole: bool = False) -> GenpipeTimeout:
        """`whole`: the deadline of a whole answer (`complete`), not of a record's wait."""
        if whole and received:  # (it was generated, not as fast as the deadline asked)
            what = f"request {rid}: its answer did not come whole within {timeout:g} s, after {received} result records"
            return GenpipeTimeout(f"{what}: give it a longer timeout, or ask for fewer tokens", request_id=rid,
                                  public_message=what)
        what = (f"no result for request {rid} within {timeout:g} s" if received == 0 else
                f"request {rid}: no further result within {timeout:g} s after {received} result record(s)")
        where = (f"are a generate and a derender worker running on topic prefix "
                 f"{self.settings.topic_prefix!r} (bootstrap {self.settings.bootstrap_servers})?")
        if received == 0:
            default = self.settings.topic("results")
            if self.reply_topic != default:
                # (where an answer it cannot see goes: the reply topic was not allowed, or refused it)
                where += (f" If the workers' --reply-topic-pattern does not allow {self.reply_topic!r}, or it "
                          f"refused the answer, the error is on {default!r}: `genpipe tail --topic results "
                          f"--from-beginning --request-id {rid} --until-final` shows it")
        return GenpipeTimeout(f"{what}: {where}", request_id=rid, public_message=what)

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

    async def complete(self, request: GenerateRequest, *, timeout_s: float | None = None,
                       budget: AnswerBudget | None = None) -> ChatCompletion | Completion:
        """Send `request` and return its final `ChatCompletion` / `Completion`.

        For a streamed request the chunks of the winning attempt are assembled into the
        final object (usage only if `include_usage` was asked). A request not streamed
        whose logprobs may not fit one result record (`answer_may_outgrow`, by its
        `max_tokens`, against `max_record_bytes`) is sent streamed and its records
        assembled into the answer one record would have held: one record got a 400
        "result too large" from the derender. It is bounded as its one record would be:
        the whole answer within the timeout (a record's wait alone let it run for ever).
        `budget` bounds the records of an answer assembled from streamed records (a
        one-record answer is bounded by the record limit), shared by the calls given the
        same one: past it, `GenpipeError` (400) and the request is cancelled. Raises
        `GenpipeError` on an error result and `GenpipeTimeout` when the pipeline does not
        answer (`timeout_s`: the wait for each next record, as `records`).
        """
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        whole = None  # a deadline for the whole answer: a switched one's
        if answer_may_outgrow(request, self.max_record_bytes or MAX_RECORD_BYTES):
            request, whole = streamed_inside(request), timeout
        items: list[Result] = []
        counted = budget if request.output.stream else None
        received = 0
        # Left early (an error, the deadline): `records` cancels the request, outside the
        # deadline (inside it, a deadline due meanwhile cut the cancel short)
        async with contextlib.aclosing(self.records(request, timeout_s=timeout)) as records:
            deadline = asyncio.timeout(whole)
            try:
                async with deadline:
                    async for record in records:
                        received += 1
                        if counted is not None and not counted.take(len(record.raw)):
                            raise GenpipeError(f"request {record.request_id}: the answer passed {counted.limit} "
                                               f"bytes: ask for fewer tokens, logprobs or choices, or stream",
                                               "invalid_request_error", code=400, request_id=record.request_id)
                        raise_for_error(record.value, record.request_id)
                        if record.restart:  # (a generate worker died: its new attempt's records from here)
                            items.clear()
                        items.append(record.value)
            except TimeoutError:  # (GenpipeTimeout is one: a record's wait)
                if not deadline.expired():
                    raise
                raise self._timed_out(request.request_id, timeout, received, whole=True) from None
        return assemble(items)


def _error_info(message: str) -> ErrorInfo:
    return ErrorInfo(message=message, type="server_error")


__all__ = [
    "AnswerBudget", "GenpipeClient", "GenpipeError", "GenpipeOverflow", "GenpipeTimeout", "GenpipeUnavailable",
    "Restart",
    "ResultMessage",
    "AttemptFilter", "assemble", "decode_result", "make_request", "render_chat", "render_prompt", "record_json",
    "text_of", "raise_for_error", "load_tokenizer", "Result",
]
