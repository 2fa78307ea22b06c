"""Reply topics are client-written: a rule says which ones a request may name, and no
reply topic (missing, forbidden, not even a name) can stop or stall a worker."""

from __future__ import annotations

import asyncio

import pytest

from schemas import ErrorResponse, GenerateRequest, OutputOptions, SamplingParams
from tests.derender_support import make_chunks
from tests.kafka_helpers import read_topic
from workers.client import decode_result
from schemas.headers import HEADER_FINAL
from workers.kafka.reply_topics import ReplyTopicPatternError, reply_topic_rule


# --- the rule (pure) ---------------------------------------------------------------------


def test_default_rule_allows_results_and_reply_topics_only():
    rule = reply_topic_rule("acme")
    assert rule.problem("acme.results") is None
    assert rule.problem("acme.reply.team-a") is None
    for own in ("acme.requests", "acme.chunks", "acme.cancel", "acme.dlq"):
        assert "one of this deployment's own topics" in rule.problem(own)
    for other in ("other.results", "acme.reply.", "acmexresults", "acme.results2", "__consumer_offsets"):
        problem = rule.problem(other)
        assert problem is not None and problem.startswith(f"reply_topic {other!r} is not allowed")
    assert rule.problem("bad topic!").startswith("reply_topic is not a valid Kafka topic name")
    assert rule.problem("x" * 250).startswith("reply_topic is not a valid Kafka topic name")


def test_prefix_is_literal_in_the_pattern():
    rule = reply_topic_rule("a.b")  # the dot of a prefix matches only a dot
    assert rule.problem("a.b.reply.t") is None
    assert rule.problem("aXb.reply.t") is not None


def test_custom_pattern_still_never_allows_the_input_topics():
    rule = reply_topic_rule("acme", r"{prefix}\..*")
    assert rule.problem("acme.anything") is None
    assert rule.problem("acme.requests") is not None and rule.problem("acme.chunks") is not None


def test_a_pattern_that_does_not_compile_is_a_clear_error():
    with pytest.raises(ReplyTopicPatternError, match="is not a regular expression"):
        reply_topic_rule("acme", "(")


def test_worker_commands_refuse_a_bad_pattern_as_usage(capsys):
    from workers.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["derender-worker", "--reply-topic-pattern", "("])
    assert exc.value.code == 2
    assert "is not a regular expression" in capsys.readouterr().err


def test_a_refused_result_is_explained_by_what_the_broker_said():
    from aiokafka.errors import MessageSizeTooLargeError, PolicyViolationError, TopicAuthorizationFailedError

    from workers.derender.undeliverable import refusal_message

    size = refusal_message("acme.reply.t", "acme.results", MessageSizeTooLargeError(), 1000)
    assert size.startswith("reply_topic 'acme.reply.t' refused the result as too large (MessageSizeTooLargeError)")
    assert "max.message.bytes" in size and "--max-record-bytes is 1000" in size
    own = refusal_message("acme.results", "acme.results", MessageSizeTooLargeError(), 1000)
    assert own.startswith("the results topic 'acme.results' refused the result as too large")
    denied = refusal_message("acme.reply.t", "acme.results", TopicAuthorizationFailedError("acme.reply.t"), 1000)
    assert denied.endswith("the derender workers may not write to it")
    other = refusal_message("acme.reply.t", "acme.results", PolicyViolationError("no"), 1000)
    assert other.startswith("reply_topic 'acme.reply.t' refused the result (PolicyViolationError")


# --- live workers ---------------------------------------------------------------------------


def _errors_by_request(records) -> dict[str, ErrorResponse]:
    out = {}
    for record in records:
        value = decode_result(record.value, record.headers)
        if isinstance(value, ErrorResponse):
            assert HEADER_FINAL in dict(record.headers)
            out[record.key.decode()] = value
    return out


def _ids_with_five_logprobs(tiny_model_dir):
    """120 ids of the tiny vocabulary, each with 5 candidates: results of ~70 bytes a token."""
    from tests.derender_support import position
    from workers.derender.state import Derenderer

    ids = [100 + (7 * i) % 900 for i in range(120)]
    assert max(ids) + 4 < Derenderer(str(tiny_model_dir)).tables.size
    return ids, [position(t, [t, t + 1, t + 2, t + 3, t + 4], 5) for t in ids]


