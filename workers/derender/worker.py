"""The derender worker's Kafka logic: chunks in, OpenAI results out (docs/design.md §5.5).

The pure state machine (`Derenderer`) does the work; this handler feeds it records in
partition order, publishes its outputs, and keeps the commits honest:

- offsets: per partition, commit the first offset of the oldest unfinished request (or
  the next offset), so a new owner rebuilds every open request by replaying its chunks;
- replay: the commit metadata records how far results were already published
  (`published=<offset>`); records below that are re-processed to rebuild state, but
  their results are not published again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Callable

import msgspec
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from schemas import JSON, MSGPACK, Cancel, ErrorResponse, GenerateChunk, RecordError
from schemas.headers import HEADER_FINAL
from workers.derender.state import CancelRequest, Derenderer, Output, Result
from workers.kafka.loop import Handler
from workers.kafka.offsets import OffsetTracker, PartitionOffsets, Release, release_when_acked
from workers.kafka.publisher import Publisher, TopicUnavailable
from workers.kafka.records import Outgoing, decode_message
from workers.kafka.reply_topics import ReplyTopicRule, reply_topic_rule
from workers.kafka.settings import KafkaSettings
from workers.metrics import (CHUNKS, DERENDER_LATENCY, DLQ, ERRORS, IN_FLIGHT, REPLY_REFUSED, RESULTS, TOKENS,
                             HistogramBatch, series)

W = "derender"  # metrics label

log = logging.getLogger(__name__)

METADATA_PREFIX = "published="


def within_record_limit(derenderer: Derenderer, outputs: list, to_record: Callable[[Output], Outgoing],
                        limit: int) -> list[tuple[Output, Outgoing]]:
    """The derenderer's outputs with their records. A result over `limit` bytes (a long
    non-streamed answer with many logprobs) would be refused by the broker, leaving its
    request unanswered and its offset held: the error result that ends the request
    (`Derenderer.fail`) goes in its place. The worker and `genpipe replay` both apply
    it, so a replay reproduces the worker's records."""
    out = []
    for output in outputs:
        record = to_record(output)
        if isinstance(output, Result) and record.size() > limit:
            message = (f"result too large: {record.size()} bytes, over the record size limit of {limit} "
                       f"bytes; ask for fewer logprobs (a non-streamed answer holds every token's "
                       f"logprobs in one result, a streamed one those of one chunk)")
            log.warning("request %s: %s", output.request_id, message)
            # the request asked for more than a record holds: the client's to change
            out.extend((o, to_record(o)) for o in derenderer.fail(output, message, "invalid_request_error", 400))
        else:
            out.append((output, record))
    return out


def parse_published(metadata: str | None) -> int:
    """`published=<offset>` → offset; anything else → 0 (publish everything)."""
    if metadata and metadata.startswith(METADATA_PREFIX):
        try:
            return int(metadata[len(METADATA_PREFIX):])
        except ValueError:
            pass
    return 0


def answer_on_default_topic(derenderer: Derenderer, result: Result, message: str) -> list[Output]:
    """`result` cannot go to its reply topic (not allowed, missing, refused): end the
    request with an `invalid_request_error` on the default results topic instead, where
    the client's library (or `genpipe tail`) still finds it by request id."""
    return [msgspec.structs.replace(o, reply_topic=None) if isinstance(o, Result) else o
            for o in derenderer.fail(result, message, "invalid_request_error", 400)]


