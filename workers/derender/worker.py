"""The derender worker's Kafka logic: chunks in, OpenAI results out (docs/design.md §5.5).

The pure state machine (`Derenderer`) does the work; this handler feeds it records in
partition order, publishes its outputs, and keeps the commits honest:

- offsets: per partition, commit the first offset of the oldest unfinished request (or
  the next offset), so a new owner rebuilds every open request by replaying its chunks;
- replay: the commit metadata records how far results were already published
  (`published=<offset>`); records below that are re-processed to rebuild state, but
  their results are not published again.

What the producer's answers settle, and the errors sent in place of refused results:
delivery.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import msgspec
from aiokafka import TopicPartition

from schemas import JSON, MSGPACK, Cancel, ErrorResponse, GenerateChunk, RecordError
from schemas.validation import ANSWERABLE_ID_CHARS
from workers.derender.chunk_rules import unanswerable_id
from workers.derender.delivery import Delivery, Sent
from workers.derender.stalls import DEFAULT_STALLED_REQUEST_S, StalledRequests
from workers.derender.state import CancelRequest, Derenderer, Output, Result
from workers.derender.undeliverable import answer_on_default_topic, within_record_limit
from workers.kafka.loop import Handler
from workers.kafka.offsets import OffsetTracker, PartitionOffsets, Release, release_when_settled
from workers.kafka.publisher import REBALANCE_WAIT_S, Publisher
from workers.kafka.records import Outgoing, decode_message
from workers.kafka.reply_topics import ReplyTopicRule, reply_topic_rule
from workers.kafka.settings import KafkaSettings
from workers.kafka.topic_metadata import key_partition
from workers.log_digest import LogDigest
from workers.metrics import (CHUNKS, DERENDER_LATENCY, DLQ, ERRORS, IN_FLIGHT, REPLY_REFUSED, REQUESTS, RESULTS,
                             TOKENS, HistogramBatch, series)

W = "derender"  # metrics label

log = logging.getLogger(__name__)

METADATA_PREFIX = "published="


def parse_published(metadata: str | None) -> int:
    """`published=<offset>` → offset; anything else → 0 (publish everything)."""
    if metadata and metadata.startswith(METADATA_PREFIX):
        try:
            return int(metadata[len(METADATA_PREFIX):])
        except ValueError:
            pass
    return 0


class DerenderHandler(Handler):
    def __init__(self, settings: KafkaSettings, publisher: Publisher, offsets: PartitionOffsets,
                 derenderer: Derenderer, reply_rule: ReplyTopicRule | None = None,
                 stalled_request_s: float = DEFAULT_STALLED_REQUEST_S):
        self.settings = settings
        self.publisher = publisher
        self.offsets = offsets
        self.derenderer = derenderer
        self.reply_rule = reply_rule or reply_topic_rule(settings.topic_prefix)
        self.results_topic = settings.topic("results")
        self.cancel_topic = settings.topic("cancel")
        # open request -> its partition and the release of its first chunk's offset
        self.request_start: dict[str, tuple[TopicPartition, Release]] = {}
        # finished request whose last results are not acknowledged yet -> its partition and
        # the release that says they are (`_answering`)
        self._unanswered: dict[str, tuple[TopicPartition, Release]] = {}
        # Results of handled chunks not yet handed to the producer: (records, partition,
        # chunk offset, request_id if the chunk finished its request); see _publish_pending.
        self._pending: list[tuple[list[Outgoing], TopicPartition, int, str | None]] = []
        self._pending_records = 0
        self._late_publish: asyncio.Future | None = None  # see on_revoked
        # What the producer's answers settle, refusals answered included (delivery.py): a
        # reply topic's refusals are answered and said there, not logged by the publisher.
        publisher.own_topics = frozenset((self.results_topic, self.cancel_topic))
        self.delivery = Delivery(publisher, derenderer, self.results_topic, self.cancel_topic, self._outgoing,
                                 lambda rid: self._answering(rid) if rid in self.request_start else None)
        # The per-chunk metrics, looked up once (a labelled lookup per chunk showed in profiles).
        self._chunks, self._tokens, self._results = series(CHUNKS, W), series(TOKENS, W), series(RESULTS, W)
        self._in_flight = series(IN_FLIGHT, W)
        # chunks, tokens, results (and the latencies) since the last loop turn: added to
        # the metrics once a turn, not per chunk (each inc takes a lock; three per chunk
        # showed in profiles).
        self._latency = HistogramBatch(series(DERENDER_LATENCY, W))
        self._counts = [0, 0, 0]
        self._tps: dict[int, TopicPartition] = {}  # by partition: one per partition, not per chunk
        self.published = self.delivery.published  # records whose results are acked, by partition
        self.publish_from: dict[TopicPartition, int] = {}  # replay: below this, results went out before
        # Requests whose chunks stopped coming, by their partitions' log time (stalls.py).
        self.stalls = StalledRequests(stalled_request_s) if stalled_request_s > 0 else None
        self._stall_check = self.stalls.chunk if self.stalls is not None else None  # (once per chunk)
        self._stalled_log = LogDigest(log, logging.WARNING, "requests ended as stalled")

    async def handle(self, message) -> None:
        tp = self._tps.get(message.partition)
        if tp is None or tp.topic != message.topic:
            tp = self._tps[message.partition] = TopicPartition(message.topic, message.partition)
        published = self.published.get(tp)
        if published is None:
            published = self.published[tp] = OffsetTracker()
        # `published` sees the record once its results are held there (below): the commit
        # metadata must not say "published" past a chunk whose handling still waits (a
        # reply topic's lookup), or its next owner would replay it quietly and never
        # publish them.
        try:
            chunk = decode_message(message, GenerateChunk)
            if len(chunk.request_id) > ANSWERABLE_ID_CHARS:
                raise RecordError(unanswerable_id(chunk))
        except RecordError as exc:
            published.seen(message.offset)
            if message.offset >= self.publish_from.get(tp, 0):  # (a replay's copy went before, and was counted)
                series(DLQ, W).inc()
                # Held in `published` too, till the copy is answered: with the commit metadata
                # saying "published" past a copy still on its way, the partition's next
                # owner replayed the chunk quietly, and a copy lost at shutdown was lost.
                release, offset = self.offsets.hold(message), message.offset
                published.hold(offset)
                release_when_settled(await self.publisher.to_dlq(message, str(exc)),
                                     lambda: (release(), published.release(offset)))
            return
        self._counts[0] += 1
        self._counts[1] += len(chunk.token_ids)
        rid = chunk.request_id
        replaying = message.offset < self.publish_from.get(tp, 0)  # (its results went out before)
        outputs = self.derenderer.process(chunk)
        limit_of = None
        for output in outputs:  # (a coroutine per chunk only when a reply topic needs checking)
            if type(output) is Result and output.reply_topic and output.reply_topic != self.results_topic:
                outputs = await self._reply_topics_checked(outputs, replaying)
                if self.offsets.get(tp) is None or self.published.get(tp) is not published:
                    # Revoked (and maybe assigned again) while the lookup waited: the
                    # partition's owner reads this chunk again (no commit passed it), so
                    # nothing of it is published or held here, and the state it started goes.
                    self.derenderer.forget([rid])
                    self.request_start.pop(rid, None)
                    return
                limit_of = self.publisher.record_limit  # (its max.message.bytes may be lower)
                break
        records = self._records(outputs, tp, limit_of, quiet=replaying)
        if rid not in self.request_start and (records or self.derenderer.is_active(rid)):
            # Pins the commit until the request is finished and its results acknowledged;
            # a request answered by this one chunk too (an error, max_tokens 1): the commit
            # went past it before its result was acknowledged, lost if the worker then died.
            self.request_start[rid] = (tp, self.offsets.hold(message))
        published.seen(message.offset)
        active = self.derenderer.is_active(rid)
        finished = rid in self.request_start and not active
        if self._stall_check is not None:
            stalled = self._stall_check(message.partition, rid, message.timestamp, active)
            if stalled:
                self._end_stalled(stalled, tp, message.offset, replaying, published)
        if replaying:
            if finished:
                self.request_start.pop(rid)[1]()
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

    def _end_stalled(self, stalled: list[str], tp: TopicPartition, offset: int, replaying: bool,
                     published: OffsetTracker) -> None:
        """End the requests whose chunks stopped coming (stalls.py): an error result and a
        cancel each, published with the chunk at `offset` (whose log time found them: a
        replay of the partition finds them at the same chunk), and each one's first chunk
        released once they are acknowledged, so the partition commits on."""
        timeout_s = self.stalls.timeout_ms / 1000
        for rid in stalled:
            outputs = self.derenderer.end_stalled(rid, timeout_s)
            if replaying:
                start = self.request_start.pop(rid, None)
                if start is not None:
                    start[1]()
                continue
            if not outputs:
                # Finished meanwhile another way, with its hold still here: it goes now, as
                # it would have with a later chunk of it. (A safety net: the ways known,
                # such as an error in place of a refused result, release it themselves.)
                if rid in self.request_start:
                    self._pending.append(([], tp, offset, rid))
                continue
            series(REQUESTS, W, "stalled").inc()
            series(ERRORS, W).inc()
            self._stalled_log.log("request %s: no chunk for %g s of partition %d's log time; ended with an error "
                                  "result and a cancel", rid, timeout_s, tp.partition)
            # A request not streamed published nothing yet, so its reply topic was never
            # held to the deployment's rule (a seq 0 from another producer may name any).
            topic = outputs[0].reply_topic
            if topic and topic != self.results_topic and self.reply_rule.problem(topic) is not None:
                outputs = [msgspec.structs.replace(o, reply_topic=None) if type(o) is Result else o for o in outputs]
            records = self._records(outputs, tp)
            published.hold(offset)
            self._counts[2] += 1
            self._pending.append((records, tp, offset, rid))
            self._pending_records += len(records)

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
        """Publish the results of the chunks handled since the last call as one producer
        batch per topic partition (many single sends cost several times more:
        BENCHMARKS.md, "Throughput"), a known reply topic's too; a failure to send to a
        reply topic fails its records' futures, answered as refused (delivery.py).
        Cancels go in them too (on their keys' partitions: `_outgoing`); results for a
        reply topic not known yet go one by one. Called every loop turn (tick), before a
        revoke and at shutdown, and when 500 records wait."""
        late = self._late_publish
        if late is not None:  # a revoke's, that outlived its wait: what it holds goes first
            self._late_publish = None
            await late
        self._count()
        delivery = self.delivery
        if delivery.refused:
            await delivery.answer_refused()
        pending, self._pending, self._pending_records = self._pending, [], 0
        if not pending:
            return
        results_topic = self.results_topic
        batched = self._batched_rule()
        batch = [r for records, tp, _, _ in pending for r in records if batched(r)]
        batch_futures = iter(await self.publisher.publish_batch(batch, own_topics=(results_topic, self.cancel_topic))
                             if batch else ())
        # What each batch future's ack settles, with one callback per future (a producer
        # batch holds many chunks' results) rather than one per chunk.
        by_future: dict[asyncio.Future, Sent] = {}
        for records, tp, offset, finished_rid in pending:
            release = self._answering(finished_rid) if finished_rid in self.request_start else None
            if len(records) == 1 and batched(records[0]):
                acked = next(batch_futures)  # the usual chunk: one result, in a batch
                sent = by_future.get(acked)
                if sent is None or sent.tp != tp:
                    if sent is not None:  # (a reply topic with fewer partitions: chunk partitions share a batch)
                        acked.add_done_callback(sent.settled)
                    sent = by_future[acked] = Sent(delivery, tp, acked)
                sent.offsets.append(offset)
                sent.records.append(records[0])
                if release is not None:
                    sent.releases.append(release)
            elif records:
                futures = [next(batch_futures) if batched(r) else await delivery.publish(r, tp) for r in records]
                # Settled once every record of this chunk is: a result and a cancel go to
                # different topics, and the cancel's ack says nothing of the result's.
                sent = Sent(delivery, tp)
                sent.offsets.append(offset)
                sent.records, sent.futures = records, futures
                if release is not None:
                    sent.releases.append(release)
                sent.when_settled()
            elif release is not None:  # a finished request whose chunk had nothing to publish
                release()
        for future, sent in by_future.items():
            future.add_done_callback(sent.settled)
        self._in_flight.set(len(self.request_start))

    def _answering(self, rid: str) -> Release:
        """The hold of finished request `rid`, whose last results go to the producer now:
        to be released once they are acknowledged. Till then it is `_unanswered`, so that a
        revoke forgets it (on_revoked)."""
        tp, release = self.request_start.pop(rid)

        def answered() -> None:
            if self._unanswered.get(rid) is entry:
                del self._unanswered[rid]
            release()
        entry = self._unanswered[rid] = (tp, answered)
        return answered

    def _batched_rule(self) -> Callable[[Outgoing], bool]:
        """Whether a record goes in `_publish_pending`'s producer batches: a result (it has
        a partition) for the results topic, or for a reply topic whose partitions are known
        (one with fewer than the chunks topic: the publisher hashes the key), or a cancel
        given its partition (`_outgoing`). Each topic is looked at once a call, so the rule
        holds through the call."""
        results_topic, publisher = self.results_topic, self.publisher
        counts: dict[str, int] = {}

        def batched(record: Outgoing) -> bool:
            topic, partition = record.topic, record.partition
            if partition is None:
                return False
            if topic == results_topic:
                return True
            count = counts.get(topic)
            if count is None:
                count = counts[topic] = publisher.known_partitions(topic)
            return count > 0
        return batched

    async def tick(self) -> None:
        await self.publisher.fail_records_of_deleted_topics()  # (a reply topic deleted mid-stream)
        await self._publish_pending()

    async def _reply_topics_checked(self, outputs: list[Output], replaying: bool) -> list[Output]:
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
                    if not replaying:  # (its first reading counted and said it)
                        self.derenderer.answered_with_errors.log("request %s: %s", output.request_id, problem)
                        series(REPLY_REFUSED, W).inc()
                    checked.extend(answer_on_default_topic(self.derenderer, output, problem))
                    continue
            checked.append(output)
        return checked

    def _records(self, outputs: list, tp: TopicPartition, limit_of: Callable[[str], int] | None = None,
                 quiet: bool = False) -> list[Outgoing]:
        # Sized on replays too (records below `publish_from`), so state is rebuilt the same
        # way; `quiet` there (the first reading said what it found).
        return [record for _, record in within_record_limit(
            self.derenderer, outputs, lambda output: self._outgoing(output, tp), self.publisher.max_record_bytes,
            limit_of, quiet)]

    def _outgoing(self, output, tp: TopicPartition) -> Outgoing:
        if isinstance(output, CancelRequest):
            # On its key's partition, as the producer's partitioner would put it (every
            # generate worker reads them all), so it goes in the turn's producer batches
            # with the results: sent alone, a cancel cost 4-20 µs more CPU (BENCHMARKS.md,
            # "Cancels in the derender's batches"). Topic not known (looked up again after
            # it went away): sent alone, where the producer's partitioner puts it.
            count = self.publisher.known_partitions(self.cancel_topic)
            return Outgoing(self.cancel_topic, output.request_id,
                            Cancel(request_id=output.request_id, reason=output.reason), MSGPACK,
                            partition=key_partition(output.request_id, count) if count else None)
        # The default results topic shares the chunk topic's partition count: keep the
        # request on its partition number. A reply topic may have fewer (the publisher
        # then falls back to key hashing).
        return Outgoing(output.reply_topic or self.results_topic, output.request_id, output.value, JSON,
                        headers=output.headers, partition=tp.partition)

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
        # Finished work goes out before the loop commits, but the wait is bounded: with
        # the lanes full (a partition without a leader, 32 MiB waiting: lanes.py) it had
        # no end, and the group's rebalance, every member's, waited with it. What is not
        # handed over by then goes on in the background (the next publish waits for it:
        # results keep their order); it is not acknowledged, so it is not committed.
        publishing = asyncio.ensure_future(self._publish_pending())
        await asyncio.wait((publishing,), timeout=REBALANCE_WAIT_S)
        if publishing.done():
            publishing.result()
        else:
            self._late_publish = publishing
            log.warning("results not handed to the producer within %g s of a rebalance (is the broker reachable? "
                        "does every partition have a leader?): giving the partitions up without them; what is "
                        "not acknowledged is not committed, their next owner redoes it", REBALANCE_WAIT_S)
        revoked = set(partitions)
        if self.stalls is not None:
            for tp in revoked:
                self.stalls.forget(tp.partition)
        dropped = [rid for rid, (tp, _) in self.request_start.items() if tp in revoked]
        # Finished requests whose answers are not acknowledged yet are forgotten too: the
        # loop's commit stays below them, and should the partition come back here, its
        # replay must answer them again. Remembered as finished, they were dropped there,
        # the new commits passed them, and an answer then lost (a lane dropped at
        # shutdown) was lost for good. (Should the first answer arrive after all, the
        # client drops the second by its attempt and seq.)
        unanswered = [rid for rid, (tp, _) in self._unanswered.items() if tp in revoked]
        self.derenderer.forget(dropped + unanswered)
        for rid in dropped:
            del self.request_start[rid]
        for rid in unanswered:
            del self._unanswered[rid]
        # `published`/`publish_from` stay: the loop commits the revoked partitions right
        # after this, with their metadata; on_assigned starts them afresh.

    def wants_pause(self, topic: str) -> bool:
        return self.publisher.in_flight > 10_000  # the producer is far behind: stop fetching

    async def drain(self, deadline: float) -> None:
        self.derenderer.flush_logs()
        self._stalled_log.flush()
        await self.publisher.flush_at_shutdown([asyncio.ensure_future(self._publish_pending())])