async def _committed_to(kafka_settings, partition: int, offset: int, what: str) -> None:
    """The derender's group committed the chunks partition up to `offset` (its holds all went)."""
    from aiokafka import TopicPartition
    from tests.kafka_helpers import wait_for_commit

    await wait_for_commit(kafka_settings, f"{kafka_settings.topic_prefix}-der",
                          TopicPartition(kafka_settings.topic("chunks"), partition), offset, what=what)


@pytest.mark.kafka
async def test_derender_answers_bad_reply_topics_on_the_default_topic_and_keeps_running(
        kafka_settings, make_topics, tiny_model_dir):
    """On the old code the first chunk naming a missing reply topic stopped the worker
    (UnknownTopicOrPartitionError after ~60 s), and every restart died on it again."""
    from tests.test_derender_worker import produce_chunks, start_worker
    from workers.kafka.clients import make_admin
    from aiokafka.admin import NewTopic

    await make_topics(kafka_settings, partitions=2)
    prefix = kafka_settings.topic_prefix
    team = f"{prefix}.reply.team"
    admin = make_admin(kafka_settings)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(team, 1, 1)])
    finally:
        await admin.close()
    stream = OutputOptions(kind="completion", stream=True)
    topics = {"missing": f"{prefix}.reply.typo", "own": f"{prefix}.chunks", "other": "elsewhere.results",
              "invalid": "bad topic!", "team": team, "default": None}
    requests = {name: make_chunks(name, [5, 6, 7, 8], [2, 2], output=stream, prompt_tail=[1])
                for name in topics}
    for name, topic in topics.items():
        for chunk in requests[name]:
            chunk.reply_topic = topic
    chunks = [chunk for name in topics for chunk in requests[name]]
    stop, task = await start_worker(kafka_settings, tiny_model_dir)
    try:
        await produce_chunks(kafka_settings, chunks, {name: i % 2 for i, name in enumerate(topics)})
        wanted = {"missing", "own", "other", "invalid", "default"}
        records = await read_topic(kafka_settings, kafka_settings.topic("results"), timeout=60, until=lambda rs: wanted
                                   <= {r.key.decode() for r in rs if HEADER_FINAL in dict(r.headers)})
        team_records = await read_topic(kafka_settings, team, timeout=30, until=lambda rs: any(
            HEADER_FINAL in dict(r.headers) for r in rs))
        assert not task.done(), "the derender worker stopped"
    finally:
        stop.set()
    assert await asyncio.wait_for(task, 30) == 0
    errors = _errors_by_request(records)
    assert set(errors) == {"missing", "own", "other", "invalid"}
    for name in errors:
        assert errors[name].error.type == "invalid_request_error"
        assert "reply_topic" in errors[name].error.message
    assert "does not exist" in errors["missing"].error.message
    assert "own topics" in errors["own"].error.message
    assert "not allowed" in errors["other"].error.message
    assert "not a valid Kafka topic name" in errors["invalid"].error.message
    assert {r.key.decode() for r in team_records} == {"team"}
    # Exactly one final per request on the default topic; nothing was written to the chunks topic.
    finals = [r.key.decode() for r in records if HEADER_FINAL in dict(r.headers)]
    assert sorted(finals) == sorted(wanted)
    own = await read_topic(kafka_settings, f"{prefix}.chunks", until=lambda rs: len(rs) >= len(chunks))
    assert len(own) == len(chunks)


