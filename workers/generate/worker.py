"""The generate worker's Kafka logic: requests in, token chunks out (docs/design.md §4).

The shared loop (workers/kafka/loop.py) consumes requests (and bulk requests) and
commits; this handler decodes and validates them, queues them (workers/generate/
admission.py) and admits them to the engine by priority, deadline and arrival, hands
engine outputs to its publish steps (workers/generate/publish_steps.py), which turn them
into chunks, and holds each request's offset until its final chunk is acknowledged, so a
crash re-runs unfinished requests and loses none. Requests finish out of order, so each commit also says which
offsets beyond it are done (workers/kafka/offsets.py); a partition's next owner skips
those. A rebalance that hands a partition back keeps its requests running (§7).
"""

from __future__ import annotations

import asyncio
import logging
import time
from itertools import repeat

import msgspec
from aiokafka import TopicPartition

from schemas import ChunkError, DecodeError, GenerateRequest, ValidationError, peek_address
from schemas.validation import ANSWERABLE_ID_CHARS, MAX_REQUEST_ID_LENGTH
from workers.generate.admission import WaitingQueue
from workers.generate.chunks import W, ChunkBuilder, ChunkPolicy, Final, InFlight
from workers.generate.outputs import StepOutputs
from workers.generate.publish_steps import PublishSteps
from workers.generate.stall import StallWatch
from workers.kafka.loop import Handler
from workers.kafka.offsets import (FinishedAhead, PartitionOffsets, Release, decode_finished, encode_finished,
                                   release_when_settled)
from workers.kafka.publisher import REBALANCE_WAIT_S, Publisher
from workers.kafka.records import decode_message
from workers.kafka.reply_topics import ReplyTopicRule, reply_topic_rule
from workers.kafka.settings import KafkaSettings
from workers.log_digest import LogDigest
from workers.metrics import DLQ, ERRORS, IN_FLIGHT, REQUESTS, TTFT, WAITING, series

log = logging.getLogger(__name__)


def _unanswerable(request_id: str, exc: ValidationError | None = None) -> str:
    return (f"request_id of {len(request_id)} characters (the rule: 1..{MAX_REQUEST_ID_LENGTH}) is too long "
            f"to key an answer by" + (f"; also: {exc}" if exc is not None else ""))


