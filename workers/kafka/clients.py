"""Producer, consumer and admin construction from one KafkaSettings.

The defaults are the ones token streaming needs (docs/design.md §6): idempotent producer
with acks=all and no linger (a token waits for nothing; the generate worker batches a
whole step's chunks itself, and records queue up anyway while a request is in flight);
consumers without auto-commit (workers commit only what is safe, docs/design.md §4/§5.5).

Fetch wait: the broker answers a waiting fetch as soon as a record lands on any of its
partitions, so a long wait costs no latency (measured: 5 and 500 ms give the same token
latency, BENCHMARKS.md); it only bounds how often an idle consumer asks again. At 20 ms
a generate worker's request consumer and cancel follower together asked 100 times a
second, which on a shared box cost the engine ~10% of its tokens/s (engine (c)).
"""

from __future__ import annotations

import asyncio
import logging
import math

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka import client as _aiokafka_client
from aiokafka.admin import client as _aiokafka_admin_client
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka import errors as Errors
from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError

from workers.kafka.settings import KafkaSettings


class _MetadataRequestNoAutoCreate(_aiokafka_client.MetadataRequest):
    """A metadata request that never asks the broker to create the topics it names.

    aiokafka's asks to (`allow_auto_topic_creation`: True), and a broker with Kafka's
    default `auto.create.topics.enable=true` then made any topic a client looked up: `genpipe
    tail --topic resutls`, a reply topic a client had not created yet, made them with the
    broker's default partitions and waited on them, where "does not exist (create it with
    `genpipe topics create`)" was meant (what every test broker, made without
    auto-creation, says). Topics are genpipe's to create, with their partitions."""

    def __init__(self, topics=None, allow_auto_topic_creation: bool = False):
        super().__init__(topics, allow_auto_topic_creation)


_aiokafka_client.MetadataRequest = _aiokafka_admin_client.MetadataRequest = _MetadataRequestNoAutoCreate


# The largest batch of records the producer builds for a partition (a larger record goes in
# a batch of its own): the topics a worker writes must take batches of this size
# (workers/broker/topics.py `record_limit_problems`).
MAX_BATCH_BYTES = 256 * 1024


def make_producer(settings: KafkaSettings, **overrides) -> AIOKafkaProducer:
    options = dict(
        enable_idempotence=True,  # retries never duplicate or reorder a partition's records
        acks="all",
        linger_ms=0,
        max_batch_size=MAX_BATCH_BYTES,
        request_timeout_ms=30000,
    )
    options.update(overrides)
    producer = AIOKafkaProducer(**settings.client_kwargs(), **options)
    if options["enable_idempotence"]:
        keep_batches_until_sent(producer)
        rewind_sequences_of_refused_batches(producer)
    forget_failed_retries_quietly(producer)
    return producer


def keep_batches_until_sent(producer: AIOKafkaProducer) -> None:
    """Never fail a queued batch because its partition has had no leader for a while.

    aiokafka fails a batch that waited its request timeout (30 s) for a partition without
    a leader (a topic with one replica whose broker is away, while the cluster's other
    brokers answer). For an idempotent producer that is worse than the loss: the
    partition's sequence numbers now have a hole, and the broker refuses every later
    batch of this producer to that partition (OutOfOrderSequenceNumber) until the process
    restarts (aiokafka issue #1017). A generate worker's requests then stalled until
    their clients timed out (tests/test_cluster.py, a leaderless partition). aiokafka
    itself never expires an idempotent producer's batch once sent ("retry until we
    succeed", its sender's `_can_retry`); this makes the wait for a leader the same:
    records wait as they do for a broker that is away (workers/kafka/publisher.py
    `_enqueue`), and shutdown bounds the wait (docs/design.md §7)."""
    accumulator = getattr(producer, "_message_accumulator", None)
    if accumulator is None or not isinstance(getattr(accumulator, "_batch_ttl", None), (int, float)):
        # (tests/test_kafka_plumbing.py fails on an aiokafka where this no longer holds)
        logging.getLogger(__name__).warning(
            "this aiokafka has no batch time to live to lift: records for a partition without a leader for "
            "30 s may be lost")
        return
    accumulator._batch_ttl = math.inf


# The broker's answers that mean it did not append the batch and never will: its content is
# refused (too large for the topic, a record it rejects, a policy), or the producer may not
# write there. Only these rewind: a batch that may have been appended (a timeout, a lost
# connection) is retried by aiokafka, never failed, while the producer is idempotent.
_REFUSED_FOR_GOOD = (Errors.MessageSizeTooLargeError, Errors.RecordListTooLargeError,
                     Errors.TopicAuthorizationFailedError, Errors.PolicyViolationError,
                     Errors.InvalidTimestampError, Errors.UnsupportedForMessageFormatError)