@pytest.mark.kafka
async def test_generate_refuses_a_forbidden_reply_topic_and_answers_on_the_default_topic(
        kafka_settings, make_topics, tiny_model_dir):
    from tests.test_generate_worker import produce, request_record, start_worker
    from tests.kafka_helpers import chunks_finished
    from workers.generate.engine import Engine
    from workers.kafka.records import decode_message
    from schemas import GenerateChunk

    await make_topics(kafka_settings, partitions=1)
    engine = Engine(str(tiny_model_dir), max_batch=4)
    forbidden = GenerateRequest(request_id="forbidden", prompt_token_ids=[1, 5, 6], reply_topic=kafka_settings.topic("requests"),
                                sampling=SamplingParams(max_tokens=3))
    fine = GenerateRequest(request_id="fine", prompt_token_ids=[1, 5, 6],  # (no EOS: "length" on any CPU)
                           sampling=SamplingParams(max_tokens=3, ignore_eos=True))
    stop, task = await start_worker(kafka_settings, engine)
    try:
        await produce(kafka_settings, [request_record(forbidden), request_record(fine)])
        records = await read_topic(kafka_settings, kafka_settings.topic("chunks"),
                                   until=chunks_finished({"forbidden", "fine"}))
    finally:
        stop.set()
    await asyncio.wait_for(task, 30)
    chunks = {c.request_id: c for c in (decode_message(r, GenerateChunk) for r in records) if c.finish_reason}
    assert chunks["forbidden"].finish_reason == "error"
    assert chunks["forbidden"].reply_topic is None  # the error goes to the default topic
    assert "one of this deployment's own topics" in chunks["forbidden"].error.message
    assert chunks["fine"].finish_reason == "length"
    # Nothing was written to the requests topic but our two requests.
    own = await read_topic(kafka_settings, kafka_settings.topic("requests"), until=lambda rs: len(rs) >= 2)
    assert len(own) == 2


@pytest.mark.kafka
async def test_a_result_its_reply_topic_refuses_becomes_an_error_and_the_partition_moves_on(
        kafka_settings, make_topics, tiny_model_dir, monkeypatch):
    """A reply topic is the client's; one created with a record limit below a result's
    size (`max.message.bytes`) makes the broker refuse that result. On the old code the
    request got no answer, its chunk's offset stayed held (the partition committed no
    further, whatever came after), and as the producer is idempotent every later result
    for that reply topic's partition was refused too (a hole in its sequence numbers).
    The derender reads a reply topic's limit when it meets it and sizes its results to it
    (the test after this one); here it cannot, as where the broker's ACLs do not let it
    describe the topic, so the broker's refusal is what tells it."""
    async def not_described(self, topics):
        pass
    monkeypatch.setattr("workers.kafka.topic_metadata.TopicCounts._read_limits", not_described)
    from tests.kafka_helpers import create_topic
    from tests.test_derender_worker import all_final, produce_chunks, start_worker

    await make_topics(kafka_settings, partitions=1)
    small_topic = f"{kafka_settings.topic_prefix}.reply.small-records"
    await create_topic(kafka_settings, small_topic, max_message_bytes=2000)
    ids, logprobs = _ids_with_five_logprobs(tiny_model_dir)
    # ~8.6 kB of JSON in one result: within the worker's limit (1 MB), over the topic's
    whole = make_chunks("whole", ids, [4] * 30, positions=logprobs, prompt_tail=[1, 5], reply_topic=small_topic,
                        output=OutputOptions(kind="completion", stream=False, top_logprobs=5))
    # a streamed request whose second result is over it (its first may share its batch, and go with it)
    streamed = make_chunks("streamed", ids[:42], [1, 40, 1], positions=logprobs[:42], prompt_tail=[1, 5],
                           reply_topic=small_topic, output=OutputOptions(kind="chat", stream=True, top_logprobs=5))
    # the same, but its last chunk never comes (generate stops it on the error's cancel):
    # the error must release its first chunk's hold, which waited for that chunk before
    cut = make_chunks("cut", ids[:42], [1, 40, 1], positions=logprobs[:42], prompt_tail=[1, 5],
                      reply_topic=small_topic, output=OutputOptions(kind="chat", stream=True, top_logprobs=5))[:2]
    default = make_chunks("default", ids[:3], [1, 2], prompt_tail=[1, 5])
    # one answered there before: the broker knows the derender's producer on that partition
    before = make_chunks("before", ids[:3], [1, 2], prompt_tail=[1, 5], reply_topic=small_topic)
    # then, once those are answered, requests for the same reply topic partition
    later = [make_chunks(f"later-{i}", ids[:3], [1, 2], prompt_tail=[1, 5], reply_topic=small_topic)
             for i in range(3)]
    chunks = before + whole + streamed + cut + default + [chunk for request in later for chunk in request]
    stop, task = await start_worker(kafka_settings, tiny_model_dir)
    try:
        await produce_chunks(kafka_settings, before, {"before": 0})
        await read_topic(kafka_settings, small_topic, timeout=60, until=all_final({"before"}))
        await produce_chunks(kafka_settings, whole + streamed + cut + default,
                             {"whole": 0, "streamed": 0, "cut": 0, "default": 0})
        records = await read_topic(kafka_settings, kafka_settings.topic("results"), timeout=60,
                                   until=all_final({"whole", "streamed", "cut", "default"}))
        later_ids = {f"later-{i}" for i in range(3)}
        await produce_chunks(kafka_settings, chunks[len(before + whole + streamed + cut + default):],
                             {rid: 0 for rid in later_ids})
        replies = await read_topic(kafka_settings, small_topic, timeout=60, until=all_final(later_ids))
        await _committed_to(kafka_settings, 0, len(chunks), "the partition's commits stopped at a refused result")
        assert not task.done(), "the derender worker stopped"
    finally:
        stop.set()
    assert await asyncio.wait_for(task, 30) == 0
    records = await read_topic(kafka_settings, kafka_settings.topic("results"), timeout=60,
                               until=all_final({"whole", "streamed", "cut", "default"}))
    errors = _errors_by_request(records)
    assert set(errors) == {"whole", "streamed", "cut"}
    for name, error in errors.items():
        assert error.error.type == "invalid_request_error"
        assert error.error.message.startswith(f"derender: reply_topic {small_topic!r} refused the result as too "
                                              f"large (MessageSizeTooLargeError): the topic's max.message.bytes "
                                              f"must hold"), error.error.message
    # one answer each: the error in place of the refused result, final
    assert sorted(r.key.decode() for r in records) == ["cut", "default", "streamed", "whole"]
    for name in (b"streamed", b"cut"):
        assert [HEADER_FINAL in dict(r.headers) for r in records if r.key == name] == [True]
        assert [r.key for r in replies if r.key in (b"whole", name)] in ([], [name])
    # the requests after the refused results got their answers where they asked
    assert (sorted(r.key.decode() for r in replies if r.key not in (b"streamed", b"cut"))
            == sorted({"before"} | later_ids))


