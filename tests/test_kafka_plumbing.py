"""The shared Kafka plumbing against the real broker: records, headers, DLQ, commits."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import TopicPartition

from schemas import JSON, MSGPACK, Cancel, DecodeError, GenerateRequest, ValidationError
from tests.kafka_helpers import committed_offsets, read_topic, wait_for
from workers.broker.topics import create_topics
from workers.kafka.clients import make_consumer, make_producer
from schemas.headers import HEADER_DLQ_ERROR, HEADER_DLQ_OFFSET, HEADER_DLQ_PARTITION, HEADER_DLQ_TOPIC
from workers.kafka.loop import ConsumerLoop, Handler
from workers.kafka.offsets import PartitionOffsets
from workers.kafka.publisher import Publisher
from workers.kafka.records import Outgoing, decode_message
from workers.kafka.settings import KafkaSettings

pytestmark = pytest.mark.kafka


async def test_published_records_arrive_with_their_headers(kafka_settings):
    await create_topics(kafka_settings, partitions=2)
    producer = make_producer(kafka_settings)
    await producer.start()
    try:
        publisher = Publisher(producer, kafka_settings.topic("dlq"))
        sent = [GenerateRequest(request_id=f"r{i}", prompt_token_ids=[1, 2, i]) for i in range(4)]
        futures = []
        for i, request in enumerate(sent):
            content_type = JSON if i % 2 else MSGPACK
            futures.append(await publisher.publish(Outgoing(
                kafka_settings.topic("requests"), request.request_id, request, content_type,
                headers={"x-trace": f"t{i}"}, partition=i % 2)))
        metadata = await asyncio.gather(*futures)
        assert [m.partition for m in metadata] == [0, 1, 0, 1]
        assert publisher.in_flight == 0 and publisher.published == 4
    finally:
        await producer.stop()

    records = await read_topic(kafka_settings, kafka_settings.topic("requests"), until=lambda r: len(r) >= 4)
    by_id = {}
    for record in records:
        request = decode_message(record, GenerateRequest)
        by_id[request.request_id] = (request, dict(record.headers))
        assert record.key.decode() == request.request_id
    for i, request in enumerate(sent):
        got, headers = by_id[request.request_id]
        assert got == request
        assert headers["content-type"] == (JSON if i % 2 else MSGPACK).encode()
        assert headers["genpipe-schema"] == b"GenerateRequest/v1"
        assert headers["x-trace"] == f"t{i}".encode()


class ForwardingHandler(Handler):
    """A minimal worker: forwards Cancel records to the results topic, DLQs the rest."""

    def __init__(self, settings, publisher, offsets):
        self.settings, self.publisher, self.offsets = settings, publisher, offsets
        self.assigned = []

    async def handle(self, message):
        release = self.offsets.hold(message)
        try:
            cancel = decode_message(message, Cancel)
            future = await self.publisher.publish(Outgoing(self.settings.topic("results"), cancel.request_id, cancel))
        except (DecodeError, ValidationError) as exc:
            future = await self.publisher.to_dlq(message, str(exc))
        future.add_done_callback(lambda f: release())

    async def on_assigned(self, partitions, metadata):
        self.assigned.extend(partitions)

    def commit_metadata(self, tp):
        return "seen"

    async def drain(self, deadline):
        await self.publisher.flush()


async def forward_until_committed(settings: KafkaSettings, source: str, records: int) -> None:
    """A consumer loop with `ForwardingHandler` over `source` (one partition) until its
    group has committed past `records` records; then stopped, as a worker stops."""
    worker_producer = make_producer(settings)
    await worker_producer.start()
    try:
        publisher = Publisher(worker_producer, settings.topic("dlq"))
        offsets = PartitionOffsets()
        consumer_loop = ConsumerLoop(settings, source, f"{settings.topic_prefix}-group",
                                     ForwardingHandler(settings, publisher, offsets), offsets)
        stop = asyncio.Event()
        task = asyncio.ensure_future(consumer_loop.run(stop, grace_s=5))
        tp = TopicPartition(source, 0)
        await wait_for(lambda: consumer_loop._committed.get(tp, (0,))[0] == records or task.done(),
                       what=f"commit past all {records} records")
        assert not task.done(), task.exception()
        stop.set()
        await task
    finally:
        await worker_producer.stop()


async def test_garbage_goes_to_the_dlq_with_its_source_and_offsets_are_committed(kafka_settings):
    await create_topics(kafka_settings, partitions=1)
    source = kafka_settings.topic("requests")
    producer = make_producer(kafka_settings)
    await producer.start()
    try:
        await producer.send_and_wait(source, b"\xc1garbage", key=b"k-bad",
                                     headers=[("content-type", b"application/x-msgpack"), ("x", b"1")])
        from schemas import encode, headers_for
        good = Cancel(request_id="r-good")
        await producer.send_and_wait(source, encode(good), key=b"r-good", headers=headers_for(good))
        await producer.send_and_wait(source, b'{"request_id": 7}', key=b"k-typed")  # JSON, no headers, wrong type

        await forward_until_committed(kafka_settings, source, 3)
    finally:
        await producer.stop()

    dlq = await read_topic(kafka_settings, kafka_settings.topic("dlq"), until=lambda r: len(r) >= 2)
    results = await read_topic(kafka_settings, kafka_settings.topic("results"), until=lambda r: len(r) >= 1)
    assert decode_message(results[0], Cancel) == good
    by_key = {r.key: r for r in dlq}
    bad = by_key[b"k-bad"]
    headers = dict(bad.headers)
    assert bad.value == b"\xc1garbage"  # original bytes, untouched
    assert headers["x"] == b"1"  # original headers kept
    assert headers[HEADER_DLQ_TOPIC] == source.encode()
    assert headers[HEADER_DLQ_PARTITION] == b"0"
    assert headers[HEADER_DLQ_OFFSET] == b"0"
    assert b"not a valid msgpack record" in headers[HEADER_DLQ_ERROR]
    typed = dict(by_key[b"k-typed"].headers)
    assert typed[HEADER_DLQ_OFFSET] == b"2"
    assert b"request_id: expected str, got int" in typed[HEADER_DLQ_ERROR]

    # the commit carries the handler's metadata, readable through the admin client
    tp = TopicPartition(source, 0)
    committed = await committed_offsets(kafka_settings, f"{kafka_settings.topic_prefix}-group", [tp])
    assert committed[tp].offset == 3 and committed[tp].metadata == "seen"


async def test_a_flood_of_garbage_is_all_in_the_dlq_and_the_log_shows_a_few_and_counts_the_rest(
        kafka_settings, caplog):
    """A producer writing garbage must not turn the worker's log into a copy of the DLQ:
    the first copies are logged one by one, the rest counted in one line (at the latest
    when the worker stops); every record is still in the DLQ."""
    import logging

    caplog.set_level(logging.WARNING, logger="workers.kafka.publisher")
    await create_topics(kafka_settings, partitions=1)
    source = kafka_settings.topic("requests")
    producer = make_producer(kafka_settings)
    await producer.start()
    try:
        for i in range(25):
            await producer.send(source, b"\xc1garbage %d" % i, key=b"k%d" % i)
        await producer.flush()
        await forward_until_committed(kafka_settings, source, 25)
    finally:
        await producer.stop()

    dlq = await read_topic(kafka_settings, kafka_settings.topic("dlq"), until=lambda r: len(r) >= 25)
    assert sorted(int(dict(r.headers)[HEADER_DLQ_OFFSET]) for r in dlq) == list(range(25))
    assert sorted(r.value for r in dlq) == sorted(b"\xc1garbage %d" % i for i in range(25))
    lines = [r.getMessage() for r in caplog.records if r.name == "workers.kafka.publisher"]
    assert [line.split(":")[0] for line in lines[:10]] == [f"DLQ {source}[0]@{i}" for i in range(10)]
    assert len(lines) == 11, lines
    assert lines[10].startswith("15 more records copied to the DLQ in the last ")
    assert lines[10].endswith(f"the last: DLQ {source}[0]@24: not a valid msgpack record: MessagePack data is "
                              "malformed: invalid opcode '\\xc1' (byte 0)")


async def test_a_dead_background_task_stops_the_worker_with_exit_1(kafka_settings, caplog):
    """A worker whose helper task died (the generate worker's cancel follower) must not run
    on half-blind: it stops, logs why, and exits 1 so a supervisor restarts it."""
    from workers.kafka.runtime import serve

    await create_topics(kafka_settings, partitions=1)
    ready = asyncio.Event()

    async def follower_that_dies():
        await ready.wait()
        raise RuntimeError("cancel topic vanished")

    code = await asyncio.wait_for(serve(
        kafka_settings, topic=kafka_settings.topic("requests"), group_id=f"{kafka_settings.topic_prefix}-g",
        make_handler=lambda publisher, offsets: ForwardingHandler(kafka_settings, publisher, offsets),
        stop=asyncio.Event(), grace_s=5, background=lambda stop: [follower_that_dies()],
        on_ready=ready.set, worker="test"), 60)
    assert code == 1
    assert "background task failed, stopping: RuntimeError('cancel topic vanished')" in caplog.text


async def test_follow_from_a_time_never_skips_a_record_produced_while_it_starts(kafka_settings):
    """assign_all looks up the topic's ends and the offsets for `since_ms`; a record that
    lands between those two lookups (a cancel sent while a generate worker starts) must
    still be read. The record is produced right after whichever lookup comes first."""
    import time

    from workers.kafka.follow import assign_all

    await create_topics(kafka_settings, partitions=1)
    topic = kafka_settings.topic("cancel")
    producer = make_producer(kafka_settings)
    await producer.start()
    consumer = make_consumer(kafka_settings, group_id=None, auto_offset_reset="latest")
    await consumer.start()
    try:
        produced = []

        def produce_after(lookup):
            async def wrapped(*args, **kwargs):
                result = await lookup(*args, **kwargs)
                if not produced:
                    produced.append(await producer.send_and_wait(topic, b'{"request_id": "c1"}', key=b"c1"))
                return result
            return wrapped

        consumer.end_offsets = produce_after(consumer.end_offsets)
        consumer.offsets_for_times = produce_after(consumer.offsets_for_times)
        [tp] = await assign_all(consumer, topic, since_ms=int((time.time() - 300) * 1000))
        assert produced and produced[0].offset == 0
        records = []
        deadline = time.monotonic() + 30
        while not records and time.monotonic() < deadline:
            records += (await consumer.getmany(tp, timeout_ms=200)).get(tp, [])
        assert [r.value for r in records] == [b'{"request_id": "c1"}']
    finally:
        await consumer.stop()
        await producer.stop()


async def test_a_producers_batches_wait_for_a_leader_however_long_it_takes():
    """No broker needed: what the producer's accumulator decides. A batch queued for a
    partition without a leader is kept, not failed after the request timeout: for an
    idempotent producer that failure also left a hole in the partition's sequence, and
    the broker refused every later record of the producer there (tests/test_cluster.py
    shows the whole pipeline). This fails on an aiokafka where the lift no longer
    applies (workers/kafka/clients.py `keep_batches_until_sent`)."""
    producer = make_producer(KafkaSettings(bootstrap_servers="127.0.0.1:9"))
    try:
        accumulator = producer._message_accumulator
        tp = TopicPartition("t", 0)
        builder = accumulator.create_builder()
        builder.append(key=b"k", value=b"v", timestamp=None)
        batch = accumulator._append_batch(builder, tp)
        batch._ctime -= 3600  # queued an hour ago, no leader ever since (this producer has no metadata)
        assert not batch.expired()
        nodes, unknown_leaders = accumulator.drain_by_nodes(ignore_nodes=set())
        assert unknown_leaders and not nodes
        assert not batch.future.done(), "the batch was failed while its partition had no leader"
        assert accumulator._batches[tp][0] is batch
    finally:
        await producer.stop()  # (never started: nothing to flush)


async def test_a_retried_batch_failed_at_shutdown_fails_without_a_traceback():
    """No broker needed. A batch sent, put back to be retried (its broker went away), then
    failed from its queue by the producer's stop: its records fail, and aiokafka's
    bookkeeping no longer raises KeyError in a callback, which the event loop logged as
    "Exception in callback MessageAccumulator._pop_batch.<locals>.cb" at such a shutdown
    (workers/kafka/clients.py `forget_failed_retries_quietly`)."""
    from aiokafka.errors import KafkaConnectionError

    producer = make_producer(KafkaSettings(bootstrap_servers="127.0.0.1:9"))
    loop = asyncio.get_running_loop()
    raised = []
    loop.set_exception_handler(lambda _, context: raised.append(context))
    try:
        accumulator = producer._message_accumulator
        accumulator._txn_manager.set_pid_and_epoch(1, 0)  # (what the producer's start asks the broker for)
        tp = TopicPartition("t", 0)
        builder = accumulator.create_builder()
        builder.append(key=b"k", value=b"v", timestamp=None)
        batch = accumulator._append_batch(builder, tp)
        assert accumulator._pop_batch(tp) is batch  # the sender takes it ...
        accumulator.reenqueue(batch)  # ... and puts it back: the broker did not answer
        accumulator.fail_all(KafkaConnectionError("the broker is away"))  # what stop() does with it
        assert batch.future.done()
        await asyncio.sleep(0)  # (one turn: the futures' callbacks run)
        await asyncio.sleep(0)
        assert raised == [], raised[0].get("exception")
        assert isinstance(batch.future.exception(), KafkaConnectionError)
        with pytest.raises(KafkaConnectionError):  # (and a send waiting for its room hears it)
            await batch.wait_drain()
    finally:
        loop.set_exception_handler(None)
        await producer.stop()  # (never started: nothing to flush)


async def test_a_send_after_shutdown_failed_every_record_raises_instead_of_spinning(kafka_settings, make_topics):
    """Past its bound, `stop_producer` fails every record the producer holds, and from then
    on the producer raises KafkaTimeoutError at once, before any await. The publisher's
    retry of a full queue (`_enqueue`) took that for a full queue and tried again with no
    await in between: the event loop spun (a warning a try), the producer's close never
    ran, and the worker never exited. Now the send raises (its work is not committed)."""
    from aiokafka.errors import KafkaTimeoutError

    from workers.kafka.clients import stop_producer

    await make_topics(kafka_settings, partitions=1)
    topic = kafka_settings.topic("results")
    producer = make_producer(kafka_settings)
    await producer.start()
    publisher = Publisher(producer, kafka_settings.topic("dlq"))
    try:
        await (await publisher.publish(Outgoing(topic, "first", Cancel(request_id="first"))))  # (its metadata known)
        producer._message_accumulator.fail_all(KafkaTimeoutError("dropped as the producer stopped"))
        with pytest.raises(KafkaTimeoutError):
            await asyncio.wait_for(publisher.publish(Outgoing(topic, "late", Cancel(request_id="late"))), 10)
    finally:
        await stop_producer(producer, 1.0, "test")


async def test_a_followers_offset_lookup_waits_for_a_leader_and_a_clients_does_not(caplog):
    """No broker needed. A lookup of a partition without a leader times out (aiokafka:
    "Failed to get offsets by times in 40000 ms"); a generate worker's cancel follower
    tries again (it stopped the worker before: tests/test_cluster.py), a client's start
    fails with it."""
    from aiokafka.errors import KafkaTimeoutError

    from workers.kafka.follow import _looked_up

    calls = []

    async def lookup():
        calls.append(1)
        if len(calls) < 3:
            raise KafkaTimeoutError("Failed to get offsets by times in 40000 ms")
        return {"t-0": 5}

    assert await _looked_up(lookup, "t", wait_for_leaders=True) == {"t-0": 5}
    assert len(calls) == 3
    assert "t: offsets not found" in caplog.text and "does every partition have a leader?" in caplog.text
    calls.clear()
    with pytest.raises(KafkaTimeoutError):
        await _looked_up(lookup, "t", wait_for_leaders=False)
    assert len(calls) == 1


async def test_a_batch_the_broker_refuses_does_not_make_it_refuse_the_partitions_next_records(kafka_settings):
    """A record over its topic's `max.message.bytes` is refused; the partition's next
    records still go out. On the old code the broker refused every later record of the
    producer to that partition (OutOfOrderSequenceNumber: the refused batch's sequence
    numbers stayed counted), until the process restarted (workers/kafka/clients.py
    `rewind_sequences_of_refused_batches`). The next records are queued while the refused
    batch is on its way, so the rewind must come before they are numbered."""
    from aiokafka.errors import MessageSizeTooLargeError

    from tests.kafka_helpers import create_topic

    topic = f"{kafka_settings.topic_prefix}.small-records"
    await create_topic(kafka_settings, topic, max_message_bytes=2000)
    producer = make_producer(kafka_settings)
    await producer.start()
    tp = TopicPartition(topic, 0)
    try:
        await (await producer.send(topic, b"first", partition=0))
        for round_ in range(3):
            refused = await producer.send(topic, b"x" * 5000, partition=0)
            # on its way (taken from the queue) before the next records are queued behind it
            await wait_for(lambda: tp not in producer._message_accumulator._batches, 10, "the batch to leave")
            after = [await producer.send(topic, f"after-{round_}-{i}".encode(), partition=0) for i in range(20)]
            with pytest.raises(MessageSizeTooLargeError):
                await refused
            await asyncio.gather(*after)
    finally:
        await producer.stop()
    records = await read_topic(kafka_settings, topic, until=lambda rs: len(rs) >= 61)
    assert [r.value.decode() for r in records] == ["first"] + [
        f"after-{round_}-{i}" for round_ in range(3) for i in range(20)]


class StuckHandler(Handler):
    """Releases every record at once, except b"stuck": its handling waits for good, before it
    holds its offset (as a worker waiting on a producer with no room would)."""

    def __init__(self, offsets):
        self.offsets = offsets
        self.handled: list[bytes] = []
        self.cut_short = False

    async def handle(self, message):
        self.handled.append(message.value)
        if message.value == b"stuck":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cut_short = True
                raise
        self.offsets.hold(message)()


async def test_a_loop_turn_stuck_at_shutdown_is_cut_short_and_its_record_is_not_committed(kafka_settings, caplog):
    """A stop while a loop turn waits for good (a publish the broker never takes: since
    lanes (workers/kafka/lanes.py) a leaderless partition no longer holds a worker's turn,
    but lanes full, 32 MiB waiting, still can) ends the
    turn after `shutdown_wait_s`, and the worker stops instead of waiting with it. The
    record it was handling is not committed (its partition's next owner redoes it); the
    one before it is."""
    await create_topics(kafka_settings, partitions=1)
    source = kafka_settings.topic("requests")
    producer = make_producer(kafka_settings)
    await producer.start()
    try:
        for value in (b"first", b"stuck", b"after"):
            await producer.send_and_wait(source, value, key=b"k")
    finally:
        await producer.stop()
    group = f"{kafka_settings.topic_prefix}-stuck"
    offsets = PartitionOffsets()
    handler = StuckHandler(offsets)
    consumer_loop = ConsumerLoop(kafka_settings, source, group, handler, offsets, shutdown_wait_s=1.0)
    stop = asyncio.Event()
    task = asyncio.ensure_future(consumer_loop.run(stop, grace_s=1))
    await wait_for(lambda: b"stuck" in handler.handled or task.done(), what="the stuck record handled")
    assert not task.done(), task.exception()
    stop.set()
    await asyncio.wait_for(task, 30)  # (waited for good before the bound)

    assert handler.cut_short
    assert "the loop's last turn not done within 1 s of the stop" in caplog.text
    assert handler.handled == [b"first", b"stuck"]
    tp = TopicPartition(source, 0)
    committed = await committed_offsets(kafka_settings, group, [tp])
    assert committed[tp].offset == 1, committed  # past "first", not past "stuck"


async def test_records_published_while_their_partitions_batch_waits_for_the_sender_leave_with_it(kafka_settings):
    """aiokafka's sender sends one produce request at a time to a broker, so a partition's
    batch can still be queued when the next publish step comes. That step's records join
    it (workers/kafka/publisher.py `_join_queued`) rather than wait for it to leave and go
    a produce round trip later (after a pause of the broker every step waited in turn:
    ops/bench/publish_join.py). They arrive once each, in order, in the same batch."""
    await create_topics(kafka_settings, partitions=1)
    topic = kafka_settings.topic("chunks")
    producer = make_producer(kafka_settings)
    await producer.start()
    try:
        publisher = Publisher(producer, kafka_settings.topic("dlq"))
        await publisher.partition_count(topic)
        await producer.client._wait_on_metadata(topic)
        first = await publisher.publish_batch([Outgoing(topic, "a", Cancel(request_id="a"), partition=0)])
        # (nothing has yielded to the sender since: the first batch is still queued)
        second = await publisher.publish_batch([Outgoing(topic, key, Cancel(request_id=key), partition=0)
                                                for key in ("b", "c")])
        answers = await asyncio.gather(*first, *second)
    finally:
        await producer.stop()
    assert {answer.offset for answer in answers} == {0}  # one batch, at the partition's start
    records = await read_topic(kafka_settings, topic, until=lambda r: len(r) >= 3)
    assert [r.key for r in records] == [b"a", b"b", b"c"]
    assert [decode_message(r, Cancel).request_id for r in records] == ["a", "b", "c"]


class WaitingHandler(Handler):
    """Holds each record, as a worker does, but for the record b"wait" only after waiting
    on `go` first (as the derender waits on a reply topic's lookup)."""

    def __init__(self, offsets):
        self.offsets, self.go, self.waiting, self.handled = offsets, asyncio.Event(), False, []

    async def handle(self, message):
        if message.value == b"wait":
            self.waiting = True
            await self.go.wait()
        release = self.offsets.hold(message)
        self.handled.append(message.value)
        release()


async def test_a_commit_while_a_record_is_being_handled_stops_before_that_record(kafka_settings):
    """The loop had marked a record read before its handler ran: a commit while the
    handler waited (the periodic one, a revoke's: the same call) went past it, and a
    worker that then died or lost the partition never did its work (the derender lost a
    request's first chunk so, and with it every later one)."""
    await create_topics(kafka_settings, partitions=1)
    source = kafka_settings.topic("requests")
    await produce_in_one_batch(kafka_settings, source, {0: [b"a", b"b", b"wait", b"c"]})
    group = f"{kafka_settings.topic_prefix}-handling"
    offsets = PartitionOffsets()
    handler = WaitingHandler(offsets)
    consumer_loop = ConsumerLoop(kafka_settings, source, group, handler, offsets, commit_interval_s=3600)
    stop = asyncio.Event()
    task = asyncio.ensure_future(consumer_loop.run(stop, grace_s=1))
    tp = TopicPartition(source, 0)
    try:
        await wait_for(lambda: handler.waiting or task.done(), what="the handler waiting on record 2")
        await consumer_loop.commit()
        assert (await committed_offsets(kafka_settings, group, [tp]))[tp].offset == 2  # not past "wait"
        handler.go.set()
        await wait_for(lambda: len(handler.handled) == 4 or task.done(), what="every record handled")
        await consumer_loop.commit()
        assert (await committed_offsets(kafka_settings, group, [tp]))[tp].offset == 4
        assert not task.done(), task.exception()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_the_committed_metadata_read_in_a_rebalance_gives_up_before_the_session_timeout(caplog):
    """A new assignment's committed offsets are read inside aiokafka's rebalance, with the
    member's heartbeats stopped. A broker that takes the connection and never answers
    (here a socket that reads nothing back) held that read for the admin's 40 s request
    timeout, past the group's 30 s session timeout; it gives up after COMMITTED_WAIT_S,
    says so, and the partitions start without their metadata."""
    from workers.kafka.loop import COMMITTED_WAIT_S

    silent = []
    server = await asyncio.start_server(lambda reader, writer: silent.append(writer), "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        settings = KafkaSettings(bootstrap_servers=f"127.0.0.1:{port}", topic_prefix="silent")
        consumer_loop = ConsumerLoop(settings, "silent.requests", "silent-group", Handler(), PartitionOffsets())
        read = consumer_loop._committed_offsets([TopicPartition("silent.requests", 0)])
        assert await asyncio.wait_for(read, 25) == {}  # (before: 40 s)
        assert silent, "the admin client never connected"
        assert f"could not read the committed offsets' metadata within {COMMITTED_WAIT_S:.0f} s" in caplog.text
    finally:
        for writer in silent:
            writer.close()
        server.close()


async def produce_in_one_batch(settings, topic: str, values: dict[int, list[bytes]]) -> None:
    """Each partition's values as one producer batch, so that a poll can return them all."""
    producer = make_producer(settings)
    await producer.start()
    try:
        for partition, records in values.items():
            batch = producer.create_batch()
            for value in records:
                assert batch.append(key=None, value=value, timestamp=None) is not None
            await (await producer.send_batch(batch, topic, partition=partition))
    finally:
        await producer.stop()


class BusyHandler(Handler):
    """Spends `busy_s` of CPU on each record without awaiting anything that waits (as a
    worker decoding and admitting a request does), and notes, for each record, the poll it
    came in (`tick` ends each poll) and how far a ticker task beside the loop had got."""

    def __init__(self, offsets, ticker: list[int], busy_s: float = 0.0002):
        self.offsets = offsets
        self.ticker = ticker
        self.busy_s = busy_s
        self.polls = 0
        self.handled: list[tuple[int, int]] = []  # (poll, ticker) per record
        self.values: set[bytes] = set()

    async def handle(self, message):
        end = time.monotonic() + self.busy_s
        while time.monotonic() < end:
            pass
        self.handled.append((self.polls, self.ticker[0]))
        self.values.add(message.value)
        self.offsets.hold(message)()

    async def tick(self):
        if self.handled and self.handled[-1][0] == self.polls:
            self.polls += 1


async def test_a_polls_records_leave_the_event_loop_to_other_work_between_slices(kafka_settings):
    """A poll returns up to max_records records. Handled in one go, 256 new requests held
    the generate worker's loop for 5-20 ms, and every engine step and producer ack waited
    behind them. The loop hands the event loop back every `slice_s` of handling: another
    task runs while one poll's records are handled, not only between polls."""
    await create_topics(kafka_settings, partitions=1)
    source = kafka_settings.topic("requests")
    await produce_in_one_batch(kafka_settings, source, {0: [b"%d" % i for i in range(300)]})
    ticker = [0]

    async def tick_forever():
        while True:
            ticker[0] += 1
            await asyncio.sleep(0)

    offsets = PartitionOffsets()
    handler = BusyHandler(offsets, ticker)
    consumer_loop = ConsumerLoop(kafka_settings, source, f"{kafka_settings.topic_prefix}-sliced", handler, offsets,
                                 slice_s=0.002)
    stop = asyncio.Event()
    ticking = asyncio.ensure_future(tick_forever())
    task = asyncio.ensure_future(consumer_loop.run(stop, grace_s=1))
    try:
        await wait_for(lambda: len(handler.handled) >= 300 or task.done(), what="300 records handled")
        assert not task.done(), task.exception()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        ticking.cancel()
    polls: dict[int, list[int]] = {}
    for poll, seen in handler.handled:
        polls.setdefault(poll, []).append(seen)
    seen = max(polls.values(), key=len)
    assert len(seen) >= 100, f"the records came in small polls: {[len(s) for s in polls.values()]}"
    # 0.2 ms a record, a slice of 2 ms: the ticker runs every ~10 records of the poll
    # (in one go it would not run until the poll's last record was handled).
    longest = max(seen.count(value) for value in set(seen))
    assert longest <= 40, f"{longest} records of one poll were handled without the loop's other work running"


class RevokeWatchingHandler(BusyHandler):
    """BusyHandler that also notes every record handled while its partition was revoked
    (after `on_revoked`, before the partition was assigned again)."""

    def __init__(self, offsets, ticker, busy_s):
        super().__init__(offsets, ticker, busy_s)
        self.revoked: set[TopicPartition] = set()
        self.revokes = 0
        self.while_revoked: list[tuple[TopicPartition, int]] = []

    async def handle(self, message):
        tp = TopicPartition(message.topic, message.partition)
        if tp in self.revoked:
            self.while_revoked.append((tp, message.offset))
        await super().handle(message)

    async def on_revoked(self, partitions):
        self.revokes += 1
        self.revoked.update(partitions)

    async def on_assigned(self, partitions, committed):
        self.revoked.difference_update(partitions)


async def test_a_rebalance_stops_a_polls_records_where_it_is_and_none_is_lost(kafka_settings):
    """Slices leave room for the group's rebalance to run while a poll's records are being
    handled. Once it has taken the partitions, the rest of the poll is not handled by the
    worker that no longer owns them: their owner reads on from the commit. Every record is
    still handled by a member."""
    await create_topics(kafka_settings, partitions=2)
    source = kafka_settings.topic("requests")
    await produce_in_one_batch(kafka_settings, source, {p: [b"%d-%d" % (p, i) for i in range(1500)] for p in (0, 1)})
    group = f"{kafka_settings.topic_prefix}-rebalanced"
    quick = {"heartbeat_interval_ms": 100}
    first_offsets, second_offsets = PartitionOffsets(), PartitionOffsets()
    first = RevokeWatchingHandler(first_offsets, [0], busy_s=0.001)
    second = RevokeWatchingHandler(second_offsets, [0], busy_s=0.0)
    first_loop = ConsumerLoop(kafka_settings, source, group, first, first_offsets, slice_s=0.002,
                              consumer_overrides=quick, commit_interval_s=0.1)
    second_loop = ConsumerLoop(kafka_settings, source, group, second, second_offsets,
                               consumer_overrides=quick, commit_interval_s=0.1)
    stop = asyncio.Event()
    tasks = [asyncio.ensure_future(first_loop.run(stop, grace_s=1))]
    try:
        await wait_for(lambda: len(first.handled) >= 100 or tasks[0].done(), what="the first member under way")
        tasks.append(asyncio.ensure_future(second_loop.run(stop, grace_s=1)))
        await wait_for(lambda: first.revokes >= 1 or any(t.done() for t in tasks), what="a rebalance")
        await wait_for(lambda: len(first.values | second.values) >= 3000 or any(t.done() for t in tasks),
                       what="every record handled")
        assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
    assert first.while_revoked == [], f"{len(first.while_revoked)} records handled after their partition was revoked"
    assert first.values | second.values == {b"%d-%d" % (p, i) for p in (0, 1) for i in range(1500)}
