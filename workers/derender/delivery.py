"""What the derender handed to the producer, and what its answer settles (docs/design.md §5.5).

An acknowledged record releases its chunk's offset in the partition's `published` tracker
(the commit metadata's watermark) and the holds of the requests it finished. A record the
broker refused for good (a reply topic whose `max.message.bytes` is below it, one the
derender may no longer write to, one deleted) gets its request an error result on the
default results topic in its place, and the holds go once that is acknowledged: without
it the request got no answer and the chunk's offset stayed held, so its partition
committed no further. The worker (workers/derender/worker.py) hands records over; this
module keeps what their answers settle.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from schemas import Cancel
from schemas.headers import HEADER_FINAL
from workers.derender.state import Derenderer, Result
from workers.derender.undeliverable import answer_on_default_topic, refusal_message
from workers.kafka.offsets import OffsetTracker, Release, release_when_settled
from workers.kafka.publisher import Publisher, TopicUnavailable
from workers.kafka.records import Outgoing
from workers.metrics import PUBLISH_REFUSED, REPLY_REFUSED, series

W = "derender"  # metrics label

log = logging.getLogger(__name__)

# Requests already answered with an error because the broker refused one of their results:
# a later refused result of theirs (in the same batch, or sent before the first refusal was
# known) is not answered again.
_ANSWERED_KEPT = 10_000


class Sent:
    """Records handed to the producer for some chunks of one partition, and what their
    acknowledgement settles: the chunks' offsets in `published` and the holds of the
    requests they finished. Refused for good, they wait in `Delivery.refused` for
    `Delivery.answer_refused`."""

    __slots__ = ("delivery", "tp", "shared", "offsets", "records", "futures", "releases", "replacing")

    def __init__(self, delivery: Delivery, tp: TopicPartition, shared: asyncio.Future | None = None,
                 replacing: bool = False):
        self.delivery, self.tp = delivery, tp
        self.shared = shared  # the one future of all `records` (a producer batch), else `futures`
        self.offsets: list[int] = []
        self.records: list[Outgoing] = []
        self.futures: list[asyncio.Future] = []
        self.releases: list[Release] = []
        self.replacing = replacing  # error results sent in place of refused ones

    def futures_of_records(self):
        return zip(self.records, self.futures if self.shared is None else [self.shared] * len(self.records))

    def settled(self, _: asyncio.Future) -> None:
        """Called once every future has its answer (`when_settled`)."""
        futures = self.futures if self.shared is None else (self.shared,)
        if any(f.cancelled() for f in futures):
            return  # (shutdown) not published: the watermark stays below, a replay publishes again
        if all(f.exception() is None for f in futures):
            self.release_all()
        else:
            self.delivery.refused.append(self)

    def when_settled(self) -> None:
        futures = self.futures
        (futures[0] if len(futures) == 1 else asyncio.gather(*futures, return_exceptions=True)).add_done_callback(
            self.settled)

    def release_all(self) -> None:
        tracker = self.delivery.published.get(self.tp)
        if tracker is not None:
            for offset in self.offsets:
                tracker.release(offset)
        for release in self.releases:
            release()


class Delivery:
    """Each partition's tracker of acknowledged results, the refused records waiting for
    their answer, and the requests answered with an error in place of a refused result.
    `to_record(output, tp)` is the worker's: an output of the derenderer as a record."""

    def __init__(self, publisher: Publisher, derenderer: Derenderer, results_topic: str, cancel_topic: str,
                 to_record: Callable[[object, TopicPartition], Outgoing],
                 end_hold: Callable[[str], Release | None] = lambda rid: None):
        self.publisher = publisher
        self.derenderer = derenderer
        self.results_topic = results_topic
        self.cancel_topic = cancel_topic
        self.to_record = to_record
        # The worker's hold of an open request's first chunk, handed over (and forgotten
        # there) when an error in place of a refused result ends the request: it goes once
        # that error is settled. It waited for a later chunk of the request, which may
        # never come (generate stops it on the error's cancel).
        self.end_hold = end_hold
        self.published: dict[TopicPartition, OffsetTracker] = {}  # records whose results are acked
        self.refused: list[Sent] = []  # settled with a refusal, for the next `answer_refused`
        self._answered: dict[str, None] = {}  # request ids, oldest first

    async def answer_refused(self) -> None:
        """Each request whose result the broker refused for good gets an error result on
        the default results topic in its place, and the chunks' holds go once that is
        acknowledged (an error result refused in turn, or a refused cancel, is logged and
        the holds go)."""
        refused, self.refused = self.refused, []
        for sent in refused:
            replacements: list[Outgoing] = []
            ended: list[Release] = []
            for record, future in sent.futures_of_records():
                if future.cancelled() or future.exception() is None:
                    continue
                exc = future.exception()
                series(PUBLISH_REFUSED, W).inc()
                if sent.replacing or isinstance(record.value, Cancel):
                    log.error("request %s: %s refused %s (%r); moving on", record.key, record.topic,
                              "the error result sent in place of a refused one: the request stays unanswered"
                              if sent.replacing else "a cancel", exc)
                    continue
                replacements.extend(self.in_place_of(record, sent.tp, refusal_message(
                    record.topic, self.results_topic, exc, self.publisher.max_record_bytes), ended))
            if not replacements:
                sent.release_all()
                continue
            answer = Sent(self, sent.tp, replacing=True)
            answer.offsets, answer.releases, answer.records = sent.offsets, sent.releases + ended, replacements
            answer.futures = [await self.publisher.publish(record) for record in replacements]
            answer.when_settled()

    async def publish(self, record: Outgoing, tp: TopicPartition) -> asyncio.Future:
        """Publish one record; a reply topic that vanished or refuses us since it was
        checked gets the request's error on the default topic instead. Only the
        deployment's own topics may fail the worker: that is a broken deployment, not a
        bad request."""
        try:
            return await self.publisher.publish(record)
        except (TopicUnavailable, KafkaError) as exc:
            if record.topic in (self.results_topic, self.cancel_topic):
                raise
            ended: list[Release] = []
            replacements = self.in_place_of(record, tp, f"publishing to reply_topic {record.topic!r} failed: {exc}",
                                            ended)
            if not replacements:
                answered = asyncio.get_running_loop().create_future()
                answered.set_result(None)
                return answered
            futures = [await self.publisher.publish(r) for r in replacements]
            settled = futures[0] if len(futures) == 1 else all_answered(futures)
            for release in ended:  # once every record is answered, and none dropped at shutdown
                release_when_settled(settled, release)
            return settled

    def in_place_of(self, record: Outgoing, tp: TopicPartition, message: str, ended: list[Release]) -> list[Outgoing]:
        """The records that end `record`'s request with an error on the default results
        topic, in place of `record`, which its topic will not take; none when an earlier
        record of the request was answered so (same batch, or sent before that was known).
        A request they end (it was open) adds the worker's hold of its first chunk to
        `ended`, to go once they are settled."""
        rid = record.key
        if rid in self._answered:
            log.error("request %s: %s refused a later result of a request already answered with an error; "
                      "moving on", rid, record.topic)
            return []
        self._answered[rid] = None
        if len(self._answered) > _ANSWERED_KEPT:
            del self._answered[next(iter(self._answered))]
        self.derenderer.answered_with_errors.log("request %s: %s; answering on %s", rid, message, self.results_topic)
        if record.topic != self.results_topic:
            series(REPLY_REFUSED, W).inc()
        final = HEADER_FINAL in record.headers or not self.derenderer.is_active(rid)
        if not final:
            release = self.end_hold(rid)
            if release is not None:
                ended.append(release)
        result = Result(rid, record.topic, record.value, record.headers, final)
        return [self.to_record(o, tp) for o in answer_on_default_topic(self.derenderer, result, message)]


def all_answered(futures: list[asyncio.Future]) -> asyncio.Future:
    """A future done once every one of `futures` is: cancelled if one was (dropped at
    shutdown: nothing may be released for it), else failed with the first failure, else
    None. `asyncio.gather` does neither: with return_exceptions it is not cancelled when
    one is (a hold was released for an answer dropped at shutdown), and without, it
    fails at the first failure while the others still wait (the error in place of a
    refused result was taken as answered before its cancel was)."""
    answered = asyncio.get_running_loop().create_future()
    left = [len(futures)]

    def done(_: asyncio.Future) -> None:
        left[0] -= 1
        if left[0] or answered.done():
            return
        if any(f.cancelled() for f in futures):
            answered.cancel()
            return
        failure = next((f.exception() for f in futures if f.exception() is not None), None)
        if failure is not None:
            answered.set_exception(failure)
        else:
            answered.set_result(None)
    for future in futures:
        future.add_done_callback(done)
    return answered