@pytest.mark.kafka
async def test_a_reply_topic_deleted_mid_stream_ends_its_request_with_an_error_and_the_partition_moves_on(
        kafka_settings, make_topics, tiny_model_dir, monkeypatch, caplog):
    """Results for a reply topic its client deleted while they were on their way waited in
    the producer for good (it never expires a batch), and the chunk's offset with them: the
    partition committed no further, and the worker's stop waited out its bound. They now
    fail once the topic has been missing from the metadata for DELETED_TOPIC_WAIT_S (2 s
    here), and the request gets an error on the default topic like any refused result.
    Results handled after the worker saw the topic go were worse: each publish waited 30 s
    in aiokafka (the whole loop with it) before it failed."""
    from tests.kafka_helpers import create_topic, delete_topic
    from tests.test_derender_worker import all_final, produce_chunks, start_worker

    monkeypatch.setattr("workers.kafka.topic_metadata.DELETED_TOPIC_WAIT_S", 2.0)
    await make_topics(kafka_settings, partitions=1)
    doomed = f"{kafka_settings.topic_prefix}.reply.doomed"
    await create_topic(kafka_settings, doomed)
    stream = OutputOptions(kind="completion", stream=True)
    long = make_chunks("long", [5, 6, 7, 8, 9, 10], output=stream, prompt_tail=[1], reply_topic=doomed)
    after = make_chunks("after", [5, 6], [1, 1], prompt_tail=[1])
    stop, task = await start_worker(kafka_settings, tiny_model_dir)
    try:
        await produce_chunks(kafka_settings, long[:2], {"long": 0})
        await read_topic(kafka_settings, doomed, until=lambda rs: len(rs) >= 2)
        await delete_topic(kafka_settings, doomed)
        await produce_chunks(kafka_settings, long[2:] + after, {"long": 0, "after": 0})
        records = await read_topic(kafka_settings, kafka_settings.topic("results"), timeout=60,
                                   until=all_final({"long", "after"}))
        await _committed_to(kafka_settings, 0, len(long + after),
                            "the partition's commits stopped at results for a deleted topic")
        assert not task.done(), "the derender worker stopped"
    finally:
        stop.set()
    assert await asyncio.wait_for(task, 30) == 0
    (error,) = _errors_by_request(records).values()
    assert error.error.type == "invalid_request_error"
    # queued before the worker saw the topic go ("was deleted"), or handled after ("does not exist")
    message = error.error.message
    assert message.startswith("derender: ") and repr(doomed) in message, message
    assert "was deleted while the result was on its way to it" in message or "does not exist" in message, message
    assert [r.key for r in records if HEADER_FINAL in dict(r.headers)].count(b"long") == 1
    # and no "Future exception was never retrieved" in the worker's log for the failed
    # batches' futures (asyncio logs it when they are collected)
    import gc
    gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