def rewind_sequences_of_refused_batches(producer: AIOKafkaProducer) -> None:
    """After the broker refuses a batch for good, number the partition's next batch as if
    the refused one had never been sent.

    An idempotent producer numbers each partition's records when a batch leaves its queue.
    aiokafka keeps the numbers of a batch the broker refused, so the broker, which appended
    nothing, finds a hole and refuses every later batch of this producer to that partition
    (OutOfOrderSequenceNumber) until the process restarts. One result over a reply topic's
    `max.message.bytes` made that reply topic's partition refuse every later result of the
    derender worker (tests/test_reply_topics.py). Java's producer rewinds the same way.
    aiokafka sends one request at a time to a broker, so when a batch fails no later batch
    of its partition has been numbered; if one has (its leader moved meanwhile), nothing
    is rewound and it says so."""
    accumulator = getattr(producer, "_message_accumulator", None)
    txn = getattr(accumulator, "_txn_manager", None)
    pop_batch = getattr(accumulator, "_pop_batch", None)
    if txn is None or pop_batch is None or not isinstance(getattr(txn, "_sequence_numbers", None), dict):
        # (tests/test_kafka_plumbing.py fails on an aiokafka where this no longer holds)
        logging.getLogger(__name__).warning(
            "this aiokafka's producer cannot be rewound: after the broker refuses a batch (a record over a "
            "topic's max.message.bytes), it refuses every later one to that partition until a restart")
        return
    numbers = txn._sequence_numbers

    def numbered_pop_batch(tp):
        before = numbers[tp]
        batch = pop_batch(tp)
        after = numbers[tp]
        if after != before:  # numbered now (a retried batch keeps its numbers)
            batch.future.add_done_callback(lambda f: _rewind(f, tp, before, after))
        return batch

    def _rewind(future, tp, start: int, end: int) -> None:
        if future.cancelled() or not isinstance(future.exception(), _REFUSED_FOR_GOOD):
            return
        if numbers[tp] == end:
            numbers[tp] = start
        else:
            logging.getLogger(__name__).warning(
                "%s: a refused batch left a hole in the producer's sequence numbers that cannot be closed "
                "(later records were numbered meanwhile): the broker refuses this partition's next records "
                "from this process", tp)

    accumulator._pop_batch = numbered_pop_batch


def forget_failed_retries_quietly(producer: AIOKafkaProducer) -> None:
    """No KeyError traceback when a retried batch fails while it waits in its queue.

    aiokafka's accumulator forgets a sent batch when the batch's future ends (a callback
    set in `_pop_batch` removes it from `_pending_batches`). A batch sent, then put back in
    its queue to be retried (`reenqueue`, which already removes it), that fails from the
    queue (`stop()` failing what is left with the broker away, a deleted topic's records:
    publisher.py) made that callback raise KeyError. The worker logged "Exception in
    callback MessageAccumulator._pop_batch.<locals>.cb ... KeyError" at such a shutdown,
    which reads like a crash. Here forgetting a batch already forgotten does nothing."""
    accumulator = getattr(producer, "_message_accumulator", None)
    pending = getattr(accumulator, "_pending_batches", None)
    if type(pending) is set:  # (tests/test_kafka_plumbing.py fails where aiokafka changed this)
        accumulator._pending_batches = _Forgetting(pending)


class _Forgetting(set):
    def remove(self, item) -> None:
        self.discard(item)


# How often a consumer looks up its topics' partitions (aiokafka's default: 5 minutes), and
# so how soon a partition a topic gains (`genpipe topics create --grow`) is read: a group
# rebalances for it, a follower adds it (follow.py `NewPartitions`). One small request.
METADATA_MAX_AGE_MS = 30_000


def make_consumer(settings: KafkaSettings, *topics: str, group_id: str | None, **overrides) -> AIOKafkaConsumer:
    options = dict(
        group_id=group_id,
        metadata_max_age_ms=METADATA_MAX_AGE_MS,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=500,
        max_poll_records=1000,
        session_timeout_ms=30000,
        heartbeat_interval_ms=3000,
        # The model step runs in a thread, so the loop stays responsive; 5 minutes gives
        # a long SIGTERM grace period room before the group evicts us.
        max_poll_interval_ms=300000,
    )
    options.update(overrides)
    return AIOKafkaConsumer(*topics, **settings.client_kwargs(), **options)


def make_admin(settings: KafkaSettings) -> AIOKafkaAdminClient:
    kwargs = settings.client_kwargs()
    return AIOKafkaAdminClient(**kwargs)


class KafkaUnreachable(KafkaConnectionError):
    """A client could not start; the message says why in one line."""

    def __str__(self) -> str:  # aiokafka's errors put their class name in front
        return str(self.args[0]) if self.args else "Kafka unreachable"


_starting = 0  # start_client() calls under way
_saved: tuple[int, bool] = (logging.NOTSET, True)