class DerenderHandler(Handler):
    def __init__(self, settings: KafkaSettings, publisher: Publisher, offsets: PartitionOffsets,
                 derenderer: Derenderer, reply_rule: ReplyTopicRule | None = None):
        self.settings = settings
        self.publisher = publisher
        self.offsets = offsets
        self.derenderer = derenderer
        self.reply_rule = reply_rule or reply_topic_rule(settings.topic_prefix)
        self.results_topic = settings.topic("results")
        self.cancel_topic = settings.topic("cancel")
        # open request -> its partition and the release of its first chunk's offset
        self.request_start: dict[str, tuple[TopicPartition, Release]] = {}
        # Results of handled chunks not yet handed to the producer: (records, partition,
        # chunk offset, request_id if the chunk finished its request); see _publish_pending.
        self._pending: list[tuple[list[Outgoing], TopicPartition, int, str | None]] = []
        self._pending_records = 0
        # The per-chunk metrics, looked up once (a labelled lookup per chunk showed in profiles).
        self._chunks, self._tokens, self._results = series(CHUNKS, W), series(TOKENS, W), series(RESULTS, W)
        self._in_flight = series(IN_FLIGHT, W)
        # chunks, tokens, results (and the latencies) since the last loop turn: added to
        # the metrics once a turn, not per chunk (each inc takes a lock; three per chunk
        # showed in profiles).
        self._latency = HistogramBatch(series(DERENDER_LATENCY, W))
        self._counts = [0, 0, 0]
        self._tps: dict[int, TopicPartition] = {}  # by partition: one per partition, not per chunk
        self.published: dict[TopicPartition, OffsetTracker] = {}  # records whose results are acked
        self.publish_from: dict[TopicPartition, int] = {}  # replay: below this, results went out before

    async def handle(self, message) -> None:
        tp = self._tps.get(message.partition)
        if tp is None or tp.topic != message.topic:
            tp = self._tps[message.partition] = TopicPartition(message.topic, message.partition)
        published = self.published.get(tp)
        if published is None:
            published = self.published[tp] = OffsetTracker()
        published.seen(message.offset)
        try:
            chunk = decode_message(message, GenerateChunk)
        except RecordError as exc:
            series(DLQ, W).inc()
            if message.offset >= self.publish_from.get(tp, 0):
                release = self.offsets.hold(message)
                future = await self.publisher.to_dlq(message, str(exc))
                future.add_done_callback(lambda f: release())
            return
        self._counts[0] += 1
        self._counts[1] += len(chunk.token_ids)
        rid = chunk.request_id
        outputs = self.derenderer.process(chunk)
        for output in outputs:  # (a coroutine per chunk only when a reply topic needs checking)
            if type(output) is Result and output.reply_topic and output.reply_topic != self.results_topic:
                outputs = await self._reply_topics_checked(outputs)
                break
        records = self._records(outputs, tp)
        if rid not in self.request_start and self.derenderer.is_active(rid):
            # pins the commit until the request is finished
            self.request_start[rid] = (tp, self.offsets.hold(message))
        replaying = message.offset < self.publish_from.get(tp, 0)
        finished = rid in self.request_start and not self.derenderer.is_active(rid)
        if replaying:
            if finished:
                self._finish(rid, None)
            return
        if records:
            published.hold(message.offset)
            for record in records:
                if not isinstance(record.value, Cancel):
                    self._counts[2] += 1
                    if isinstance(record.value, ErrorResponse):
                        series(ERRORS, W).inc()
            if chunk.sampled_at_ns:
                self._latency.observe(max(0.0, time.time() - chunk.sampled_at_ns / 1e9))
            self._pending.append((records, tp, message.offset, rid if finished else None))
            self._pending_records += len(records)
            if self._pending_records >= 500:
                await self._publish_pending()
        elif finished:  # after the results of its earlier chunks, if they still wait here
            self._pending.append(([], tp, message.offset, rid))

    def _count(self) -> None:
        self._latency.flush()
        counts = self._counts
        if counts[0]:
            self._chunks.inc(counts[0])
            self._tokens.inc(counts[1])
            if counts[2]:
                self._results.inc(counts[2])
            self._counts = [0, 0, 0]

    async def _publish_pending(self) -> None:
        """Publish the results of the chunks handled since the last call, those for the
        default results topic as one producer batch per partition (many single sends cost
        several times more: BENCHMARKS.md, "Throughput"); reply-topic records and cancels
        one by one, as they may fail on their own. Called every loop turn (tick), before
        a revoke and at shutdown, and when 500 records wait."""
        self._count()
        pending, self._pending, self._pending_records = self._pending, [], 0
        if not pending:
            return
        batch = [r for records, tp, _, _ in pending for r in records
                 if r.topic == self.results_topic and r.partition is not None]
        batch_futures = iter(await self.publisher.publish_batch(batch) if batch else ())
        results_topic = self.results_topic
        # Offsets released by each batch future's ack, with one callback per future (a
        # producer batch holds many chunks' results) rather than one per chunk.
        by_future: dict[asyncio.Future, tuple[TopicPartition, list[int]]] = {}
        for records, tp, offset, finished_rid in pending:
            if len(records) == 1 and records[0].topic == results_topic and records[0].partition is not None:
                acked = next(batch_futures)  # the usual chunk: one result, in a batch
                entry = by_future.get(acked)
                if entry is None or entry[0] != tp:
                    if entry is not None:  # (one future per partition: not expected)
                        acked.add_done_callback(functools.partial(self._acked_all, *entry))
                    entry = by_future[acked] = (tp, [])
                entry[1].append(offset)
            else:
                futures = [next(batch_futures) if r.topic == results_topic and r.partition is not None
                           else await self._publish(r, tp) for r in records]
                # Released once every record of this chunk is acknowledged: a result and a cancel
                # go to different topics, and the cancel's ack says nothing of the result's.
                acked = None if not futures else futures[0] if len(futures) == 1 else asyncio.gather(*futures)
                if acked is not None:
                    acked.add_done_callback(functools.partial(self._acked, tp, offset))
            if finished_rid is not None and finished_rid in self.request_start:
                self._finish(finished_rid, acked)
        for future, (tp, offsets) in by_future.items():
            future.add_done_callback(functools.partial(self._acked_all, tp, offsets))
        self._in_flight.set(len(self.request_start))

    async def tick(self) -> None:
        await self._publish_pending()

    async def _reply_topics_checked(self, outputs: list[Output]) -> list[Output]:
        """Results whose reply topic breaks the deployment's rule, or does not exist, become
        an error result on the default topic (generate checks the rule too; a chunk may
        come from elsewhere). Applied on replays too, so state is rebuilt the same way."""
        checked: list[Output] = []
        for output in outputs:
            topic = output.reply_topic if isinstance(output, Result) else None
            if topic and topic != self.results_topic:
                problem = self.reply_rule.problem(topic)
                if problem is None and not await self.publisher.partition_count(topic):
                    problem = (f"reply_topic {topic!r} does not exist (or the derender workers may not "
                               f"write to it): create it first")
                if problem is not None:
                    log.warning("request %s: %s", output.request_id, problem)
                    series(REPLY_REFUSED, W).inc()
                    checked.extend(answer_on_default_topic(self.derenderer, output, problem))
                    continue
            checked.append(output)
        return checked

    async def _publish(self, record: Outgoing, tp: TopicPartition) -> asyncio.Future:
        """Publish; a reply topic that vanished or refuses us since it was checked gets the
        request's error on the default topic instead. Only the deployment's own topics
        may fail the worker: that is a broken deployment, not a bad request."""
        try:
            return await self.publisher.publish(record)
        except (TopicUnavailable, KafkaError) as exc:
            if record.topic in (self.results_topic, self.cancel_topic):
                raise
            log.warning("request %s: publishing to %s failed: %r", record.key, record.topic, exc)
            series(REPLY_REFUSED, W).inc()
            result = Result(record.key, record.topic, record.value, record.headers, HEADER_FINAL in record.headers)
            outputs = answer_on_default_topic(
                self.derenderer, result, f"publishing to reply_topic {record.topic!r} failed: {exc}")
            futures = [await self.publisher.publish(self._outgoing(o, tp)) for o in outputs]
            return futures[0] if len(futures) == 1 else asyncio.gather(*futures)

    def _records(self, outputs: list, tp: TopicPartition) -> list[Outgoing]:
        # Sized on replays too (records below `publish_from`), so state is rebuilt the same way.
        return [record for _, record in within_record_limit(
            self.derenderer, outputs, lambda output: self._outgoing(output, tp), self.publisher.max_record_bytes)]

    def _outgoing(self, output, tp: TopicPartition) -> Outgoing:
        if isinstance(output, CancelRequest):
            return Outgoing(self.cancel_topic, output.request_id,
                            Cancel(request_id=output.request_id, reason=output.reason), MSGPACK)
        # The default results topic shares the chunk topic's partition count: keep the
        # request on its partition number. A reply topic may have fewer (the publisher
        # then falls back to key hashing).
        return Outgoing(output.reply_topic or self.results_topic, output.request_id, output.value, JSON,
                        headers=output.headers, partition=tp.partition)

    def _acked(self, tp: TopicPartition, offset: int, future) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # not published: keep the watermark below it, so a replay publishes again
        tracker = self.published.get(tp)
        if tracker is not None:
            tracker.release(offset)

    def _acked_all(self, tp: TopicPartition, offsets: list[int], future) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # as _acked
        tracker = self.published.get(tp)
        if tracker is not None:
            for offset in offsets:
                tracker.release(offset)

    def _finish(self, request_id: str, last_future) -> None:
        _, release = self.request_start.pop(request_id)
        if last_future is None:
            release()
        else:
            release_when_acked(last_future, release)

    # --- loop hooks ----------------------------------------------------------------------

    def commit_metadata(self, tp: TopicPartition) -> str:
        tracker = self.published.get(tp)
        done = tracker.committable() if tracker is not None else None
        return f"{METADATA_PREFIX}{max(done or 0, self.publish_from.get(tp, 0))}"

    async def on_assigned(self, partitions, committed) -> None:
        for tp in partitions:
            self.publish_from[tp] = parse_published(committed[tp].metadata if tp in committed else None)
            self.published[tp] = OffsetTracker()
            if self.publish_from[tp]:
                log.info("partition %d: results up to offset %d were published before; replaying quietly",
                         tp.partition, self.publish_from[tp])

    async def on_revoked(self, partitions) -> None:
        await self._publish_pending()  # finished work goes out before the loop commits
        revoked = set(partitions)
        dropped = [rid for rid, (tp, _) in self.request_start.items() if tp in revoked]
        self.derenderer.forget(dropped)
        for rid in dropped:
            del self.request_start[rid]
        # `published`/`publish_from` stay: the loop commits the revoked partitions right
        # after this, with their metadata; on_assigned starts them afresh.

    def wants_pause(self, topic: str) -> bool:
        return self.publisher.in_flight > 10_000  # the producer is far behind: stop fetching

    async def drain(self, deadline: float) -> None:
        await self.publisher.flush_at_shutdown([asyncio.ensure_future(self._publish_pending())])