@pytest.mark.kafka
async def test_a_reply_topics_records_that_cannot_be_sent_fail_their_futures_not_the_batch(kafka_settings, make_topics):
    """The derender sends a reply topic's results in its producer batches, beside the
    results topic's (workers/derender/worker.py `_publish_pending`). A send for a client's
    topic that fails at once (the topic gone, or never there) fails the futures of that
    topic's records, which the derender answers as refused; it used to raise, and a
    raise there stops the worker. The deployment's own topics (`own_topics`) still raise."""
    from schemas import Cancel
    from workers.kafka.clients import make_producer
    from workers.kafka.publisher import Publisher, TopicUnavailable
    from workers.kafka.records import Outgoing

    await make_topics(kafka_settings, partitions=1)
    results, gone = kafka_settings.topic("results"), f"{kafka_settings.topic_prefix}.reply.gone"
    records = [Outgoing(results, "a", Cancel(request_id="a"), partition=0),
               Outgoing(gone, "b", Cancel(request_id="b"), partition=0),
               Outgoing(results, "c", Cancel(request_id="c"), partition=0)]
    producer = make_producer(kafka_settings)
    await producer.start()
    try:
        publisher = Publisher(producer, kafka_settings.topic("dlq"))
        futures = await publisher.publish_batch(records, own_topics=(results,))
        answers = await asyncio.gather(*futures, return_exceptions=True)
        with pytest.raises(TopicUnavailable):
            await publisher.publish_batch(records[1:2], own_topics=(gone,))
    finally:
        await producer.stop()
    assert isinstance(answers[1], TopicUnavailable) and gone in str(answers[1])
    assert answers[0] is answers[2] and answers[0].offset == 0  # (one producer batch: its future's answer)
    read = await read_topic(kafka_settings, results, until=lambda r: len(r) >= 2)
    assert [r.key for r in read] == [b"a", b"c"]


@pytest.mark.kafka
async def test_a_reply_topic_found_once_is_not_looked_up_again_before_its_first_send(kafka_settings, make_topics):
    """A topic is looked up with one metadata request for every topic of the cluster. The
    answer was kept only while the producer's own metadata knew the topic, which it did
    only after a first send: so until then every lookup (the derender makes one per chunk
    naming the topic) asked for the whole cluster's metadata again, 226 times in one test
    of 240 chunks, at 0.1-0.8 s each against a broker with ~5,000 topics."""
    from tests.kafka_helpers import create_topic
    from workers.kafka.clients import make_producer
    from workers.kafka.publisher import Publisher

    await make_topics(kafka_settings, partitions=1)
    reply = f"{kafka_settings.topic_prefix}.reply.looked-up"
    producer = make_producer(kafka_settings)
    await producer.start()
    try:
        # A worker's producer has sent to its own topics: its metadata covers those only.
        await producer.send_and_wait(kafka_settings.topic("results"), b"x", key=b"x")
        await create_topic(kafka_settings, reply, partitions=3)  # a client's, made later
        publisher = Publisher(producer, kafka_settings.topic("dlq"))
        client, whole_cluster_requests = producer.client, []
        fetch_all_metadata = client.fetch_all_metadata

        async def counted():  # the real request, counted
            whole_cluster_requests.append(1)
            return await fetch_all_metadata()

        client.fetch_all_metadata = counted
        assert [await publisher.partition_count(reply) for _ in range(20)] == [3] * 20
        assert [publisher.known_partitions(reply) for _ in range(3)] == [3] * 3
    finally:
        await producer.stop()
    assert len(whole_cluster_requests) == 1, len(whole_cluster_requests)


