"""Publish steps: the only path by which chunks leave the generate worker (docs/design.md §4).

A publish step takes the final chunks of the requests that ended and the pending tokens
of every request ready to publish, turns them into chunk records (chunks.py) and hands
them to the producer as one batch per partition, all under one lock, so that a partition
receives every request's chunks in seq order. What the broker answers settles the step:
a final chunk acknowledged releases its request's offset (the consumer loop commits past
it); a batch refused for good ends its requests with an error chunk. The steps also tell
the engine's token holder what only this side knows: whether the producer lags, and how
far the chunk policy is stretched while the worker is behind its engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import Callable

import msgspec
from aiokafka.errors import KafkaTimeoutError

from schemas import ChunkError
from workers.generate.chunks import W, ChunkBuilder, ChunkPolicy, Final, InFlight, Pressure
from workers.kafka.offsets import release_when_settled
from workers.kafka.publisher import Publisher
from workers.kafka.records import Outgoing
from workers.log_digest import LogDigest
from workers.metrics import CHUNK_HOLD, CHUNK_STRETCH, ERRORS, PUBLISH_REFUSED, REQUESTS, HistogramBatch, series

log = logging.getLogger(__name__)


class PublishSteps:
    def __init__(self, publisher: Publisher, chunks: ChunkBuilder, policy: ChunkPolicy, engine,
                 inflight: dict[str, InFlight], stop_running: Callable[[InFlight], None]):
        self.publisher = publisher
        self.chunks = chunks
        self.policy = policy
        self.engine = engine  # told of lag and stretch (`tune`)
        self.inflight = inflight  # the handler's running requests (read only here)
        self.stop_running = stop_running  # takes a running request out of the worker and the engine
        self.pressure = Pressure()  # how far behind its engine this worker is (chunks.py)
        self._stretched: dict[float, ChunkPolicy] = {}  # the policy by stretch, made once each
        self._stretch = 1.0
        series(CHUNK_STRETCH, W).set(1.0)  # (not 0 before the first change: 1 is "not behind")
        self._lock = asyncio.Lock()
        self.under_way: set[asyncio.Task] = set()  # steps scheduled from code that cannot await
        # The first such step that raised (the chunks topic deleted, this worker no longer
        # allowed to write to it): the worker's next loop turn stops it (`tick`), as one
        # awaited there does. Logged only, the worker ran on with its partitions' offsets
        # held and every request read after it unanswered (aiokafka's own log said
        # "Topic ... not found" ~700 times a second).
        self.failure: BaseException | None = None
        self._ready: list[InFlight] = []  # requests with tokens received, not yet taken (in arrival order)
        self._tuned = (False, 1.0)  # what the engine's token holder was last told (_tune)
        self._hold = HistogramBatch(series(CHUNK_HOLD, W))  # flushed once per publish step
        # Requests ended because their chunks cannot fit a record (many logprobs): a
        # client's requests can come in a flood, a line each (log_digest.py)
        self.too_large_log = LogDigest(log, logging.WARNING, "requests ended with chunks too large")

    def ready(self, state: InFlight) -> None:
        """`state` has pending tokens: the next step takes them."""
        self._ready.append(state)

    def soon(self, finals: list[tuple[InFlight, Final]]) -> asyncio.Task:
        """`run` from code that cannot await (engine outputs, cancels)."""
        task = asyncio.ensure_future(self.run(finals))
        self._track(task)
        return task

    def _track(self, task: asyncio.Task) -> None:
        self.under_way.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.under_way.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("publish step failed: %r; its requests are not committed, the partitions' next owner "
                      "redoes them", task.exception())
            if self.failure is None:
                self.failure = task.exception()

    async def run(self, finals: list[tuple[InFlight, Final]]) -> None:
        """Publish the final chunks of requests that ended, and the tokens every other
        request received, as one producer batch per partition (many single sends cost
        several times more)."""
        async with self._lock:
            policy = self._policy_now()
            self._tune(policy)
            hold = self._hold.observe  # the oldest token's wait, per chunk taken
            now = time.monotonic()
            records, owners = [], []
            for state, final in finals:
                state.closed = True
                if state.pending_ids:
                    hold(now - state.pending_since)
                taken = self._take_records(state, final, policy.max_tokens)
                if final.finish_reason != "error":  # errors were counted as "invalid" when rejected
                    series(REQUESTS, W, taken[-1].value.finish_reason).inc()  # "error" if too large
                records.extend(taken)
                owners.extend([None] * (len(taken) - 1) + [state])  # the final chunk's ack releases
            ready, self._ready = self._ready, []
            inflight = self.inflight
            for state in ready:
                if state.closed or not state.pending_ids or inflight.get(state.request.request_id) is not state:
                    continue  # ended: above, or by a publish step that comes next, with its final chunk
                hold(now - state.pending_since)
                taken = self._take_records(state, None, policy.max_tokens)
                records.extend(taken)  # the last one is final if the request just failed
                owners.extend([None] * (len(taken) - 1) + [state if state.closed else None])
            self.chunks.count_taken()
            self._hold.flush()
            futures = await self.publisher.publish_batch(records) if records else []
        self._settle_when_answered(records, futures, owners)

    def _settle_when_answered(self, records: list[Outgoing], futures: list[asyncio.Future],
                              owners: list[InFlight | None]) -> None:
        """Once the broker answers each producer batch of a step: acknowledged, the
        requests whose final chunk it carries are done (their offsets released); refused
        for good, see `_refused`. One callback per batch (a partition's), not per record."""
        finals: dict[asyncio.Future, list[InFlight]] = {}
        for future, state in zip(futures, owners):
            if state is not None:
                finals.setdefault(future, []).append(state)
        for future in dict.fromkeys(futures):
            future.add_done_callback(partial(self._answered, records, futures, finals.get(future, ())))

    def _answered(self, records: list[Outgoing], futures: list[asyncio.Future], finals: list[InFlight],
                  future: asyncio.Future) -> None:
        if future.cancelled():
            return
        exc = future.exception()
        if exc is None:
            for state in finals:
                state.release()
        elif not isinstance(exc, KafkaTimeoutError):  # (dropped at shutdown: the next owner redoes them)
            self._refused([r for r, f in zip(records, futures) if f is future], finals, exc)

    def _refused(self, records: list[Outgoing], finals: list[InFlight], exc: BaseException) -> None:
        """The broker refused a batch of chunks for good (the chunks topic's
        `max.message.bytes` lowered below them while the worker runs, its ACLs changed):
        retrying is no use. Each of its requests still open here (running, or ended by a
        final chunk in the batch) ends with an error chunk in place of its first refused
        one (`in_place_of_refused`), and its offset is released once that is settled.
        Before, a refused final chunk kept its request's offset held for good (the
        partition committed no further) and its client got no answer, and a running
        request's engine slot went on generating for nobody. A request that ended in a
        later batch is left to the derender, which ends it at the seq gap. The broker
        refuses a whole batch: other requests of the partition's in it end too."""
        series(PUBLISH_REFUSED, W).inc(len(records))
        ended = {state.request.request_id: state for state in finals}
        first_of: dict[str, Outgoing] = {}
        for record in records:
            first_of.setdefault(record.key, record)
        for request_id, first in first_of.items():
            state = ended.get(request_id)
            if state is None:
                state = self.inflight.get(request_id)
                if state is None or state.closed or state.attempt != first.value.attempt:
                    continue
                series(REQUESTS, W, "error").inc()
                self.stop_running(state)
            series(ERRORS, W).inc()
            log.error("request %s: %s refused its chunks from seq %d on for good (%r); ending it with an error",
                      request_id, first.topic, first.value.seq, exc)
            self._track(asyncio.ensure_future(self._end_refused(in_place_of_refused(first, exc), state)))

    async def _end_refused(self, record: Outgoing, state: InFlight) -> None:
        """Whatever the broker says to the error chunk, the request's offset goes (refused
        too, the publisher logs it; the derender then never sees the request end, and keeps
        its state: docs/design.md §5.5).
        So does it when the publisher will not take the chunk at all (its topic gone:
        TopicUnavailable; a KafkaError at once): held, the offset would stop its
        partition's commits for good."""
        try:
            future = await self.publisher.publish(record)
        except Exception as exc:  # (KafkaError, TopicUnavailable: nothing was sent)
            log.error("request %s: its error chunk could not be sent either (%r); its offset is released",
                      state.request.request_id, exc)
            state.release()
            return
        release_when_settled(future, state.release)

    def _tune(self, policy: ChunkPolicy) -> None:
        """Tell the engine's token holder what only this side knows, when it changes."""
        tuning = (self.publisher.in_flight >= policy.lag_threshold, self._stretch)
        if tuning != self._tuned:
            self._tuned = tuning
            try:
                self.engine.tune(*tuning)
            except RuntimeError:  # the engine process is gone: `tick` reports its failure
                pass

    def _policy_now(self) -> ChunkPolicy:
        """The chunk policy stretched for how far behind its engine the worker is now."""
        stretch = self.policy.stretch(self.pressure.value)
        if stretch != self._stretch:
            self._stretch = stretch
            series(CHUNK_STRETCH, W).set(stretch)
        policy = self._stretched.get(stretch)
        if policy is None:
            policy = self._stretched[stretch] = self.policy.stretched(stretch)
        return policy

    def _take_records(self, state: InFlight, final: Final | None, max_tokens: int) -> list[Outgoing]:
        """The request's pending tokens as chunk records (chunks.py); a request whose next
        chunk cannot fit the record limit ends here with an error chunk."""
        records, too_large = self.chunks.take(state, final, max_tokens)
        if too_large is not None:
            self.too_large_log.log("request %s: %s", state.request.request_id, too_large)
            series(ERRORS, W).inc()
            if not state.closed:  # still generating: stop it here
                series(REQUESTS, W, "error").inc()
                self.stop_running(state)
            state.closed = True
        return records


def in_place_of_refused(first: Outgoing, exc: BaseException) -> Outgoing:
    """The error chunk that ends a request in place of its chunks the broker refused for
    good, `first` the earliest of them: the same seq and token offset, no tokens, so the
    derender answers the request with this error (a server error: the deployment's topic,
    not the request, is at fault). The seq-0 fields stay, but the prompt's logprobs (the
    likely cause)."""
    message = (f"the chunks topic {first.topic!r} refused this request's chunk for good ({exc}); "
               f"ask the operator to check its max.message.bytes against the generate workers' "
               f"--max-record-bytes, and its ACLs")
    error = msgspec.structs.replace(first.value, token_ids=[], logprobs=None, prompt_logprobs=None,
                                    finish_reason="error", stop_token_id=None,
                                    error=ChunkError(message=message, type="server_error"))
    return Outgoing(first.topic, first.key, error, partition=first.partition)