class _Reasons(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def start_client(client, settings: KafkaSettings) -> None:
    """`await client.start()`, but a failure says why. aiokafka reports a refused login, a
    failed TLS handshake and a broker that is down alike ("Unable to bootstrap"), and
    only logs the reason; it is caught here and named. The client is stopped on failure
    (no "Unclosed AIOKafka..." warning after the message)."""
    global _starting, _saved
    reasons = _Reasons()
    logger = logging.getLogger("aiokafka")
    # While starting, aiokafka's warnings come here only (a command may have silenced
    # them; a worker's log gets the one line that names the reason instead). Starts may
    # overlap: the logger's own settings are saved by the first and restored by the last.
    if _starting == 0:
        _saved = (logger.level, logger.propagate)
    _starting += 1
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    logger.addHandler(reasons)
    try:
        await client.start()
    except KafkaConnectionError as exc:
        await client.stop() if not isinstance(client, AIOKafkaAdminClient) else await client.close()
        raise KafkaUnreachable(_why(settings, reasons.messages, exc)) from exc
    finally:
        logger.removeHandler(reasons)
        _starting -= 1
        if _starting == 0:
            logger.setLevel(_saved[0])
            logger.propagate = _saved[1]


def _why(settings: KafkaSettings, messages: list[str], exc: Exception) -> str:
    where = f"Kafka at {settings.bootstrap_servers}"
    text = " ".join(messages)
    if "SaslAuthenticationFailed" in text or "Authentication failed" in text:
        return (f"{where} refused the login of user {settings.sasl_plain_username!r} "
                f"({settings.sasl_mechanism}): check --sasl-username / --sasl-password")
    if "SSL" in text or "CERTIFICATE" in text.upper():
        detail = next((m for m in messages if "SSL" in m or "certificate" in m.lower()), "")
        return f"TLS with {where} failed: {' '.join(detail.split())[:300]} (check --ssl-cafile and --security-protocol)"
    return (f"cannot reach {where}: {exc} (is the broker up? check --bootstrap-servers / "
            f"GENPIPE_BOOTSTRAP_SERVERS and --security-protocol)")


async def wait_at_most(awaitable, timeout_s: float, not_done: str, then: str) -> bool:
    """Shutdown: `awaitable`, at most `timeout_s`. With the broker away aiokafka waits for
    it as long as it is away (a commit, leaving the group, a flush), and a worker told to
    stop never stopped (docs/design.md §7). Past the bound: logs "<not_done> within N s
    (is the broker reachable?): <then>" and returns False."""
    try:
        await asyncio.wait_for(awaitable, timeout_s)
        return True
    except asyncio.TimeoutError:
        logging.getLogger(__name__).warning("%s within %.0f s (is the broker reachable?): %s",
                                            not_done, timeout_s, then)
        return False


async def stop_consumer(consumer: AIOKafkaConsumer, who: str) -> None:
    """Stop `consumer`. With the broker gone, aiokafka 0.14's consumer re-raises the
    cancellation of its own fetch task from stop(); that one is not ours to pass on."""
    try:
        await consumer.stop()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        logging.getLogger(__name__).warning("%s: its consumer stopped with its broker unreachable", who)


def retrieve_failure(batch) -> None:
    """Mark a failed aiokafka batch's own futures (the batch's, its drain waiter) as read:
    the records' futures carry the failure to whoever waits on them, and aiokafka leaves
    these unread for a batch sent whole (`send_batch`), which asyncio logs as "Future
    exception was never retrieved" when they are collected."""
    for future in (getattr(batch, "future", None), getattr(batch, "_drain_waiter", None)):
        if future is not None and future.done() and not future.cancelled():
            future.exception()


async def stop_producer(producer: AIOKafkaProducer, timeout_s: float, who: str) -> bool:
    """Stop `producer`, waiting at most `timeout_s` for Kafka to acknowledge the records it
    holds; True when it did.

    aiokafka's stop() first waits for every record it holds, however long the broker (or a
    partition's leader: `keep_batches_until_sent`) is away, and a worker or a gateway told
    to stop never stopped (docs/design.md §7). Past the bound the producer's sender is
    stopped and the records it still holds fail with KafkaTimeoutError. None of them was
    acknowledged: a worker did not commit the work they carried (the partitions' next
    owner redoes it), and a client's send that held one raises GenpipeUnavailable. (The
    workers used to cancel stop() itself instead, which left the sender running, and the
    client left the accumulator's close task waiting for good.)"""
    if await wait_at_most(producer.flush(), timeout_s, f"{who}: records not acknowledged", "stopping without them"):
        await producer.stop()
        return True
    sender_task = getattr(getattr(producer, "_sender", None), "sender_task", None)
    if sender_task is not None:
        # Ended before the records fail: stop() awaits a sender still running, and then
        # re-raised its cancellation (the worker exited 1).
        sender_task.cancel()
        await asyncio.wait([sender_task], timeout=timeout_s)
    accumulator = getattr(producer, "_message_accumulator", None)
    if accumulator is not None:
        batches = [b for queued in accumulator._batches.values() for b in queued] + list(accumulator._pending_batches)
        accumulator.fail_all(KafkaTimeoutError(f"not acknowledged within {timeout_s:g} s: dropped as the producer "
                                               f"stopped"))
        for batch in batches:
            retrieve_failure(batch)
    await wait_at_most(producer.stop(), timeout_s, f"{who}: producer not stopped", "leaving it")
    return False
