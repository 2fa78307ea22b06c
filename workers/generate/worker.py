"""The generate worker's Kafka logic: requests in, token chunks out (docs/design.md §4).

The shared loop (workers/kafka/loop.py) consumes requests and commits; this handler
decodes and validates them, feeds the engine thread, turns engine outputs into chunks
(coalescing tokens while the producer lags), and holds each request's offset until its
final chunk is acknowledged, so a crash re-runs unfinished requests and loses none.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import msgspec
from aiokafka import TopicPartition

from schemas import (ChunkError, DecodeError, GenerateChunk, GenerateLogProbs, GenerateRequest,
                     ValidationError, peek_request_id)
from workers.kafka.loop import ConsumerLoop
from workers.kafka.publisher import Publisher
from workers.kafka.records import Outgoing, decode_message
from workers.kafka.reply_topics import ReplyTopicRule, reply_topic_rule
from workers.kafka.settings import KafkaSettings
from workers.metrics import CHUNKS, DLQ, ERRORS, INTER_TOKEN, IN_FLIGHT, REQUESTS, TOKENS, TTFT, series

log = logging.getLogger(__name__)

W = "generate"  # metrics label
PROMPT_TAIL = 8  # prompt ids sent on chunk 0 to seed the detokenizer (docs/design.md §3)


@dataclass
class ChunkPolicy:
    """When to publish a request's pending tokens (docs/design.md §4 coalescing)."""

    lag_threshold: int = 64  # unacknowledged records above which the producer "lags"
    max_tokens: int = 16  # at most this many tokens per chunk while coalescing
    max_delay_s: float = 0.02  # never hold a token longer than this

    def should_flush(self, pending: int, waited_s: float, in_flight: int) -> bool:
        if pending == 0:
            return False
        return in_flight < self.lag_threshold or pending >= self.max_tokens or waited_s >= self.max_delay_s


@dataclass
class InFlight:
    request: GenerateRequest
    tp: TopicPartition
    offset: int
    attempt: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    seq: int = 0
    token_offset: int = 0  # output index of the first pending token
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list = field(default_factory=list)
    pending_since: float = 0.0
    prompt_logprobs: list | None = None
    sampled_at_ns: int | None = None
    closed: bool = False  # the final chunk is taken: nothing may follow it
    received_at: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None


def first_chunk_fields(request: GenerateRequest, prompt_logprobs=None, request_offset: int | None = None) -> dict:
    """What chunk seq 0 carries besides tokens: prompt facts and the pass-through options."""
    return dict(
        prompt_token_count=len(request.prompt_token_ids),
        prompt_tail_ids=request.prompt_token_ids[-PROMPT_TAIL:],
        prompt_logprobs=prompt_logprobs,
        output=request.output,
        reply_topic=request.reply_topic,
        request_offset=request_offset,
    )


