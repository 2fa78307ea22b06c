"""Hostile input against live workers on the real broker: >= 10,000 bad records over the
requests, chunks and cancel topics, interleaved with valid requests (seeded).

What a user of the pipeline must be able to rely on, whatever other clients send:
- both workers keep running;
- every valid request gets its complete result (a re-sent id: the first answer stands,
  and the re-send gets at most an "already used" error);
- every decodable invalid request gets exactly one result: its error;
- every undecodable record is in the DLQ, bytes and source coordinates intact;
- both consumer groups end with nothing left to commit (lag 0).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import NewTopic

from schemas import (JSON, MSGPACK, Cancel, ErrorResponse, GenerateChunk, GenerateLogProb, GenerateLogProbsContent,
                     GenerateRequest, OutputOptions, SamplingParams, encode, headers_for)
from tests.kafka_helpers import committed_offsets, read_topic, read_to_end
from workers.client import decode_result
from workers.derender.service import DerenderWorkerConfig, run_derender_worker
from workers.generate.engine import Engine
from workers.generate.service import GenerateWorkerConfig, run_generate_worker
from workers.kafka.clients import make_admin, make_producer
from schemas.headers import (HEADER_ATTEMPT, HEADER_DLQ_OFFSET, HEADER_DLQ_PARTITION, HEADER_DLQ_TOPIC, HEADER_FINAL,
                             HEADER_SEQ)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

SEED = 20261130
PARTITIONS = 2
BAD_REQUESTS = 6_000
BAD_CHUNKS = 3_000
BAD_CANCELS = 1_200
VALID = 36
RARE = 18  # the records that each once stopped a worker (or held a partition): `rare`
NOT_MSGPACK = b"\xc1"  # a byte msgpack never uses, and not '{': undecodable as either codec


class Plan:
    """What was sent, and what each record must lead to."""

    def __init__(self):
        self.records: list[tuple[str, str | None, bytes | None, list]] = []  # (role, key, value, headers)
        self.expect: list[str] = []  # per record: "dlq", "error", "valid", "abort", "dup", "none"
        self.ids: list[str | None] = []
        self.kinds: Counter = Counter()

    def add(self, role: str, key, value, headers, expect: str, request_id: str | None, kind: str):
        self.records.append((role, key, value, list(headers)))
        self.expect.append(expect)
        self.ids.append(request_id)
        self.kinds[f"{role}:{kind}"] += 1


def _request(rid: str, **fields) -> GenerateRequest:
    sampling = fields.pop("sampling", SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    return GenerateRequest(request_id=rid, prompt_token_ids=fields.pop("prompt", [1, 5, 6, 7]),
                           sampling=sampling, **fields)


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


def build_plan(prefix: str, rng: random.Random) -> tuple[Plan, dict[str, GenerateRequest]]:
    plan = Plan()
    valid: dict[str, GenerateRequest] = {}
    jh = [("content-type", JSON.encode())]
    for i in range(VALID):
        output = OutputOptions(kind="chat" if i % 2 else "completion", stream=i % 3 != 0, include_usage=True,
                               top_logprobs=2 if i % 4 == 0 else 0, stop=["zzzq"] if i % 5 == 0 else [])
        sampling = SamplingParams(max_tokens=1 + i % 4, temperature=0.0 if i % 2 else 0.9, seed=i,
                                  ignore_eos=True, logprobs=3 if i % 4 == 0 else None)
        valid[f"ok-{i}"] = _request(f"ok-{i}", prompt=[1] + [rng.randrange(3, 1990) for _ in range(1 + i % 9)],
                                    sampling=sampling, output=output,
                                    reply_topic=f"{prefix}.reply.fuzz" if i % 6 == 0 else None)
    valid_list = list(valid.values())

    def bad_request(n: int) -> None:
        rid = f"bad-{n}"
        kind = n % 22
        if kind == 0:
            plan.add("requests", rid, NOT_MSGPACK + rng.randbytes(rng.randrange(0, 64)), [], "dlq", None, "random bytes")
        elif kind == 1:
            plan.add("requests", rid, _json({"request_id": rid, "prompt_token_ids": [1, 2]})[:-7], jh, "dlq", None,
                     "broken JSON")
        elif kind == 2:
            data = encode(_request(rid))
            plan.add("requests", rid, data[: rng.randrange(1, len(data) - 1)], [], "dlq", None, "truncated msgpack")
        elif kind == 3:
            plan.add("requests", rid, None, [], "dlq", None, "tombstone")
        elif kind == 4:
            plan.add("requests", rid, encode(_request(rid)), [("content-type", b"text/plain")], "dlq", None,
                     "unsupported content-type")
        elif kind == 5:
            plan.add("requests", rid, _json({"prompt_token_ids": [1, 2, 3]}), jh, "dlq", None, "no request_id")
        elif kind == 6:
            plan.add("requests", rid, _json({"request_id": n, "prompt_token_ids": [1]}), jh, "dlq", None,
                     "request_id of the wrong type")
        elif kind == 7:
            plan.add("requests", rid, _json({"request_id": rid, "prompt_token_ids": "1,2,3"}), jh, "error", rid,
                     "wrong types")
        elif kind == 8:
            field, value = rng.choice([("max_tokens", -5), ("top_p", 2.0), ("logprobs", 10**9), ("temperature", -1),
                                       ("seed", 2**70), ("top_k", -7), ("min_p", 3), ("min_tokens", -1)])
            body = {"request_id": rid, "prompt_token_ids": [1, 2], "sampling": {field: value}}
            plan.add("requests", rid, _json(body), jh, "error", rid, "out-of-range number")
        elif kind == 9:
            prompt = [1] + [rng.randrange(3, 1990) for _ in range(2100 if n % 660 != 9 else 290_000)]
            plan.add("requests", rid, encode(_request(rid, prompt=prompt)), [], "error", rid,
                     "prompt over the context" if n % 660 != 9 else "prompt near the record size limit")
        elif kind == 10:
            plan.add("requests", rid, encode(_request(rid, prompt=[1, 99_999])), [], "error", rid, "id out of vocabulary")
        elif kind == 11:
            topic = rng.choice([f"{prefix}.requests", f"{prefix}.chunks", f"{prefix}.cancel", f"{prefix}.dlq",
                                "other-deployment.results", "bad topic!", "__consumer_offsets"])
            plan.add("requests", rid, encode(_request(rid, reply_topic=topic)), [], "error", rid, "forbidden reply topic")
        elif kind == 12 and n % 44 == 12:  # the model runs until derender refuses: keep them few
            plan.add("requests", rid, encode(_request(rid, reply_topic=f"{prefix}.reply.missing-{n}")), [], "error",
                     rid, "missing reply topic")
        elif kind == 13:
            deadline = int(time.time() * 1000) - rng.randrange(1, 10**6)
            plan.add("requests", rid, encode(_request(rid, deadline_ms=deadline)), [], "abort", rid, "past deadline")
        elif kind == 14:
            headers = [("content-type", JSON.encode()), ("content-type", MSGPACK.encode()),
                       ("x-junk", rng.randbytes(8)), ("genpipe-schema", b"\xff\xfe"), ("empty", b"")]
            plan.add("requests", rid, encode(_request(rid, prompt=[1, 10**6])), headers, "error", rid,
                     "repeated and odd headers")
        elif kind == 15:
            body = {"request_id": rid, "prompt_token_ids": [1, 2], "output": {"top_logprobs": 500, "stop": [""]}}
            plan.add("requests", rid, _json(body), jh, "error", rid, "bad output options")
        elif kind == 16:
            body = {"request_id": rid, "prompt_token_ids": [], "reply_topic": None}
            plan.add("requests", rid, _json(body), jh, "error", rid, "empty prompt")
        elif kind == 17 and n == 17:
            plan.add("requests", rid, _json({"request_id": "x" * 300, "prompt_token_ids": [1]}), jh, "error",
                     "x" * 300, "overlong request_id")
        elif kind == 17:
            plan.add("requests", rid, _json([1, 2, 3]), jh, "dlq", None, "not a map")
        elif kind == 18:
            plan.add("requests", rid, b"   ", jh, "dlq", None, "blank")
        elif kind == 19:
            plan.add("requests", rid, _json({"request_id": rid, "prompt_token_ids": [1, 2],
                                             "sampling": {"stop_token_ids": [-3]}}), jh, "error", rid, "bad stop id")
        elif kind == 20:
            plan.add("requests", None, NOT_MSGPACK + rng.randbytes(16), [], "dlq", None, "no key")
        else:
            plan.add("requests", rid, _json({"request_id": rid, "prompt_token_ids": [1.5, 2]}), jh, "error", rid,
                     "float ids")

    def bad_chunk(n: int) -> None:
        rid = f"chunk-{n}"
        kind = n % 6
        if kind == 0:
            plan.add("chunks", rid, NOT_MSGPACK + rng.randbytes(rng.randrange(0, 40)), [], "dlq", None, "random bytes")
        elif kind == 1:
            plan.add("chunks", rid, None, [], "dlq", None, "tombstone")
        elif kind == 2:
            plan.add("chunks", rid, _json({"request_id": rid, "attempt": 5, "seq": "zero"}), jh, "dlq", None,
                     "wrong types")
        elif kind == 3:  # a new request whose first chunk holds an id out of vocabulary
            chunk = GenerateChunk(request_id=rid, attempt="a", seq=0, token_ids=[5, 50_000], finish_reason="length",
                                  output=OutputOptions())
            plan.add("chunks", rid, encode(chunk), headers_for(chunk), "error", rid, "id out of vocabulary")
        elif kind == 4:  # a straggler of an unknown request: dropped by design, no answer
            chunk = GenerateChunk(request_id=rid, attempt="a", seq=3, token_ids=[5])
            plan.add("chunks", rid, encode(chunk), headers_for(chunk), "none", rid, "unknown request past seq 0")
        else:
            chunk = GenerateChunk(request_id=rid, attempt="a", seq=0, token_ids=[5], finish_reason="stop",
                                  reply_topic=f"{prefix}.requests")
            plan.add("chunks", rid, encode(chunk), headers_for(chunk), "error", rid, "forbidden reply topic")

    def bad_cancel(n: int) -> None:
        kind = n % 4
        if kind == 0:
            plan.add("cancel", f"c-{n}", rng.randbytes(rng.randrange(0, 30)), [], "none", None, "random bytes")
        elif kind == 1:
            plan.add("cancel", f"c-{n}", None, [], "none", None, "tombstone")
        elif kind == 2:
            plan.add("cancel", f"c-{n}", encode(Cancel(request_id=f"nobody-{n}")), [], "none", None, "unknown id")
        else:
            plan.add("cancel", f"c-{n}", _json({"request_id": ["x"]}), jh, "none", None, "wrong type")

    deep_json = b"[" * 5000 + b"]" * 5000  # past msgspec's ~1,000 levels: once a RecursionError

    def rare(n: int) -> None:
        """Records that each stopped a worker (or held a partition's commits) once."""
        rid = f"rare-{n}"
        long_id = "L" * 600_000  # its answer, keyed by it and carrying it, is over the topic's 1 MB
        body = {"request_id": rid, "prompt_token_ids": [1, 2]}
        cases = [
            ("requests", rid, _json(body)[:-1] + b', "junk": ' + deep_json + b"}", jh, "dlq", None,
             "nested 5,000 deep (JSON)"),
            ("requests", rid, b"\x82\xaarequest_id\xa1r\xa4junk" + b"\x91" * 5000 + b"\xc0", [], "dlq", None,
             "nested 5,000 deep (msgpack)"),
            ("requests", rid, _json({**body, "priority": 2**70}), jh, "error", rid, "integer past 64 bits"),
            ("requests", rid, _json({**body, "deadline_ms": 2**70}), jh, "error", rid, "integer past 64 bits"),
            ("requests", rid, _json({**body, "sampling": {"max_tokens": 2**70}}), jh, "error", rid,
             "integer past 64 bits"),
            ("requests", rid, _json({**body, "output": {"created": 10**30}}), jh, "error", rid,
             "integer past 64 bits"),
            ("requests", rid, _json({**body, "sampling": {"temperature": 1e39}}), jh, "error", rid,
             "temperature past float32"),
            ("requests", rid, _json({**body, "output": {"stop": [f"s{i}" for i in range(100_000)]}}), jh, "error",
             rid, "100,000 stop strings"),
            ("requests", "k-long", _json({**body, "request_id": long_id}), jh, "dlq", None,
             "request_id too long to answer"),
            ("requests", "k-long", _json({**body, "request_id": long_id, "prompt_token_ids": "x"}), jh, "dlq", None,
             "request_id too long to answer"),
            ("chunks", rid, deep_json, jh, "dlq", None, "nested 5,000 deep"),
            ("chunks", rid, encode(GenerateChunk(
                request_id=rid, attempt="a", seq=0, token_ids=[5], finish_reason="length", prompt_token_ids=[1, 5],
                prompt_logprobs=[None, GenerateLogProbsContent(token_id=5, logprob=-1.0, rank=1, top_logprobs=[
                    GenerateLogProb(50_000, -0.5, 1)])],
                output=OutputOptions(kind="completion", echo=True, top_logprobs=1))), [], "error", rid,
             "prompt candidate out of vocabulary"),
            # integers past 64 bits: once raised after the chunk was rendered (a latency
            # metric, a usage total), and stopped the derender on every restart
            ("chunks", rid, _json({"request_id": rid, "attempt": "a", "seq": 0, "finish_reason": "stop",
                                   "token_ids": [5], "sampled_at_ns": 10**400}), jh, "dlq", None,
             "integer past 64 bits"),
            ("chunks", rid, _json({"request_id": rid, "attempt": "a", "seq": 0, "finish_reason": "length",
                                   "token_ids": [5], "prompt_token_count": int("9" * 4300)}), jh, "dlq", None,
             "integer past 64 bits"),
            # searched for in every token's text: ~7 ms a token, the derender's loop held
            ("chunks", rid, encode(GenerateChunk(
                request_id=rid, attempt="a", seq=0, token_ids=[5] * 2000, finish_reason="length",
                output=OutputOptions(stop=[f"s{i}" for i in range(100_000)]))), [], "error", rid,
             "100,000 stop strings"),
            ("chunks", "k-long", encode(GenerateChunk(request_id=long_id, attempt="a", seq=0, token_ids=[5],
                                                      finish_reason="length")), [], "dlq", None,
             "request_id too long to keep"),  # (remembered as finished: 100,000 of them)
            ("cancel", rid, deep_json, jh, "none", None, "nested 5,000 deep"),
            ("cancel", "k-long", encode(Cancel(request_id=long_id)), [], "none", None, "id of 600,000 characters"),
        ]
        assert len(cases) == RARE
        role, key, value, headers, expect, request_id, kind = cases[n]
        plan.add(role, key, value, headers, expect, request_id, kind)

    makers = [bad_request] * BAD_REQUESTS + [bad_chunk] * BAD_CHUNKS + [bad_cancel] * BAD_CANCELS + [rare] * RARE
    rng.shuffle(makers)
    counters: Counter = Counter()
    valid_at = sorted(rng.sample(range(len(makers)), VALID))
    v = 0
    for i, make in enumerate(makers):
        while v < VALID and valid_at[v] == i:
            request = valid_list[v]
            plan.add("requests", request.request_id, encode(request), headers_for(request), "valid",
                     request.request_id, "valid")
            v += 1
        counters[make] += 1
        make(counters[make] - 1)
    for request in valid_list[:4]:  # re-sent ids, at the end
        plan.add("requests", request.request_id, encode(request), headers_for(request), "dup", request.request_id,
                 "re-sent id")
    return plan, valid


async def produce_plan(settings, plan: Plan) -> list:
    producer = make_producer(settings, max_request_size=2 << 20)
    await producer.start()
    try:
        futures = []
        for role, key, value, headers in plan.records:
            futures.append(await producer.send(settings.topic(role), value, key=None if key is None else key.encode(),
                                               headers=headers))
        return list(await asyncio.gather(*futures))
    finally:
        await producer.stop()


async def test_ten_thousand_bad_records_stop_nothing_and_lose_nothing(kafka_settings, make_topics, tiny_model_dir):
    rng = random.Random(SEED)
    prefix = kafka_settings.topic_prefix
    await make_topics(kafka_settings, partitions=PARTITIONS)
    admin = make_admin(kafka_settings)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(f"{prefix}.reply.fuzz", 1, 1)])
    finally:
        await admin.close()
    plan, valid = build_plan(prefix, rng)
    bad = sum(1 for e in plan.expect if e not in ("valid", "dup"))
    assert bad >= 10_000

    stop = asyncio.Event()
    ready_g, ready_d = asyncio.Event(), asyncio.Event()
    engine = Engine(str(tiny_model_dir), max_batch=8)
    gen = asyncio.ensure_future(run_generate_worker(
        kafka_settings, GenerateWorkerConfig(group_id=f"{prefix}-gen", max_batch=8), engine=engine, stop=stop,
        on_ready=ready_g.set))
    der = asyncio.ensure_future(run_derender_worker(
        kafka_settings, DerenderWorkerConfig(tokenizer=str(tiny_model_dir), group_id=f"{prefix}-der"),
        stop=stop, on_ready=ready_d.set))
    started = time.monotonic()
    try:
        await asyncio.wait_for(asyncio.gather(ready_g.wait(), ready_d.wait()), 60)
        metas = await produce_plan(kafka_settings, plan)
        answered = {plan.ids[i] for i, e in enumerate(plan.expect) if e in ("error", "valid", "abort")}
        default_ids = {plan.ids[i] for i, e in enumerate(plan.expect) if e in ("error", "abort")} | {
            rid for rid, r in valid.items() if r.reply_topic is None}
        results = await read_topic(kafka_settings, f"{prefix}.results", timeout=300, until=_finals_for(default_ids))
        replies = await read_topic(kafka_settings, f"{prefix}.reply.fuzz", timeout=60, until=_finals_for(
            {rid for rid, r in valid.items() if r.reply_topic is not None}))
        # Lag 0: each group commits up to the end of its input topic.
        for group, role in ((f"{prefix}-gen", "requests"), (f"{prefix}-der", "chunks")):
            await _wait_committed_to_end(kafka_settings, group, role)
        assert not gen.done() and not der.done(), "a worker stopped"
        dlq = await read_to_end(kafka_settings, f"{prefix}.dlq")
    finally:
        stop.set()
    assert await asyncio.wait_for(gen, 60) == 0
    assert await asyncio.wait_for(der, 60) == 0
    elapsed = time.monotonic() - started

    by_id: dict[str, list] = {}
    for record in results + replies:
        by_id.setdefault(record.key.decode(), []).append(record)
    # Valid requests: one complete answer (the final attempt's seqs 0..n, a final, no error).
    for rid, request in valid.items():
        _assert_complete(request, by_id.get(rid, []))
    # Re-sent ids: the first answer stands; at most one "already used" error after it.
    dups = {plan.ids[i] for i, e in enumerate(plan.expect) if e == "dup"}
    for rid in dups:
        extra = [decode_result(r.value, r.headers) for r in by_id[rid]
                 if isinstance(decode_result(r.value, r.headers), ErrorResponse)]
        assert len(extra) <= 1 and all("already used" in e.error.message for e in extra)
    # Decodable invalid requests and chunks: exactly one record, the error.
    for i, expect in enumerate(plan.expect):
        rid = plan.ids[i]
        if expect == "error":
            records = by_id.get(rid, [])
            assert len(records) == 1, (plan.records[i][:2], len(records))
            value = decode_result(records[0].value, records[0].headers)
            assert isinstance(value, ErrorResponse) and HEADER_FINAL in dict(records[0].headers), rid
        elif expect == "abort":
            records = by_id[rid]
            assert len(records) == 1
            value = decode_result(records[0].value, records[0].headers)
            assert value.choices[0].finish_reason == "abort"
        elif expect == "none" and rid is not None:
            assert rid not in by_id, rid
    assert answered <= set(by_id)
    # Undecodable: all in the DLQ, once, with the original bytes and where they came from.
    in_dlq = Counter()
    for record in dlq:
        h = dict(record.headers)
        in_dlq[(h[HEADER_DLQ_TOPIC].decode(), int(h[HEADER_DLQ_PARTITION]), int(h[HEADER_DLQ_OFFSET]))] += 1
    expected_dlq = {}
    for i, expect in enumerate(plan.expect):
        if expect == "dlq":
            role, _, value, _ = plan.records[i]
            expected_dlq[(kafka_settings.topic(role), metas[i].partition, metas[i].offset)] = value
    assert set(in_dlq) == set(expected_dlq) and max(in_dlq.values()) == 1
    dlq_values = {(dict(r.headers)[HEADER_DLQ_TOPIC].decode(), int(dict(r.headers)[HEADER_DLQ_PARTITION]),
                   int(dict(r.headers)[HEADER_DLQ_OFFSET])): r.value for r in dlq}
    assert all(dlq_values[k] == v for k, v in expected_dlq.items())

    outcome = Counter(plan.expect)
    print(f"\nfuzz (seed {SEED}): {len(plan.records)} records, {bad} bad, {VALID} valid + {len(dups)} re-sent; "
          f"outcomes {dict(outcome)}; results {len(results)}, replies {len(replies)}, dlq {len(dlq)}; "
          f"{elapsed:.1f} s")
    for kind, count in sorted(plan.kinds.items()):
        print(f"  {count:6d}  {kind}")


