"""Round trips of every record in both codecs, and the errors bad input gets."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import (
    JSON,
    MSGPACK,
    Cancel,
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionStreamChoice,
    ChatMessage,
    ChunkError,
    Completion,
    CompletionChoice,
    CompletionLogProbs,
    DecodeError,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    GenerateChunk,
    GenerateLogProb,
    GenerateLogProbs,
    GenerateLogProbsContent,
    GenerateRequest,
    OpenAIResult,
    OutputOptions,
    SamplingParams,
    UsageInfo,
    ValidationError,
    content_type_of,
    decode,
    decode_record,
    encode,
    headers_for,
    peek_request_id,
    validate_request,
)
from schemas.commands import TOPIC_RECORDS, export_schemas

CODECS = [MSGPACK, JSON]

# --- strategies --------------------------------------------------------------------

ids = st.integers(min_value=0, max_value=2**31 - 1)
# finite floats only: the wire never carries NaN/inf (docs/design.md §4 clamps them)
logprob_values = st.floats(min_value=-9999.0, max_value=0.0, allow_nan=False)
texts = st.text(max_size=20)

gen_logprob = st.builds(GenerateLogProb, token_id=ids, logprob=logprob_values,
                        rank=st.none() | st.integers(min_value=1, max_value=10**6))
gen_content = st.builds(GenerateLogProbsContent, token_id=ids, logprob=logprob_values,
                        rank=st.none() | st.integers(min_value=1, max_value=10**6),
                        top_logprobs=st.lists(gen_logprob, max_size=5))
gen_logprobs = st.builds(GenerateLogProbs, content=st.none() | st.lists(gen_content, max_size=4))
sampling = st.builds(
    SamplingParams, max_tokens=st.none() | st.integers(1, 4096), min_tokens=st.integers(0, 10),
    temperature=st.floats(0, 2), top_p=st.floats(0.01, 1), top_k=st.integers(-1, 100),
    min_p=st.floats(0, 1), seed=st.none() | st.integers(-2**63, 2**63 - 1),
    stop_token_ids=st.lists(ids, max_size=3), ignore_eos=st.booleans(),
    logprobs=st.none() | st.integers(-1, 20), prompt_logprobs=st.none() | st.integers(-1, 20))
output = st.builds(
    OutputOptions, kind=st.sampled_from(["chat", "completion"]), model=st.none() | texts,
    stream=st.booleans(), include_usage=st.booleans(), top_logprobs=st.integers(0, 20),
    stop=st.lists(texts, max_size=3), include_stop_str_in_output=st.booleans(),
    skip_special_tokens=st.booleans(), created=st.none() | st.integers(0, 2**40))
request = st.builds(
    GenerateRequest, request_id=st.text(min_size=1, max_size=40),
    prompt_token_ids=st.lists(ids, min_size=1, max_size=20), sampling=sampling, output=output,
    reply_topic=st.none() | st.from_regex(r"[a-z.]{1,20}", fullmatch=True),
    deadline_ms=st.none() | st.integers(0, 2**50), priority=st.integers(-10, 10))
chunk = st.builds(
    GenerateChunk, request_id=st.text(min_size=1, max_size=40), attempt=texts,
    seq=st.integers(0, 10**6), token_offset=st.integers(0, 10**6), token_ids=st.lists(ids, max_size=8),
    logprobs=st.none() | gen_logprobs,
    finish_reason=st.none() | st.sampled_from(["stop", "length", "abort", "error"]),
    stop_token_id=st.none() | ids,
    error=st.none() | st.builds(ChunkError, message=texts, type=texts),
    sampled_at_ns=st.none() | st.integers(0, 2**62),
    prompt_token_count=st.none() | st.integers(0, 10**5),
    prompt_tail_ids=st.none() | st.lists(ids, max_size=8),
    prompt_logprobs=st.none() | st.lists(st.none() | gen_content, max_size=4),
    output=st.none() | output, reply_topic=st.none() | st.just("replies"))
chat_lp = st.builds(ChatCompletionLogProb, token=texts, logprob=logprob_values,
                    bytes=st.none() | st.lists(st.integers(0, 255), max_size=4))
chat_lps = st.builds(ChatCompletionLogProbs, content=st.none() | st.lists(st.builds(
    ChatCompletionLogProbsContent, token=texts, logprob=logprob_values,
    bytes=st.none() | st.lists(st.integers(0, 255), max_size=4),
    top_logprobs=st.lists(chat_lp, max_size=3)), max_size=3))
usage = st.none() | st.builds(UsageInfo, prompt_tokens=st.integers(0, 99), completion_tokens=st.integers(0, 99),
                              total_tokens=st.integers(0, 198))
finish = st.none() | st.sampled_from(["stop", "length", "abort", "error"])
chat_chunk = st.builds(ChatCompletionChunk, id=texts, created=st.integers(0, 2**40), model=texts,
                       choices=st.lists(st.builds(ChatCompletionStreamChoice, index=st.integers(0, 3),
                                                  delta=st.builds(DeltaMessage, role=st.none() | st.just("assistant"),
                                                                  content=st.none() | texts),
                                                  logprobs=st.none() | chat_lps, finish_reason=finish), max_size=2),
                       usage=usage)
chat_final = st.builds(ChatCompletion, id=texts, created=st.integers(0, 2**40), model=texts,
                       choices=st.lists(st.builds(ChatCompletionChoice, index=st.integers(0, 3),
                                                  message=st.builds(ChatMessage, content=st.none() | texts),
                                                  logprobs=st.none() | chat_lps, finish_reason=finish), max_size=2),
                       usage=usage)
completion_lps = st.builds(CompletionLogProbs, text_offset=st.lists(st.integers(0, 999), max_size=3),
                           token_logprobs=st.lists(st.none() | logprob_values, max_size=3),
                           tokens=st.lists(texts, max_size=3),
                           top_logprobs=st.lists(st.none() | st.dictionaries(texts, logprob_values, max_size=3), max_size=3))
completion = st.builds(Completion, id=texts, created=st.integers(0, 2**40), model=texts,
                       choices=st.lists(st.builds(CompletionChoice, index=st.integers(0, 3), text=texts,
                                                  logprobs=st.none() | completion_lps, finish_reason=finish), max_size=2),
                       usage=usage)
error = st.builds(ErrorResponse, error=st.builds(ErrorInfo, message=texts, type=texts,
                                                 param=st.none() | texts, code=st.none() | st.integers(0, 999) | texts))
cancel = st.builds(Cancel, request_id=st.text(min_size=1, max_size=40), reason=texts)

ROUND_TRIPS = [
    (GenerateRequest, request), (GenerateChunk, chunk), (Cancel, cancel), (SamplingParams, sampling),
    (OutputOptions, output), (GenerateLogProbs, gen_logprobs), (GenerateLogProbsContent, gen_content),
    (GenerateLogProb, gen_logprob), (ChatCompletionChunk, chat_chunk), (ChatCompletion, chat_final),
    (Completion, completion), (ErrorResponse, error), (ChatCompletionLogProbs, chat_lps),
    (CompletionLogProbs, completion_lps),
]


@pytest.mark.parametrize("content_type", CODECS)
@pytest.mark.parametrize("record_type,strategy", ROUND_TRIPS, ids=[t.__name__ for t, _ in ROUND_TRIPS])
def test_encode_decode_is_identity(record_type, strategy, content_type):
    @settings(max_examples=60, deadline=None)
    @given(strategy)
    def check(record):
        data = encode(record, content_type)
        assert decode(data, record_type, content_type) == record
        # readers sniff the codec when the header is missing (kcat users)
        assert decode_record(data, None, record_type) == record

    check()


@pytest.mark.parametrize("content_type", CODECS)
def test_openai_results_tell_themselves_apart_by_object(content_type):
    chat = ChatCompletionChunk(id="chatcmpl-1", created=1, model="m", choices=[
        ChatCompletionStreamChoice(delta=DeltaMessage(role="assistant", content="hi"))])
    comp = Completion(id="cmpl-1", created=1, model="m", choices=[CompletionChoice(text="x")])
    for record in (chat, comp):
        assert decode(encode(record, content_type), OpenAIResult, content_type) == record


def test_integer_logprobs_wire_shape_is_the_prs():
    content = GenerateLogProbsContent(token_id=7, logprob=-0.5, rank=2, top_logprobs=[
        GenerateLogProb(token_id=7, logprob=-0.5, rank=2),
        GenerateLogProb(token_id=3, logprob=-0.1, rank=1)])
    wire = json.loads(encode(GenerateLogProbs(content=[content]), JSON))
    assert wire == {"content": [{"token_id": 7, "logprob": -0.5, "rank": 2, "top_logprobs": [
        {"token_id": 7, "logprob": -0.5, "rank": 2}, {"token_id": 3, "logprob": -0.1, "rank": 1}]}]}
    assert isinstance(wire["content"][0]["top_logprobs"], list)
    # rank is nullable (NaN logprobs); logprob is required
    assert decode(b'{"token_id": 1, "logprob": -9999.0, "rank": null}', GenerateLogProb).rank is None
    with pytest.raises(ValidationError, match="logprob is required"):
        decode(b'{"token_id": 1, "rank": 1}', GenerateLogProb)


def test_openai_shapes_use_openai_field_names():
    value = json.loads(encode(ChatCompletionChunk(id="chatcmpl-r", created=5, model="m", choices=[
        ChatCompletionStreamChoice(delta=DeltaMessage(content="a"), finish_reason="stop")]), JSON))
    assert value["object"] == "chat.completion.chunk"
    assert value["choices"][0]["delta"] == {"content": "a"}  # role left out after the first
    assert value["choices"][0]["finish_reason"] == "stop"
    err = json.loads(encode(ErrorResponse(error=ErrorInfo(message="boom")), JSON))
    assert err == {"error": {"message": "boom", "type": "invalid_request_error", "param": None, "code": None}}


def test_unknown_fields_are_ignored():
    data = b'{"request_id": "r", "prompt_token_ids": [1], "from_the_future": {"x": 1}, ' \
           b'"sampling": {"temperature": 0, "new_knob": true}}'
    req = decode(data, GenerateRequest, JSON)
    assert req.request_id == "r" and req.sampling.temperature == 0


def test_defaults_follow_vllm():
    req = decode(b'{"request_id": "r", "prompt_token_ids": [5]}', GenerateRequest, JSON)
    assert req.sampling == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0)
    assert req.output.kind == "completion" and req.output.stream is False and req.output.top_logprobs == 0


# --- bad input: one clear error naming the field, never a crash ------------------------


def _valid_request_json(**overrides) -> bytes:
    value = {"request_id": "r1", "prompt_token_ids": [1, 2, 3]}
    value.update(overrides)
    return json.dumps(value).encode()


@pytest.mark.parametrize("data,content_type,error,message", [
    (encode(GenerateRequest(request_id="r", prompt_token_ids=[1, 2]), MSGPACK)[:-3], MSGPACK,
     DecodeError, "not a valid msgpack record"),
    (b'{"request_id": "r", "prompt_tok', JSON, DecodeError, "not a valid JSON record"),
    (b"\xc1\xc1\xc1", MSGPACK, DecodeError, "not a valid msgpack record"),
    (_valid_request_json(prompt_token_ids="1 2 3"), JSON, ValidationError, "prompt_token_ids: expected array, got str"),
    (_valid_request_json(request_id=5), JSON, ValidationError, "request_id: expected str, got int"),
    (_valid_request_json(sampling={"max_tokens": "ten"}), JSON, ValidationError,
     "sampling.max_tokens: expected int | null, got str"),
    (b'{"prompt_token_ids": [1]}', JSON, ValidationError, "request_id is required"),
    (b'{"request_id": "r"}', JSON, ValidationError, "prompt_token_ids is required"),
    (_valid_request_json(output={"kind": "poem"}), JSON, ValidationError, "output.kind: invalid enum value 'poem'"),
    # msgspec gives up ~1,000 levels deep, in an unknown field too: RecursionError got
    # past every worker's except clauses and stopped it, on every restart
    (_valid_request_json(junk=[]).replace(b"[]", b"[" * 5000 + b"]" * 5000), JSON, DecodeError,
     "nested too deeply"),
    (b"\x82\xaarequest_id\xa1r\xa4junk" + b"\x91" * 5000 + b"\xc0", MSGPACK, DecodeError, "nested too deeply"),
    # JSON integers have no bound; past 64 bits the worker could not re-encode the request
    # as msgpack, and stopped (priority, deadline_ms, max_tokens, top_k, min_tokens, created)
    (_valid_request_json(priority=2**70), JSON, ValidationError, "priority: expected int <= 9223372036854775807"),
    (_valid_request_json(deadline_ms=-(2**64)), JSON, ValidationError,
     "deadline_ms: expected int >= -9223372036854775808"),
    (_valid_request_json(sampling={"top_k": 2**64}), JSON, ValidationError, "sampling.top_k: expected int <="),
    (_valid_request_json(output={"created": 10**30}), JSON, ValidationError, "output.created: expected int <="),
    (_valid_request_json(prompt_token_ids=[1, 2**65]), JSON, ValidationError, "prompt_token_ids[1]: expected int <="),
])
def test_undecodable_or_mistyped_requests_raise_one_clear_error(data, content_type, error, message):
    with pytest.raises(error) as info:
        decode(data, GenerateRequest, content_type)
    assert message in str(info.value)
    assert "Traceback" not in str(info.value)


@pytest.mark.parametrize("field, value", [
    ("sampled_at_ns", 10**400), ("prompt_token_count", 10**300), ("seq", 2**64), ("token_offset", -(2**64)),
    ("token_ids", [5, 2**70]), ("request_offset", 2**63)])
def test_a_chunk_s_integers_past_64_bits_are_refused_at_decode(field, value):
    """A JSON chunk's integers have no bound of their own: a 400-digit sampled_at_ns made
    the derender's latency metric raise OverflowError after the chunk was rendered, and a
    huge prompt_token_count a usage total no codec writes. Either stopped the worker, on
    every restart. Refused at decode, such a chunk goes to the DLQ."""
    value = {"request_id": "r", "attempt": "a", "seq": 0, "finish_reason": "length", "token_ids": [5], field: value}
    with pytest.raises(ValidationError) as info:
        decode(json.dumps(value).encode(), GenerateChunk, JSON)
    assert field in str(info.value) and "expected int" in str(info.value)


@pytest.mark.parametrize("where", ["token", "top", "prompt"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_chunk_s_logprobs_that_are_not_numbers_are_refused_at_decode(where, value):
    """Generate writes NaN and -inf logprobs as -9999.0 (docs/design.md §5.4). One in a
    chunk no worker wrote was rendered as `null` in the JSON results, where OpenAI's
    clients read a float. Refused at decode, such a chunk goes to the DLQ."""
    def chunk(token=-0.5, top=-0.5, prompt=-0.5):
        return msgspec.msgpack.encode({
            "request_id": "r", "attempt": "a", "seq": 0, "finish_reason": "length", "token_ids": [5],
            "logprobs": {"content": [{"token_id": 5, "logprob": token, "rank": 1,
                                      "top_logprobs": [{"token_id": 5, "logprob": top, "rank": 1}]}]},
            "prompt_token_ids": [1, 2], "prompt_logprobs": [None, {"token_id": 2, "logprob": prompt, "rank": 1}]})
    decode(chunk(), GenerateChunk, MSGPACK)  # (with numbers it decodes)
    with pytest.raises(ValidationError) as info:
        decode(chunk(**{where: value}), GenerateChunk, MSGPACK)
    path = {"token": "logprobs.content[0]", "top": "logprobs.content[0].top_logprobs[0]",
            "prompt": "prompt_logprobs[1]"}[where]
    assert str(info.value).startswith(f"{path}.logprob: expected float ")


@pytest.mark.parametrize("overrides,field,message", [
    (dict(prompt_token_ids=[]), "prompt_token_ids", "prompt_token_ids must be non-empty"),
    (dict(prompt_token_ids=[1, -4]), "prompt_token_ids[1]", "prompt_token_ids[1] must be a non-negative token id, got -4"),
    # a completion (the default kind) may ask for max_logprobs + 1 candidates (its k + 1)
    (dict(sampling={"logprobs": 22}), "sampling.logprobs", "sampling.logprobs must be -1 or 0..21, got 22"),
    (dict(sampling={"logprobs": 21}, output={"kind": "chat"}), "sampling.logprobs",
     "sampling.logprobs must be -1 or 0..20, got 21"),
    (dict(sampling={"logprobs": -2}), "sampling.logprobs", "sampling.logprobs must be -1 or 0..21, got -2"),
    (dict(sampling={"prompt_logprobs": 25}), "sampling.prompt_logprobs", "must be -1 or 0..21, got 25"),
    (dict(sampling={"max_tokens": -1}), "sampling.max_tokens", "must be >= 0 (0: the prompt only, with echo / prompt_logprobs), got -1"),
    (dict(sampling={"max_tokens": 4, "min_tokens": 5}), "sampling.min_tokens", "must not exceed max_tokens"),
    (dict(sampling={"temperature": -1}), "sampling.temperature", "must be a finite number >= 0, got -1"),
    # past float32's largest value the sampler's temperature is inf: -inf / inf is NaN
    (dict(sampling={"temperature": 1e39}), "sampling.temperature", "must be a finite number >= 0, got 1e+39"),
    (dict(output={"stop": ["a"] * 17}), "output.stop", "may hold at most 16 strings, got 17"),
    (dict(output={"stop": ["end", "x" * 1001]}), "output.stop[1]", "must be a string of 1..1000 characters, got 1001"),
    (dict(output={"stop": [""]}), "output.stop[0]", "must be a string of 1..1000 characters, got 0"),
    (dict(sampling={"stop_token_ids": list(range(1025))}), "sampling.stop_token_ids",
     "may hold at most 1024 ids, got 1025"),
    (dict(sampling={"top_p": 0}), "sampling.top_p", "must be in (0, 1]"),
    (dict(sampling={"min_p": 1.5}), "sampling.min_p", "must be in [0, 1]"),
    (dict(sampling={"top_k": -3}), "sampling.top_k", "must be -1 or 0 (disabled)"),
    (dict(request_id=""), "request_id", "request_id must be 1..256 characters"),
    (dict(request_id="x" * 257), "request_id", "request_id must be 1..256 characters"),
    (dict(output={"top_logprobs": 21}), "output.top_logprobs", "must be 0..20"),
    (dict(reply_topic="bad topic!"), "reply_topic", "is not a valid Kafka topic name"),
])
def test_rule_breaking_requests_name_the_field(overrides, field, message):
    req = decode(_valid_request_json(**overrides), GenerateRequest, JSON)
    with pytest.raises(ValidationError) as info:
        validate_request(req)
    assert info.value.field == field
    assert message in str(info.value)


def test_deployment_limits_vocab_context_and_max_logprobs():
    req = GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3000])
    with pytest.raises(ValidationError, match=r"prompt_token_ids\[2\] = 3000 is out of range for a vocabulary of 2000"):
        validate_request(req, vocab_size=2000)
    with pytest.raises(ValidationError, match="has 3 tokens but the model's context is 3"):
        validate_request(GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3]), max_model_len=3)
    whole_vocab = GenerateRequest(request_id="r", prompt_token_ids=[1], sampling=SamplingParams(logprobs=-1))
    validate_request(whole_vocab)  # vocabulary unknown: -1 is fine
    with pytest.raises(ValidationError, match="whole vocabulary"):
        validate_request(whole_vocab, vocab_size=2000)  # -1 counts as 2000 > 20
    validate_request(whole_vocab, vocab_size=2000, max_logprobs=-1)  # no cap
    validate_request(GenerateRequest(request_id="r", prompt_token_ids=[1], sampling=SamplingParams(logprobs=50)),
                     max_logprobs=64)


def test_max_logprobs_caps_the_clients_k_and_a_completions_k_asks_one_more():
    """vLLM's max_logprobs caps what the client asks for; a completion's logprobs=k asks
    generate for k+1 candidates (the sampled token besides the top k), so k = max_logprobs
    must pass, and a refusal names the k the client gave."""
    from workers.requests import make_request
    for kind, opts in (("completion", lambda k: dict(logprobs=k)),
                       ("chat", lambda k: dict(logprobs=True, top_logprobs=k))):
        validate_request(make_request([1, 2], kind=kind, **opts(20)), vocab_size=2000)
        with pytest.raises(ValidationError) as info:
            validate_request(make_request([1, 2], kind=kind, **opts(21)), vocab_size=2000)
        assert info.value.field == "sampling.logprobs"
    # echo's prompt candidates are the output's (k+1) too
    validate_request(make_request([1, 2], logprobs=20, echo=True, max_tokens=0), vocab_size=2000)
    with pytest.raises(ValidationError, match=r"got 22 \(a completion's logprobs=k asks generate for k\+1 "
                                              r"candidates, so k may be 0\.\.20\)"):
        validate_request(make_request([1, 2], logprobs=21), vocab_size=2000)
    with pytest.raises(ValidationError, match=r"^sampling.logprobs must be -1 or 0\.\.20, got 21$"):
        validate_request(make_request([1, 2], kind="chat", logprobs=True, top_logprobs=21), vocab_size=2000)
    # a token-in client writing sampling.logprobs itself: the cap follows output.kind
    raw = GenerateRequest(request_id="r", prompt_token_ids=[1], sampling=SamplingParams(logprobs=21))
    validate_request(raw)  # kind defaults to completion
    with pytest.raises(ValidationError, match="0..20, got 21"):
        validate_request(GenerateRequest(request_id="r", prompt_token_ids=[1], sampling=SamplingParams(logprobs=21),
                                         output=OutputOptions(kind="chat")))
    validate_request(GenerateRequest(request_id="r", prompt_token_ids=[1], sampling=SamplingParams(logprobs=99)),
                     max_logprobs=-1)  # no cap stays no cap


def test_content_type_header_picks_the_codec_and_unknown_ones_are_refused():
    req = GenerateRequest(request_id="r", prompt_token_ids=[1])
    for ct in CODECS:
        data = encode(req, ct)
        assert decode_record(data, headers_for(req, ct), GenerateRequest) == req
    assert content_type_of(b"{}", [("content-type", b"application/json; charset=utf-8")]) == JSON
    with pytest.raises(DecodeError, match="unsupported content-type 'text/plain'"):
        decode_record(b"{}", [("content-type", b"text/plain")], GenerateRequest)
    with pytest.raises(DecodeError, match="tombstone"):
        decode_record(None, [], GenerateRequest)


def test_headers_carry_codec_and_schema_version():
    headers = dict(headers_for(Cancel(request_id="r"), JSON))
    assert headers == {"content-type": b"application/json", "genpipe-schema": b"Cancel/v1"}


def test_request_id_can_be_peeked_from_an_invalid_request():
    assert peek_request_id(_valid_request_json(sampling={"temperature": "hot"})) == "r1"
    assert peek_request_id(b"\x00garbage") is None


def test_nan_never_reaches_json_as_a_number():
    # msgspec writes non-finite floats as null; our rules clamp them before (docs/design.md §4)
    data = encode(GenerateLogProb(token_id=1, logprob=math.nan), JSON)
    assert b"NaN" not in data and b"Infinity" not in data


def test_schema_export_writes_a_json_schema_per_topic(tmp_path):
    paths = export_schemas(tmp_path)
    assert sorted(p.name for p in paths) == sorted(f"{role}.schema.json" for role in TOPIC_RECORDS)
    requests = json.loads((tmp_path / "requests.schema.json").read_text())
    request_def = requests["$defs"]["GenerateRequest"]
    assert set(request_def["required"]) == {"request_id", "prompt_token_ids"}
    chunks = json.loads((tmp_path / "chunks.schema.json").read_text())
    assert "GenerateLogProbsContent" in chunks["$defs"]
    results = json.loads((tmp_path / "results.schema.json").read_text())
    assert len(results["anyOf"]) == 4


def test_schema_export_cli(tmp_path, capsys):
    from workers.cli import main

    assert main(["schema", "export", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "cancel.schema.json").exists()
    (tmp_path / "a-file").write_text("x")  # where the directory goes: one line, not a traceback
    assert main(["schema", "export", str(tmp_path / "a-file")]) == 1
    assert capsys.readouterr().err.startswith("genpipe schema export: [Errno 17] File exists")