@pytest.mark.kafka
async def test_a_topic_known_from_the_first_metadata_stays_known_after_the_producer_sends(kafka_settings,
                                                                                         make_topics):
    """A producer's metadata names every topic until it tracks one: a send to a topic it
    did not know (a client's reply topic, made later) makes it track that one, and from
    then on its refreshes name only the topics it tracks. A topic counted from the first
    metadata (the DLQ at a worker's start) then dropped out: its next record paid a
    whole-cluster lookup, and a lookup that failed raised from the DLQ copy."""
    from tests.kafka_helpers import create_topic
    from workers.kafka.clients import make_producer
    from workers.kafka.publisher import Publisher

    await make_topics(kafka_settings, partitions=2)
    dlq, reply = kafka_settings.topic("dlq"), f"{kafka_settings.topic_prefix}.reply.later"
    producer = make_producer(kafka_settings)
    await producer.start()
    try:
        publisher = Publisher(producer, dlq)
        await producer.client.force_metadata_update()  # (tracking nothing yet: it names every topic)
        assert producer.client.cluster.partitions_for_topic(dlq)
        assert await publisher.partition_count(dlq) == 2
        await create_topic(kafka_settings, reply)
        await producer.send_and_wait(reply, b"x", key=b"x")  # aiokafka tracks the reply topic
        await producer.client.force_metadata_update()
        assert producer.client.cluster.partitions_for_topic(dlq) == {0, 1}
        assert publisher.known_partitions(dlq) == 2
    finally:
        await producer.stop()


def test_a_records_partition_past_its_topics_count_is_its_keys_as_aiokafka_picks_it():
    """A reply topic with fewer partitions than the chunks topic: the publisher sends a
    result to its key's partition (workers/kafka/topic_metadata.py `key_partition`), in a batch
    or alone, where aiokafka's default partitioner (Java's) puts a record sent without one."""
    from aiokafka.partitioner import DefaultPartitioner

    from workers.kafka.publisher import key_partition

    for i in range(500):
        key = f"cmpl-{i * 7919}"
        for count in (1, 2, 3, 8):
            assert key_partition(key, count) == DefaultPartitioner()(key.encode(), list(range(count)), [])


@pytest.mark.kafka
async def test_results_for_a_reply_topic_with_fewer_partitions_go_in_batches_to_their_keys_partition(
        kafka_settings, make_topics):
    from schemas import Cancel
    from tests.kafka_helpers import create_topic
    from workers.kafka.clients import make_producer
    from workers.kafka.publisher import Publisher, key_partition
    from workers.kafka.records import Outgoing, decode_message

    await make_topics(kafka_settings, partitions=1)
    two = f"{kafka_settings.topic_prefix}.reply.two"
    await create_topic(kafka_settings, two, partitions=2)
    keys = [f"r{i}" for i in range(8)]
    records = [Outgoing(two, key, Cancel(request_id=f"{key}-{n}"), partition=5) for n in range(3) for key in keys]
    producer = make_producer(kafka_settings)
    await producer.start()
    try:
        publisher = Publisher(producer, kafka_settings.topic("dlq"))
        assert await publisher.partition_count(two) == 2
        futures = await publisher.publish_batch(records[:-1])
        assert len(set(futures)) <= 2  # one producer batch per partition, not a send per record
        futures.append(await publisher.publish(records[-1]))
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    read = await read_topic(kafka_settings, two, until=lambda r: len(r) >= len(records))
    for key in keys:
        mine = sorted((r for r in read if r.key == key.encode()), key=lambda r: r.offset)
        assert {r.partition for r in mine} == {key_partition(key, 2)}
        assert [decode_message(r, Cancel).request_id for r in mine] == [f"{key}-{n}" for n in range(3)]