class GenerateHandler(Handler):
    keeps_work = True  # a partition that comes back after a rebalance keeps its requests running

    def __init__(self, settings: KafkaSettings, publisher: Publisher, offsets: PartitionOffsets,
                 engine_thread, *, max_running: int, policy: ChunkPolicy | None = None,
                 reply_rule: ReplyTopicRule | None = None, waiting: WaitingQueue | None = None,
                 bulk_limit: int | None = None, stall: StallWatch | None = None):
        self.settings = settings
        self.reply_rule = reply_rule or reply_topic_rule(settings.topic_prefix)
        self.publisher = publisher
        self.offsets = offsets
        self.engine = engine_thread
        self.max_running = max_running
        self.inflight: dict[str, InFlight] = {}  # in the engine (at most max_running)
        # The running requests that have a deadline_ms, and it: what `tick` checks every
        # loop turn (a scan of every running request was ~3% of the worker's CPU while
        # requests arrived, when the loop turns often).
        self._deadlines: dict[str, int] = {}
        self.waiting: WaitingQueue[InFlight] = waiting or WaitingQueue()  # read, not yet admitted
        self.bulk_topic = settings.topic("requests.bulk")
        # Bulk requests in the engine, at most `bulk_limit`: the rows left over stay free for
        # interactive requests, which then start at the next step instead of waiting for
        # a bulk request to end (the engine does not preempt).
        self.bulk_limit = bulk_limit if bulk_limit is not None else max_running
        self.bulk_running = 0
        self.finished_ahead: dict[TopicPartition, FinishedAhead] = {}  # from the previous owner's commit
        self.steps = PublishSteps(  # the only path by which chunks leave (publish_steps.py)
            publisher, ChunkBuilder(settings.topic("chunks"), publisher.fits, publisher.max_record_bytes),
            policy or ChunkPolicy(), engine_thread, self.inflight, self._stop_running)
        self._idle = asyncio.Event()  # set while nothing is in flight (shutdown waits on it)
        self._idle.set()
        self._draining = False  # shutdown: nothing more is admitted
        self._ttft = series(TTFT, W)
        self.cancelled: dict[str, float] = {}  # request_id -> when; bounded, for late arrivals
        self.stall = stall  # the engine's progress, checked every tick (stall.py); None: not watched
        self._duplicates = LogDigest(log, logging.WARNING, "duplicate requests dropped")  # (a producer's retries)
        # Requests stopped in the engine (`_stop_running`) whose final output has not come
        # back yet, and a new copy of the same record read meanwhile, if any: the copy waits
        # here until the old one's final arrives. The engine's outputs are keyed by
        # request_id: admitted at once (a partition lost and read again from its commit),
        # the old one's held tokens and its abort ended the new copy, with stale tokens,
        # and the new one ran on in the engine for nobody.
        self._ending: dict[str, InFlight | None] = {}

    # --- requests in ------------------------------------------------------------------

    async def handle(self, message) -> None:
        tp = TopicPartition(message.topic, message.partition)
        ahead = self.finished_ahead.get(tp)
        if ahead is not None and ahead.finished(message.offset):
            series(REQUESTS, W, "skipped").inc()  # the previous owner finished it (commit metadata)
            return
        release = self.offsets.hold(message)
        try:
            request = decode_message(message, GenerateRequest)
        except ValidationError as exc:
            request_id, reply_topic = peek_address(message.value, message.headers)
            if request_id is None:  # nobody to answer: keep the bytes for an operator
                await self._to_dlq(message, release, f"invalid request without a readable request_id: {exc}")
            elif len(request_id) > ANSWERABLE_ID_CHARS:
                await self._to_dlq(message, release, _unanswerable(request_id, exc))
            elif request_id in self.inflight or request_id in self.waiting or request_id in self._ending:
                self._drop_copy(request_id, message.offset, release)
            else:
                if reply_topic is not None and self.reply_rule.problem(reply_topic) is not None:
                    reply_topic = None  # (a full request's would be refused too: the default topic)
                await self._reject(InFlight(GenerateRequest(request_id=request_id, prompt_token_ids=[],
                                                            reply_topic=reply_topic), tp, message.offset, release),
                                   str(exc))
            return
        except DecodeError as exc:
            await self._to_dlq(message, release, str(exc))
            return
        if len(request.request_id) > ANSWERABLE_ID_CHARS:
            await self._to_dlq(message, release, _unanswerable(request.request_id))
            return
        if (request.request_id in self.inflight or request.request_id in self.waiting
                or self._ending.get(request.request_id) is not None):  # (a copy queued behind its stopped one)
            self._drop_copy(request.request_id, message.offset, release)
            return
        state = InFlight(request, tp, message.offset, release)
        if request.reply_topic is not None:
            problem = self.reply_rule.problem(request.reply_topic)
            if problem is not None:  # answered on the default results topic, never the named one
                state.request = msgspec.structs.replace(request, reply_topic=None)
                await self._reject(state, problem)
                return
        # Counted "accepted" or "invalid", once: a request that broke a rule below was
        # counted both, and a dropped copy (above) as accepted again.
        if request.request_id in self.cancelled:
            series(REQUESTS, W, "accepted").inc()
            await self._publish_final(state, Final("abort"))
            return
        if _expired(request):
            series(REQUESTS, W, "accepted").inc()
            await self._publish_final(state, _deadline_passed(state))
            return
        try:
            self.engine.validate(request)
        except ValidationError as exc:
            await self._reject(state, str(exc))
            return
        problem = self.steps.chunks.prompt_logprobs_problem(request)
        if problem is not None:
            await self._reject(state, problem)
            return
        series(REQUESTS, W, "accepted").inc()
        if request.request_id in self._ending:
            if self._ending[request.request_id] is None:
                self._ending[request.request_id] = state  # queued once the old copy's final is back
            else:
                self._duplicates.log("request %s already waiting for its stopped copy to end; duplicate at "
                                     "offset %d dropped", request.request_id, message.offset)
                release()
            return
        self.waiting.push(state, tier=1 if tp.topic == self.bulk_topic else 0)
        finals = self._admit()
        if finals:
            await self.steps.run(finals)

    def _admit(self) -> list[tuple[InFlight, Final]]:
        """Move waiting requests into the engine while it has room, best first; returns
        the finals of requests the engine refused (published by the caller)."""
        refused = []
        while len(self.inflight) < self.max_running:
            tier = self.waiting.peek_tier()
            if tier == 1 and self.bulk_running >= self.bulk_limit:
                # bulk's rows are full: the rows kept free go to the best interactive
                # request, behind however many better bulk ones wait
                tier = 0 if self.waiting.by_tier[0] else None
            if tier is None:
                break
            state = self.waiting.pop(tier)
            bulk = state.tp.topic == self.bulk_topic
            try:
                self.engine.add(state.request, validated=True, tier=int(bulk))  # (validated by `handle`)
            except ValidationError as exc:  # e.g. the id is still ending in the engine
                series(REQUESTS, W, "error").inc()  # (counted "accepted" on its way in: this is how it ends)
                series(ERRORS, W).inc()
                refused.append((state, Final("error", ChunkError(message=str(exc)))))
                continue
            self.inflight[state.request.request_id] = state
            if state.request.deadline_ms is not None:
                self._deadlines[state.request.request_id] = state.request.deadline_ms
            self.bulk_running += bulk
            self._idle.clear()
        series(IN_FLIGHT, W).set(len(self.inflight))
        series(WAITING, W).set(len(self.waiting))
        return refused


    def _drop_copy(self, request_id: str, offset: int, release) -> None:
        """The same request id again while a copy of it runs or waits (a producer retry, a
        client re-sending): the first copy answers. Checked before any rule: a copy that
        broke one (a mistyped field, a reply topic the rule refuses) was answered with its
        error, as a new attempt of the id, and the derender ended the running request
        with that error (docs/design.md §8)."""
        self._duplicates.log("request %s already running; duplicate at offset %d dropped", request_id, offset)
        release()

    async def _to_dlq(self, message, release: Release, error: str) -> None:
        series(DLQ, W).inc()
        release_when_settled(await self.publisher.to_dlq(message, error), release)

    async def _reject(self, state: InFlight, error: str) -> None:
        series(REQUESTS, W, "invalid").inc()
        series(ERRORS, W).inc()
        await self._publish_final(state, Final("error", ChunkError(message=error)))

    # --- chunks out -------------------------------------------------------------------

    def on_outputs(self, step: StepOutputs) -> asyncio.Task:
        """Called on the event loop with what the engine handed on from a step; returns the
        publish step it started (the engine's deliveries wait on those: workers/generate/
        service.py). The engine's side holds each request's tokens until its chunk is due
        (workers/generate/token_holder.py), so every token that arrives here is published
        at once: one loop over the step's single new tokens, then its other outputs (a
        request's held tokens, ends, prompt logprobs)."""
        now = time.monotonic()
        inflight = self.inflight
        for request_id, token, entry in zip(step.request_ids, step.token_ids,
                                            step.logprobs if step.logprobs is not None else repeat(None)):
            state = inflight.get(request_id)
            if state is None:
                continue  # stopped on revoke/shutdown: its next owner re-runs it
            pending = state.pending_ids
            if not pending:
                self._first_pending(state, now, now)
            pending.append(token)
            if entry is not None:
                state.pending_logprobs.append(entry)
            state.sampled_at_ns = step.sampled_at_ns
        finals = []
        for out in step.others:
            state = inflight.get(out.request_id)
            if state is None:
                if out.finish_reason is not None and out.request_id in self._ending:
                    self._ended(out.request_id)
                continue
            if out.token_ids:
                if not state.pending_ids:
                    self._first_pending(state, now, out.held_since or now)
                state.pending_ids.extend(out.token_ids)
                if out.logprobs:
                    state.pending_logprobs.extend(out.logprobs)
                state.sampled_at_ns = out.sampled_at_ns
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = out.prompt_logprobs
            if out.finish_reason is not None:
                finals.append((state, out))
        for state, _ in finals:
            self._leave(state)
        ended = [(state, Final(out.finish_reason, stop_token_id=out.stop_token_id)) for state, out in finals]
        if not self._draining:
            ended += self._admit()  # the freed slots, at once
        series(IN_FLIGHT, W).set(len(self.inflight))
        if not self.inflight:
            self._idle.set()
        if step:
            self.steps.pressure.step(len(self.steps.under_way))
        return self.steps.soon(ended)

    def _first_pending(self, state: InFlight, now: float, since: float) -> None:
        """Tokens arrived for a request that had none pending: it is ready to publish (its
        oldest token waiting since `since`), and its very first ones give time to first token."""
        if state.seq == 0 and state.token_offset == 0:
            self._ttft.observe(now - state.received_at)
        state.pending_since = since
        self.steps.ready(state)

    async def _publish_final(self, state: InFlight, final: Final) -> None:
        """A request that ends without reaching the engine (invalid, cancelled, expired)."""
        await self.steps.run([(state, final)])

    # --- cancels, deadlines, timers -------------------------------------------------------

    def cancel(self, request_id: str) -> None:
        if not 1 <= len(request_id) <= MAX_REQUEST_ID_LENGTH:
            return  # no request with that id ever runs; remembering it would cost its size
        self.cancelled[request_id] = time.monotonic()
        if len(self.cancelled) > 100_000:  # forget the oldest half
            for key in list(self.cancelled)[:50_000]:
                del self.cancelled[key]
        if request_id in self.inflight:
            self.engine.abort(request_id, "abort")
        state = self.waiting.remove(request_id)
        if state is not None:
            self.steps.soon([(state, Final("abort"))])

    async def tick(self) -> None:
        if self.engine.failure is not None:
            raise RuntimeError(f"engine failed: {self.engine.failure!r}")
        # The chunks topic (or the DLQ) deleted under the worker (a broken deployment): a
        # publish step raised, or the producer holds its records for good (aiokafka never
        # expires them). Ran on, the worker held its partitions' offsets and answered
        # nothing; it stops instead, committing nothing past them (their next owner redoes them).
        if self.steps.failure is not None:
            raise RuntimeError(f"publishing to {self.steps.chunks.topic} failed: {self.steps.failure!r}")
        for topic in await self.publisher.deleted_topics():
            if topic in (self.steps.chunks.topic, self.publisher.dlq_topic):
                raise RuntimeError(f"publishing to {topic} failed: the topic was deleted")
        if self.stall is not None and (stuck := self.stall.stuck(len(self.inflight), bool(self.steps.under_way))):
            raise RuntimeError(stuck)
        now_ms = time.time() * 1000
        for request_id, deadline_ms in self._deadlines.items():
            if deadline_ms <= now_ms:  # (the engine ends it: its final output comes, _leave forgets it)
                self.engine.abort(request_id, "abort")
        finals = [(state, _deadline_passed(state)) for state in self.waiting.expired(now_ms)]
        if not self._draining:
            finals += self._admit()
        await self.steps.run(finals)

    def wants_pause(self, topic: str) -> bool:
        if self._draining or self.waiting.full():
            return True
        if topic == self.bulk_topic:
            # Bulk work is read only while no interactive request waits here, and only about
            # as much as keeps the engine busy (plus what one fetch brings); an interactive
            # request is read at once and, at equal priority, admitted first
            # (docs/design.md §4, "Scheduling").
            return self.waiting.by_tier[0] > 0 or len(self.waiting) >= self.max_running
        return False

    def commit_metadata(self, tp: TopicPartition) -> str:
        tracker = self.offsets.get(tp)
        return encode_finished(tracker) if tracker is not None else ""

    # --- rebalance, shutdown ------------------------------------------------------------

    async def on_revoked(self, partitions) -> None:
        """Before the loop commits the revoked partitions: let the finals already handed to
        the producer be acknowledged (releasing their offsets), so that a partition that
        moves is not re-run past work that had in fact finished. Running requests go on:
        `on_lost` stops those whose partitions do not come back. The wait is bounded: with
        a partition of the cluster without a leader it had no end, and the group's
        rebalance, every member's, waited with it. Past the bound what was not acknowledged
        is not committed, so the partitions' next owner redoes it (a failure of a step is
        logged: publish_steps.py)."""
        if not await self.publisher.settle(self.steps.under_way, REBALANCE_WAIT_S):
            log.warning("records not acknowledged within %.0f s of a rebalance (is the broker reachable? does every "
                        "partition have a leader?): giving the partitions up without them (%d handed over); what "
                        "was not acknowledged is not committed, their next owner redoes it",
                        REBALANCE_WAIT_S, self.publisher.in_flight)

    async def on_assigned(self, partitions, committed) -> None:
        for tp in partitions:
            done = committed.get(tp)
            ahead = decode_finished(done.offset if done else None, done.metadata if done else None)
            self.finished_ahead[tp] = ahead
            if len(ahead):
                log.info("%s[%d]: %d requests beyond offset %d were finished by the previous owner; skipped",
                         tp.topic, tp.partition, len(ahead), ahead.start)

    async def on_lost(self, partitions) -> None:
        """Partitions another worker owns now: it re-runs their requests, so stop ours
        (no abort chunk) and forget the waiting ones (never started: nothing to undo)."""
        lost = set(partitions)
        for state in list(self.inflight.values()):
            if state.tp in lost:
                self._stop_running(state)
        for request_id, state in self._ending.items():
            if state is not None and state.tp in lost:
                self._ending[request_id] = None  # (a copy waiting for its old one: never started)
        self.waiting.take_all(keep=lambda state: state.tp not in lost)
        for tp in lost:
            self.finished_ahead.pop(tp, None)
        if not self.inflight:
            self._idle.set()

    def _ended(self, request_id: str) -> None:
        """A stopped request's final output is back: a copy read meanwhile queues now (its
        admission follows in the caller), or ends at once if a cancel came for it."""
        state = self._ending.pop(request_id)
        if state is None:
            return
        if request_id in self.cancelled:
            self.steps.soon([(state, Final("abort"))])
        else:
            self.waiting.push(state, tier=1 if state.tp.topic == self.bulk_topic else 0)

    def _leave(self, state: InFlight) -> None:
        del self.inflight[state.request.request_id]
        self._deadlines.pop(state.request.request_id, None)
        self.bulk_running -= state.tp.topic == self.bulk_topic

    def _stop_running(self, state: InFlight) -> None:
        """Take a running request out of the worker and the engine; nothing more of it is
        published (the engine's abort output finds no state, and ends `_ending`'s wait)."""
        state.closed = True
        self._leave(state)
        self._ending[state.request.request_id] = None
        self.engine.abort(state.request.request_id, "abort")
        series(IN_FLIGHT, W).set(len(self.inflight))
        if not self.inflight:
            self._idle.set()

    async def drain(self, deadline: float) -> None:
        """Shutdown (a scale-in): admit nothing more; the waiting requests were never
        started, so they are handed back as they are (held: the last commit stops before
        them, and its metadata tells the next owner what finished beyond); the running
        ones finish if they can before `deadline`."""
        self._draining = True
        self._duplicates.flush()
        self.steps.too_large_log.flush()
        handed_back = self.waiting.take_all()
        if handed_back:
            log.info("shutting down: %d waiting requests handed back to the partitions' next owners", len(handed_back))
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            pass
        await self.publisher.flush_at_shutdown(self.steps.under_way)  # the finals handed over and acknowledged
        if self.inflight:
            log.warning("grace period over: %d requests left for the next owner", len(self.inflight))
            await self.on_lost({state.tp for state in self.inflight.values()})


def _expired(request: GenerateRequest, now_ms: float | None = None) -> bool:
    return request.deadline_ms is not None and request.deadline_ms <= (now_ms or time.time() * 1000)


def _deadline_passed(state: InFlight) -> Final:
    """A request whose deadline_ms passed before it started: an abort that says why."""
    waited = time.monotonic() - state.received_at
    return Final("abort", ChunkError(
        message=f"deadline_ms {state.request.deadline_ms} passed before the request started "
                f"(it waited {waited:.1f} s in the worker's queue)",
        type="timeout"))