def _finals_for(request_ids: set[str]):
    seen: set[str] = set()
    done = [0]

    def check(records) -> bool:
        for record in records[done[0]:]:
            if HEADER_FINAL in dict(record.headers):
                seen.add(record.key.decode())
        done[0] = len(records)
        return request_ids <= seen
    return check


def _assert_complete(request: GenerateRequest, records: list) -> None:
    """The first final's attempt: one result per chunk from seq 0 when streamed, else one."""
    rid = request.request_id
    finals = [r for r in records if HEADER_FINAL in dict(r.headers)]
    assert finals, f"{rid}: no final result"
    attempt = dict(finals[0].headers)[HEADER_ATTEMPT]
    seqs = [int(dict(r.headers)[HEADER_SEQ]) for r in records if dict(r.headers)[HEADER_ATTEMPT] == attempt]
    if request.output.stream:
        assert sorted(set(seqs)) == list(range(max(seqs) + 1)), (rid, seqs)
    else:
        assert len(set(seqs)) == 1, (rid, seqs)
    value = decode_result(finals[0].value, finals[0].headers)
    assert not isinstance(value, ErrorResponse), f"{rid}: {value}"
    assert value.choices[0].finish_reason in ("length", "stop"), rid


async def _wait_committed_to_end(settings, group: str, role: str, timeout: float = 60.0) -> None:
    from workers.kafka.clients import make_consumer

    topic = settings.topic(role)
    tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    try:
        ends = await consumer.end_offsets(tps)
    finally:
        await consumer.stop()
    deadline = time.monotonic() + timeout
    while True:
        committed = await committed_offsets(settings, group, tps)
        got = {tp: (committed[tp].offset if committed.get(tp) else -1) for tp in tps}
        if all(got[tp] >= ends[tp] for tp in tps):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"group {group} is behind on {role}: committed {got}, ends {ends}")
        await asyncio.sleep(0.2)