@pytest.mark.kafka
async def test_a_reply_topic_with_fewer_partitions_gets_every_result_and_each_chunk_partition_commits(
        kafka_settings, make_topics, tiny_model_dir):
    """Requests from two chunk partitions naming a one-partition reply topic: their results
    share that partition's producer batches (workers/derender/worker.py `_publish_pending`),
    and each chunk partition's offsets are released by those batches' acknowledgements, so
    both partitions commit to their end."""
    from tests.kafka_helpers import create_topic
    from tests.test_derender_worker import all_final, produce_chunks, start_worker

    await make_topics(kafka_settings, partitions=2)
    one = f"{kafka_settings.topic_prefix}.reply.one"
    await create_topic(kafka_settings, one, partitions=1)
    stream = OutputOptions(kind="completion", stream=True)
    requests = {f"r{i}": i % 2 for i in range(6)}
    chunks = [make_chunks(rid, [5, 6, 7, 8], output=stream, prompt_tail=[1], reply_topic=one) for rid in requests]
    stop, task = await start_worker(kafka_settings, tiny_model_dir)
    try:
        await produce_chunks(kafka_settings, [c for i in range(4) for request in chunks for c in request[i:i + 1]],
                             requests)
        replies = await read_topic(kafka_settings, one, until=all_final(set(requests)))
        for partition in (0, 1):
            await _committed_to(kafka_settings, partition, 12, f"chunks[{partition}]'s commits")
        assert not task.done(), "the derender worker stopped"
    finally:
        stop.set()
    assert await asyncio.wait_for(task, 30) == 0
    assert {r.partition for r in replies} == {0}
    assert sorted(r.key.decode() for r in replies) == sorted(rid for rid in requests for _ in range(4))


@pytest.mark.kafka
async def test_a_reply_topic_with_a_small_record_limit_gets_every_result_that_fits_it(
        kafka_settings, make_topics, tiny_model_dir):
    """A client's reply topic may take smaller record batches (`max.message.bytes`) than
    the derender makes (256 KB). The broker refuses a batch over that whole: the requests
    whose results shared it got an error, though each result fitted the topic (a busy
    moment is enough to grow a batch past it). The derender now reads the topic's limit
    when it first meets it, cuts that topic's batches to it, and ends only a request whose
    own result is over it, with an error that names the limit."""
    from tests.kafka_helpers import create_topic, read_to_end
    from tests.test_derender_worker import all_final, produce_chunks, start_worker

    await make_topics(kafka_settings, partitions=1)
    small = f"{kafka_settings.topic_prefix}.reply.small-batches"
    await create_topic(kafka_settings, small, max_message_bytes=6000)
    ids, logprobs = _ids_with_five_logprobs(tiny_model_dir)
    stream = OutputOptions(kind="completion", stream=True, top_logprobs=5)
    # 40 requests x 6 results of ~1 kB each (5 logprobs a token, 2 tokens a chunk): far more
    # than 6000 bytes for the one partition once they are produced together
    small_ones = {f"r{i}": make_chunks(f"r{i}", ids[i:i + 12], [2] * 6, positions=logprobs[i:i + 12],
                                       prompt_tail=[1, 5], reply_topic=small, output=stream) for i in range(40)}
    # ~8.6 kB of JSON in one non-streamed result: over the topic's limit alone
    whole = make_chunks("whole", ids, [4] * 30, positions=logprobs, prompt_tail=[1, 5], reply_topic=small,
                        output=OutputOptions(kind="completion", stream=False, top_logprobs=5))
    chunks = [chunk for request in small_ones.values() for chunk in request] + whole
    wanted = set(small_ones) | {"whole"}
    stop, task = await start_worker(kafka_settings, tiny_model_dir)
    try:
        await produce_chunks(kafka_settings, chunks, {rid: 0 for rid in wanted})
        replies = await read_topic(kafka_settings, small, timeout=60, until=all_final(wanted))
        await _committed_to(kafka_settings, 0, len(chunks), "the partition's commits stopped")
        assert not task.done(), "the derender worker stopped"
    finally:
        stop.set()
    assert await asyncio.wait_for(task, 30) == 0
    results = await read_to_end(kafka_settings, kafka_settings.topic("results"))
    assert results == [], [decode_result(r.value, r.headers) for r in results]  # (no refusal answered there)
    errors = _errors_by_request(replies)
    assert set(errors) == {"whole"}, {k: e.error.message for k, e in errors.items()}
    message = errors["whole"].error.message
    assert message.startswith(f"derender: result too large for reply_topic {small!r}: "), message
    assert "over the 5488 its max.message.bytes leaves for a record" in message, message
    for rid in small_ones:
        assert sum(r.key.decode() == rid for r in replies) == 6, rid  # every result, once
    assert max(len(r.value) for r in replies) < 5488