class GenerateHandler:
    def __init__(self, settings: KafkaSettings, publisher: Publisher, consumer_loop: ConsumerLoop,
                 engine_thread, *, max_running: int, policy: ChunkPolicy | None = None,
                 reply_rule: ReplyTopicRule | None = None):
        self.settings = settings
        self.reply_rule = reply_rule or reply_topic_rule(settings.topic_prefix)
        self.publisher = publisher
        self.consumer_loop = consumer_loop
        self.engine = engine_thread
        self.max_running = max_running
        self.policy = policy or ChunkPolicy()
        self.chunk_topic = settings.topic("chunks")
        self.inflight: dict[str, InFlight] = {}
        # Taking a chunk (which numbers it) and handing it to the producer happen under
        # one lock, so a partition receives every request's chunks in seq order.
        self._publish_lock = asyncio.Lock()
        self._publishing: set[asyncio.Task] = set()  # publish tasks scheduled from engine outputs
        self._idle = asyncio.Event()  # set while nothing is in flight (shutdown waits on it)
        self._idle.set()
        self.cancelled: dict[str, float] = {}  # request_id -> when; bounded, for late arrivals

    # --- requests in ------------------------------------------------------------------

    async def handle(self, message) -> None:
        tp = TopicPartition(message.topic, message.partition)
        tracker = self.consumer_loop.tracker(tp)
        tracker.hold(message.offset)
        try:
            request = decode_message(message, GenerateRequest)
        except ValidationError as exc:
            request_id = peek_request_id(message.value, message.headers)
            if request_id is None:  # nobody to answer: keep the bytes for an operator
                await self._to_dlq(message, tp, f"invalid request without a readable request_id: {exc}")
            else:
                await self._reject(GenerateRequest(request_id=request_id, prompt_token_ids=[]), tp,
                                   message.offset, str(exc))
            return
        except DecodeError as exc:
            await self._to_dlq(message, tp, str(exc))
            return
        if request.reply_topic is not None:
            problem = self.reply_rule.problem(request.reply_topic)
            if problem is not None:  # answered on the default results topic, never the named one
                await self._reject(msgspec.structs.replace(request, reply_topic=None), tp, message.offset, problem)
                return
        series(REQUESTS, W, "accepted").inc()
        if request.request_id in self.inflight:
            # The same request twice at once (a producer retry): the running one answers.
            log.warning("request %s already running; duplicate at offset %d dropped",
                        request.request_id, message.offset)
            tracker.release(message.offset)
            return
        state = InFlight(request, tp, message.offset)
        if request.request_id in self.cancelled or _expired(request):
            await self._publish_final(state, "abort")
            return
        try:
            self.engine.add(request)
        except ValidationError as exc:
            await self._reject(request, tp, message.offset, str(exc))
            return
        self.inflight[request.request_id] = state
        self._idle.clear()
        series(IN_FLIGHT, W).set(len(self.inflight))

    async def _to_dlq(self, message, tp: TopicPartition, error: str) -> None:
        series(DLQ, W).inc()
        future = await self.publisher.to_dlq(message, error)
        self._release_when_acked(future, tp, message.offset)

    async def _reject(self, request: GenerateRequest, tp: TopicPartition, offset: int, error: str) -> None:
        series(REQUESTS, W, "invalid").inc()
        series(ERRORS, W).inc()
        state = InFlight(request, tp, offset)
        await self._publish_final(state, "error", error=ChunkError(message=error))

    # --- chunks out -------------------------------------------------------------------

    def on_outputs(self, outputs: list) -> None:
        """Called on the event loop with one engine step's outputs."""
        now = time.monotonic()
        finals = []
        for out in outputs:
            state = self.inflight.get(out.request_id)
            if state is None:
                continue  # stopped on revoke/shutdown: its next owner re-runs it
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = out.prompt_logprobs
            if out.token_ids:
                if state.last_token_at is None:
                    series(TTFT, W).observe(now - state.received_at)
                else:
                    series(INTER_TOKEN, W).observe(now - state.last_token_at)
                state.last_token_at = now
                if not state.pending_ids:
                    state.pending_since = now
                state.pending_ids.extend(out.token_ids)
                if out.logprobs is not None:
                    state.pending_logprobs.extend(out.logprobs)
                state.sampled_at_ns = out.sampled_at_ns
            if out.finish_reason is not None:
                finals.append((state, out))
        for state, _ in finals:
            del self.inflight[state.request.request_id]
        series(IN_FLIGHT, W).set(len(self.inflight))
        if not self.inflight:
            self._idle.set()
        task = asyncio.ensure_future(self._publish_step(
            [(state, out.finish_reason, None, out.stop_token_id) for state, out in finals]))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _publish_step(self, finals: list[tuple]) -> None:
        """Publish final chunks — (state, finish_reason, error, stop_token_id) — and every
        request's chunk that is due, as one producer batch per partition (many single
        sends cost several times more). The only path by which chunks leave the worker."""
        async with self._publish_lock:
            records, owners = [], []
            for state, finish_reason, error, stop_token_id in finals:
                state.closed = True
                taken = self._take_records(state, finish_reason, error=error, stop_token_id=stop_token_id)
                if finish_reason != "error":  # errors were counted as "invalid" when rejected
                    series(REQUESTS, W, taken[-1].value.finish_reason).inc()  # "error" if too large
                records.extend(taken)
                owners.extend([None] * (len(taken) - 1) + [state])  # the final chunk's ack releases
            now = time.monotonic()
            for state in list(self.inflight.values()):
                if not state.closed and self.policy.should_flush(
                        len(state.pending_ids), now - state.pending_since, self.publisher.in_flight):
                    taken = self._take_records(state)
                    records.extend(taken)  # the last one is final if the request just failed
                    owners.extend([None] * (len(taken) - 1) + [state if state.closed else None])
            futures = await self.publisher.publish_batch(records) if records else []
        for future, state in zip(futures, owners):
            if state is not None:
                self._release_when_acked(future, state.tp, state.offset)

    async def _flush_ready(self) -> None:
        await self._publish_step([])

    def _take_records(self, state: InFlight, finish_reason=None, **extra) -> list[Outgoing]:
        """All of the request's pending tokens as chunk records; the last carries
        `finish_reason`. A chunk holds at most `policy.max_tokens` tokens: they pile up
        past that while a publish is under way (steps keep coming), and are cut here
        (docs/design.md §4). A chunk over the publisher's record size limit (many logprobs) is cut
        smaller; one that cannot be (a single token's, or the prompt's logprobs) ends the
        request with an error chunk, which the broker would otherwise refuse after the
        work was done, leaving the request unanswered and its offset held for good."""
        size = max(1, self.policy.max_tokens)
        records = []
        while True:
            count = min(size, len(state.pending_ids))
            while True:
                last = count == len(state.pending_ids)
                record = self._outgoing(state, self._chunk(state, count, finish_reason if last else None,
                                                           **(extra if last else {})))
                fits = self.publisher.fits(record)
                if fits or count <= 1:
                    break
                count //= 2
            if not fits:
                records.append(self._too_large(state, record.size()))
                return records
            self._advance(state, count)
            records.append(record)
            if last:
                return records

    def _chunk(self, state: InFlight, count: int, finish_reason=None, **extra) -> GenerateChunk:
        """The first `count` pending tokens as the request's next chunk (state unchanged)."""
        request = state.request
        token_ids = state.pending_ids[:count]
        chunk = GenerateChunk(
            request_id=request.request_id, attempt=state.attempt, seq=state.seq,
            token_offset=state.token_offset, token_ids=token_ids,
            logprobs=(GenerateLogProbs(content=[row.content() for row in state.pending_logprobs[:count]])
                      if request.sampling.logprobs is not None and token_ids else None),
            finish_reason=finish_reason, sampled_at_ns=state.sampled_at_ns or time.time_ns(), **extra)
        if state.seq == 0:
            for name, value in first_chunk_fields(request, state.prompt_logprobs, state.offset).items():
                setattr(chunk, name, value)
        return chunk

    def _advance(self, state: InFlight, count: int) -> None:
        """The chunk of the first `count` pending tokens is taken: number the next one."""
        series(CHUNKS, W).inc()
        series(TOKENS, W).inc(count)
        state.seq += 1
        state.token_offset += count
        del state.pending_ids[:count], state.pending_logprobs[:count]

    def _too_large(self, state: InFlight, size: int) -> Outgoing:
        """End the request: its next chunk cannot be published. The error chunk instead."""
        rid = state.request.request_id
        what = "the prompt's logprobs" if state.seq == 0 and state.prompt_logprobs else "one token's logprobs"
        message = (f"chunk too large: {what} encode to {size} bytes, over the record size limit of "
                   f"{self.publisher.max_record_bytes} bytes; ask for fewer logprobs (or raise the "
                   f"workers' --max-record-bytes together with the broker's message.max.bytes)")
        log.warning("request %s: %s", rid, message)
        series(ERRORS, W).inc()
        if not state.closed:  # still generating: stop it here
            series(REQUESTS, W, "error").inc()
            self._stop_running(state)
        state.pending_ids, state.pending_logprobs, state.prompt_logprobs = [], [], None
        chunk = self._chunk(state, 0, "error", error=ChunkError(message=message))
        self._advance(state, 0)
        return self._outgoing(state, chunk)

    def _outgoing(self, state: InFlight, chunk: GenerateChunk) -> Outgoing:
        # Same partition number as the request: one request's records stay on one
        # partition number end to end (docs/design.md §2), whatever partitioner the client used.
        return Outgoing(self.chunk_topic, state.request.request_id, chunk, partition=state.tp.partition)

    async def _publish_final(self, state: InFlight, finish_reason: str, error: ChunkError | None = None) -> None:
        """A request that ends without reaching the engine (invalid, cancelled, expired)."""
        await self._publish_step([(state, finish_reason, error, None)])

    def _release_when_acked(self, future: asyncio.Future, tp: TopicPartition, offset: int) -> None:
        def release(f: asyncio.Future) -> None:
            if f.cancelled() or f.exception() is not None:
                return  # not acknowledged: keep holding, the next owner re-runs it
            tracker = self.consumer_loop.offsets.get(tp)
            if tracker is not None:
                tracker.release(offset)
        future.add_done_callback(release)

    # --- cancels, deadlines, timers -------------------------------------------------------

    def cancel(self, request_id: str) -> None:
        self.cancelled[request_id] = time.monotonic()
        if len(self.cancelled) > 100_000:  # forget the oldest half
            for key in list(self.cancelled)[:50_000]:
                del self.cancelled[key]
        if request_id in self.inflight:
            self.engine.abort(request_id, "abort")

    async def tick(self) -> None:
        if self.engine.failure is not None:
            raise RuntimeError(f"engine failed: {self.engine.failure!r}")
        for request_id, state in list(self.inflight.items()):
            if _expired(state.request):
                self.engine.abort(request_id, "abort")
        await self._flush_ready()

    def wants_pause(self) -> bool:
        return len(self.inflight) >= self.max_running

    # --- rebalance, shutdown ------------------------------------------------------------

    async def on_assigned(self, partitions, metadata) -> None:
        pass

    async def on_revoked(self, partitions) -> None:
        revoked = set(partitions)
        for state in list(self.inflight.values()):
            if state.tp in revoked:
                self._stop_running(state)  # no abort chunk: the new owner re-runs it
        if not self.inflight:
            self._idle.set()

    def _stop_running(self, state: InFlight) -> None:
        """Take a running request out of the worker and the engine; nothing more of it is
        published (the engine's abort output finds no state)."""
        state.closed = True
        del self.inflight[state.request.request_id]
        self.engine.abort(state.request.request_id, "abort")
        series(IN_FLIGHT, W).set(len(self.inflight))
        if not self.inflight:
            self._idle.set()

    def commit_metadata(self, tp) -> str:
        return ""

    async def drain(self, deadline: float) -> None:
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            pass
        await asyncio.gather(*self._publishing)  # finals handed to the producer
        if self.inflight:
            log.warning("grace period over: %d requests left for the next owner", len(self.inflight))
            await self.on_revoked({state.tp for state in self.inflight.values()})
        await self.publisher.flush()


def _expired(request: GenerateRequest) -> bool:
    return request.deadline_ms is not None and request.deadline_ms <= time.time() * 1000