@pytest.mark.kafka
async def test_the_publisher_cuts_batches_to_a_topics_record_limit_and_reads_it_again(
        kafka_settings, make_topics, monkeypatch):
    """`Publisher.publish_batch` made one batch per partition up to the producer's 256 KB,
    which a topic with a lower `max.message.bytes` refuses whole. The limit is read with
    the topic's partitions, batches for it are cut to it, and a raised limit is read again
    (`TopicCounts.recheck_limits`, every LIMITS_RECHECK_S)."""
    from schemas import Cancel
    from tests.kafka_helpers import create_topic, set_max_message_bytes, wait_for
    from workers.kafka.clients import make_producer
    from workers.kafka.publisher import Publisher
    from workers.kafka.records import Outgoing

    monkeypatch.setattr("workers.kafka.topic_metadata.LIMITS_RECHECK_S", 0.5)
    await make_topics(kafka_settings, partitions=1)
    topic = f"{kafka_settings.topic_prefix}.reply.cut"
    await create_topic(kafka_settings, topic, max_message_bytes=3000)
    records = [Outgoing(topic, f"k{i}", Cancel(request_id=f"k{i}", reason="x" * 400), partition=0)
               for i in range(40)]
    producer = make_producer(kafka_settings)
    await producer.start()
    try:
        publisher = Publisher(producer, kafka_settings.topic("dlq"))
        assert await publisher.partition_count(topic) == 1
        assert publisher.record_limit(topic) == 3000 - 512
        futures = await publisher.publish_batch(records, own_topics=())
        answers = await asyncio.gather(*futures, return_exceptions=True)
        one = await publisher.publish(Outgoing(topic, "alone", Cancel(request_id="alone"), partition=0))
        await one
        await set_max_message_bytes(kafka_settings, topic, 2_000_000)
        await wait_for(lambda: publisher.topics.recheck_limits() or publisher.record_limit(topic)
                       == publisher.max_record_bytes, timeout=20, what="the raised limit read again")
    finally:
        await producer.stop()
    refused = [a for a in answers if isinstance(a, BaseException)]
    assert refused == [], refused[0]
    assert len({id(f) for f in futures}) > 1  # (batches under the limit: one was 18 kB, refused whole)
    read = await read_topic(kafka_settings, topic, until=lambda r: len(r) >= 41)
    assert [r.key.decode() for r in read] == [f"k{i}" for i in range(40)] + ["alone"]


@pytest.mark.kafka
async def test_a_derender_whose_results_topic_is_deleted_stops_with_an_error_that_names_it(
        kafka_settings, make_topics, tiny_model_dir, monkeypatch):
    """The deployment's own results topic deleted under a running derender is a broken
    deployment, not a client's refusal: the worker stops, naming the topic, and commits
    nothing past the chunks it could not answer (their next owner redoes them)."""
    from tests.kafka_helpers import committed_offsets, delete_topic
    from tests.test_derender_worker import produce_chunks, start_worker
    from aiokafka import TopicPartition

    monkeypatch.setattr("workers.kafka.topic_metadata.DELETED_TOPIC_WAIT_S", 2.0)
    await make_topics(kafka_settings, partitions=1)
    results_topic = kafka_settings.topic("results")
    before = make_chunks("before", [5, 6], [1, 1], prompt_tail=[1])
    after = make_chunks("after", [5, 6], [1, 1], prompt_tail=[1])
    stop, task = await start_worker(kafka_settings, tiny_model_dir)
    try:
        await produce_chunks(kafka_settings, before, {"before": 0})
        await read_topic(kafka_settings, results_topic, until=lambda rs: any(
            r.key == b"before" and HEADER_FINAL in dict(r.headers) for r in rs))
        await delete_topic(kafka_settings, results_topic)
        await produce_chunks(kafka_settings, after, {"after": 0})
        with pytest.raises(Exception) as failed:
            await asyncio.wait_for(task, 120)
    finally:
        stop.set()
    assert f"topic {results_topic!r} does not exist" in str(failed.value), repr(failed.value)
    tp = TopicPartition(kafka_settings.topic("chunks"), 0)
    committed = (await committed_offsets(kafka_settings, f"{kafka_settings.topic_prefix}-der", [tp])).get(tp)
    assert committed is None or committed.offset <= len(before), committed
