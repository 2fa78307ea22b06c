"""The per-request state machine (docs/design.md §5.5): attempts, restarts, duplicates, bad chunks,
finished ids, and the helpers the Kafka layer uses for commits."""

from __future__ import annotations

import pytest

from tests.derender_support import (cancels, encode_ids, make_chunks, openai_validate, position, results, run_chunks,
                              streamed_text, tables_for)
from schemas.openai import ErrorResponse
from schemas.records import ChunkError, GenerateChunk, GenerateLogProb, GenerateLogProbsContent, OutputOptions
from workers.derender.state import CancelRequest, Derenderer, Result, check_chunk

STREAM = OutputOptions(kind="completion", stream=True)


@pytest.fixture(scope="module")
def tables():
    return tables_for("spm")


@pytest.fixture
def d(tables):
    return Derenderer(tables, max_logprobs=5, finished_memory=3)


def chunks_for(tables, rid="r", text=" one two three", attempt="a1", output=STREAM, **kw):
    return make_chunks(rid, encode_ids(tables, text), output=output, attempt=attempt,
                       prompt_tail=encode_ids(tables, "x"), **kw)


def only_error(out) -> Result:
    res = results(out)
    assert len(res) == 1 and res[0].final and isinstance(res[0].value, ErrorResponse)
    openai_validate(res[0].value)
    return res[0]


def test_normal_stream_and_bookkeeping(d, tables):
    cs = chunks_for(tables)
    first = d.process(cs[0])
    assert d.active_requests() == ["r"] and d.is_active("r") and not d.is_finished("r")
    assert [r.headers for r in results(first)] == [{"genpipe-attempt": "a1", "genpipe-seq": "0"}]
    rest = run_chunks(d, cs[1:])
    assert d.active_requests() == [] and d.is_finished("r")
    assert results(rest)[-1].headers == {"genpipe-attempt": "a1", "genpipe-seq": str(len(cs) - 1),
                                         "genpipe-final": "1"}
    assert streamed_text(first + rest) == " one two three"


def test_new_attempt_restarts(d, tables):
    a = chunks_for(tables, attempt="A")
    b = chunks_for(tables, attempt="B")
    assert len(results(run_chunks(d, a[:2]))) == 2  # attempt A streamed two results
    out_b0 = d.process(b[0])
    assert results(out_b0)[0].headers == {"genpipe-attempt": "B", "genpipe-seq": "0", "genpipe-restart": "1"}
    # The superseded attempt's later chunks are dropped, the new one goes on.
    assert d.process(a[2]) == []
    out_b = run_chunks(d, b[1:])
    assert all("genpipe-restart" not in r.headers for r in results(out_b))
    assert streamed_text(out_b0 + out_b) == " one two three"
    assert d.stats.restarts == 1 and d.stats.dropped_superseded == 1
    # A finished request ignores later attempts.
    assert run_chunks(d, chunks_for(tables, attempt="C")) == []


def test_restart_header_on_non_streamed_final(d, tables):
    opts = OutputOptions(kind="chat")
    run_chunks(d, chunks_for(tables, attempt="A", output=opts)[:1])
    (res,) = results(run_chunks(d, chunks_for(tables, attempt="B", output=opts)))
    assert res.headers["genpipe-restart"] == "1" and res.final


def test_duplicates_dropped(d, tables):
    cs = chunks_for(tables)
    out = []
    for c in [cs[0], cs[0], cs[1], cs[0], cs[1], *cs[2:]]:
        out += d.process(c)
    assert [r.headers["genpipe-seq"] for r in results(out)] == [str(i) for i in range(len(cs))]
    assert d.stats.dropped_duplicate == 3
    assert d.process(cs[-1]) == []  # finished: ignored too
    assert d.stats.dropped_finished == 1


def test_seq_gap_is_an_error(d, tables):
    cs = chunks_for(tables)
    d.process(cs[0])
    out = d.process(cs[2])
    err = only_error(out)
    assert "seq gap" in err.value.error.message and err.value.error.type == "server_error"
    assert err.headers == {"genpipe-attempt": "a1", "genpipe-seq": "2", "genpipe-final": "1"}
    assert cancels(out) == [CancelRequest("r", cancels(out)[0].reason)]
    assert d.is_finished("r") and d.process(cs[3]) == []


def test_unknown_request_not_at_seq_zero_is_a_straggler_and_dropped(d, tables):
    # Replays start at the first offset of every unfinished request, so a request first
    # seen past seq 0 had finished before the replay point: answering would duplicate it.
    cs = chunks_for(tables)
    assert d.process(cs[1]) == []
    assert d.stats.dropped_unknown == 1 and not d.is_active("r")


def test_new_attempt_not_at_seq_zero(d, tables):
    d.process(chunks_for(tables, attempt="A")[0])
    only_error(d.process(chunks_for(tables, attempt="B")[1]))


def test_token_out_of_vocab(d, tables):
    cs = chunks_for(tables)
    cs[1].token_ids = [tables.size]
    d.process(cs[0])
    assert "out of vocabulary" in only_error(d.process(cs[1])).value.error.message
    cs = chunks_for(tables, rid="neg")
    cs[0].token_ids = [-1]
    assert "out of vocabulary" in only_error(d.process(cs[0])).value.error.message


def test_top_entry_out_of_vocab_and_too_many(d, tables):
    ids = encode_ids(tables, " one two")
    positions = [position(i, [i]) for i in ids]
    positions[0].top_logprobs.append(GenerateLogProb(token_id=tables.size + 5, logprob=-3.0, rank=2))
    cs = make_chunks("r", ids, output=STREAM, positions=positions)
    assert "out of vocabulary" in only_error(d.process(cs[0])).value.error.message
    # a completion's logprobs=5 asks for the sampled token + the top 5: 6 entries are its
    # most, 7 too many; a chat's top_logprobs=5 asks for 5 (docs/design.md §5.4)
    positions = [position(i, list(range(10, 20)), n=7) for i in ids]
    cs = make_chunks("r2", ids, output=STREAM, positions=positions)
    message = only_error(d.process(cs[0])).value.error.message
    assert "7 top entries, more than a completion may hold (6, max_logprobs=5 + the sampled token)" in message
    positions = [position(i, list(range(10, 20)), n=6) for i in ids]
    assert results(d.process(make_chunks("r3", ids, output=STREAM, positions=positions)[0]))[0].final is False
    chat = OutputOptions(kind="chat", stream=True, top_logprobs=5)
    cs = make_chunks("r4", ids, output=chat, positions=[position(i, list(range(10, 20)), n=6) for i in ids])
    assert "6 top entries, more than a chat may hold (max_logprobs=5)" in only_error(d.process(cs[0])).value.error.message
    cs = make_chunks("r5", ids, output=chat, positions=[position(i, list(range(10, 20)), n=5) for i in ids])
    assert results(d.process(cs[0]))[0].final is False


@pytest.mark.parametrize("case", ["past", "negative", "past_rank_k", "cut_by_stop", "count_later", "error_chunk"])
def test_completion_bad_candidate_error_is_check_chunks(tables, case):
    """A completion chunk with a candidate id outside the vocabulary (looked up, left out
    by the rank rule, cut off by a stop string, before a later count problem, on an
    error chunk) ends its request with check_chunk's message, word for word."""
    ids = encode_ids(tables, " one two three")
    top = list(range(10, 16))
    positions = [position(i, top, n=3) for i in ids]  # sampled + ranks up to 2 or 3
    bad = {"negative": -2}.get(case, tables.size + 5)
    rank = 9 if case == "past_rank_k" else 2  # 9 > k: left out of the dict, still checked
    bad_at = -1 if case == "cut_by_stop" else 1  # (the last position is cut by the stop string)
    positions[bad_at].top_logprobs.append(GenerateLogProb(token_id=bad, logprob=-3.0, rank=rank))
    if case == "count_later":  # a later position with too many entries: the earlier bad id is reported
        positions[-1].top_logprobs.extend(GenerateLogProb(token_id=20 + j, logprob=-4.0, rank=4 + j)
                                          for j in range(4))
    opts = dict(kind="completion", stream=True, top_logprobs=3)
    if case == "cut_by_stop":
        opts["stop"] = [" one"]
    cs = make_chunks("r", ids, [len(ids)], output=OutputOptions(**opts), positions=positions,
                     prompt_tail=encode_ids(tables, "x"),
                     finish_reason="error" if case == "error_chunk" else "length")
    if case == "error_chunk":
        cs[0].error = ChunkError(message="engine failed", type="server_error")
    want = check_chunk(cs[0], tables.size, 5, 0, kind="completion")
    assert want is not None
    got = only_error(Derenderer(tables, max_logprobs=5).process(cs[0])).value.error.message
    assert got == f"derender: bad chunk for request 'r': {want}"


def test_misaligned_logprobs_and_offset(d, tables):
    ids = encode_ids(tables, " one two")
    positions = [position(i, [i]) for i in ids]
    cs = make_chunks("r", ids, [len(ids)], output=STREAM, positions=positions)
    cs[0].logprobs.content = cs[0].logprobs.content[:-1]
    assert "entries for" in only_error(d.process(cs[0])).value.error.message
    cs = make_chunks("r2", ids, [len(ids)], output=STREAM, positions=positions)
    cs[0].logprobs.content[0].token_id = ids[0] + 1
    assert "not the sampled id" in only_error(d.process(cs[0])).value.error.message
    cs = chunks_for(tables, rid="r3")
    cs[1].token_offset = 7
    d.process(cs[0])
    assert "token_offset" in only_error(d.process(cs[1])).value.error.message


def test_generate_error_chunk(d, tables):
    c = GenerateChunk(request_id="bad", attempt="a", seq=0, finish_reason="error",
                      error=ChunkError(message="prompt_token_ids: unknown token id 99999"),
                      output=STREAM, reply_topic="my.replies")
    err = only_error(d.process(c))
    assert err.value.error.message == "prompt_token_ids: unknown token id 99999"
    assert err.value.error.type == "invalid_request_error" and err.value.error.code == 400
    assert err.reply_topic == "my.replies"
    assert cancels(d.process(c)) == []  # finished; no cancel for a request generate ended


def test_an_abort_that_says_why_is_an_abort_result_with_the_reason_in_a_header(d, tables):
    """A request whose deadline passed while it waited: finish_reason abort, not an error."""
    c = GenerateChunk(request_id="late", attempt="a", seq=0, finish_reason="abort", prompt_token_count=2,
                      prompt_tail_ids=encode_ids(tables, "x"), output=OutputOptions(kind="completion"),
                      error=ChunkError(message="deadline_ms 5 passed before the request started", type="timeout"))
    (res,) = results(d.process(c))
    assert res.final and not isinstance(res.value, ErrorResponse)
    assert res.value.choices[0].finish_reason == "abort" and res.value.choices[0].text == ""
    assert res.headers["genpipe-error"] == "deadline_ms 5 passed before the request started"


def test_generate_error_chunk_with_the_bad_prompt_id_in_its_tail_reaches_the_user_as_written(d, tables):
    """`submit --token-ids 1,99999`: generate's precise error chunk also carries the bad id in
    prompt_tail_ids; derender refused the chunk for it and answered with a server_error."""
    message = "prompt_token_ids[1] = 99999 is out of range for a vocabulary of 2000 tokens"
    c = GenerateChunk(request_id="tail", attempt="a", seq=0, finish_reason="error", prompt_token_count=2,
                      prompt_tail_ids=[1, 99999], error=ChunkError(message=message), output=STREAM)
    err = only_error(d.process(c))
    assert err.value.error.message == message
    assert err.value.error.type == "invalid_request_error" and err.value.error.code == 400


def test_a_reused_request_id_gets_an_error_not_silence(d, tables):
    """kcat's `-k kcat-1` sent twice: generate runs the second record (a new attempt), and
    derender dropped every chunk of it as 'already finished': no answer ever came."""
    first = chunks_for(tables, rid="kcat-1", attempt="A")
    first[0].request_offset = 4
    assert results(run_chunks(d, first))[-1].final
    # A crash re-run of the same record (same offset): dropped, the first answer stands.
    rerun = chunks_for(tables, rid="kcat-1", attempt="B")
    rerun[0].request_offset = 4
    assert run_chunks(d, rerun) == []
    # The same id in a new record: one error result and a cancel for generate.
    again = chunks_for(tables, rid="kcat-1", attempt="C")
    again[0].request_offset = 9
    out = run_chunks(d, again)
    err = only_error(out)
    assert err.headers == {"genpipe-attempt": "C", "genpipe-seq": "0", "genpipe-final": "1"}
    assert err.value.error.type == "invalid_request_error"
    assert "request_id 'kcat-1' was already used" in err.value.error.message
    assert [c.request_id for c in cancels(out)] == ["kcat-1"]
    assert run_chunks(d, again) == []  # its redelivery changes nothing


def test_reply_topic_on_every_result(d, tables):
    out = run_chunks(d, chunks_for(tables, reply_topic="client.7"))
    assert {r.reply_topic for r in results(out)} == {"client.7"}


def test_finished_memory_is_bounded(d, tables):
    for i in range(5):
        run_chunks(d, chunks_for(tables, rid=f"q{i}", text=" a"))
    assert [d.is_finished(f"q{i}") for i in range(5)] == [False, False, True, True, True]


def test_reset_and_forget(d, tables):
    d.process(chunks_for(tables, rid="x")[0])
    d.process(chunks_for(tables, rid="y")[0])
    d.forget(["x"])
    assert d.active_requests() == ["y"]
    d.reset()
    assert d.active_requests() == [] and not d.is_finished("y")
    # After a reset the request is replayed from seq 0 as if new.
    out = run_chunks(d, chunks_for(tables, rid="y"))
    assert streamed_text(out) == " one two three"


def test_replay_reproduces_identical_results(tables):
    from schemas.codec import JSON, encode

    cs = chunks_for(tables, text=" 中文 🎉 ok", positions=None)
    first = [encode(r.value, JSON) for r in results(run_chunks(Derenderer(tables), cs))]
    again = [encode(r.value, JSON) for r in results(run_chunks(Derenderer(tables), cs))]
    assert first == again


def test_check_chunk_pure(tables):
    c = GenerateChunk(request_id="r", attempt="a", seq=0, token_ids=[1, 2])
    assert check_chunk(c, tables.size, 20, 0) is None
    assert "token_offset" in check_chunk(c, tables.size, 20, 3)
    c.prompt_tail_ids = [tables.size]
    assert "prompt_tail_ids" in check_chunk(c, tables.size, 20, 0)


def test_max_logprobs_negative_means_vocab(tables):
    d = Derenderer(tables, max_logprobs=-1)
    assert d.max_logprobs == tables.size



def _prompt_positions(ids):
    from schemas.records import GenerateLogProbsContent

    return [None] + [GenerateLogProbsContent(token_id=t, logprob=-1.5, rank=3,
                                             top_logprobs=[GenerateLogProb(t, -1.5, 3), GenerateLogProb(7, -0.5, 1)])
                     for t in ids[1:]]


def test_echo_with_max_tokens_zero_is_the_prompt_with_its_logprobs(d, tables):
    prompt = encode_ids(tables, " Once upon a time")
    c = GenerateChunk(request_id="score", attempt="a", seq=0, finish_reason="length", prompt_token_count=len(prompt),
                      prompt_tail_ids=prompt[-8:], prompt_token_ids=prompt, prompt_logprobs=_prompt_positions(prompt),
                      output=OutputOptions(kind="completion", echo=True, top_logprobs=1))
    (res,) = results(d.process(c))
    choice = res.value.choices[0]
    # The text decodes the ids as the tokenizer does (spm drops the first word's space);
    # the logprob tokens are each id's own string, as for generated tokens.
    assert choice.text == "Once upon a time" and choice.finish_reason == "length"
    lp = choice.logprobs
    assert "".join(lp.tokens) == " Once upon a time" and len(lp.tokens) == len(prompt)
    assert lp.token_logprobs == [None] + [-1.5] * (len(prompt) - 1)
    assert lp.top_logprobs[0] is None and all(len(top) == 2 for top in lp.top_logprobs[1:])  # its own + top 1
    assert lp.text_offset[0] == 0 and res.value.usage.completion_tokens == 0


def test_echo_streamed_puts_the_prompt_in_front_of_the_first_result_only(d, tables):
    prompt = encode_ids(tables, " Once upon")
    cs = chunks_for(tables, rid="e", text=" a time", output=OutputOptions(kind="completion", stream=True, echo=True))
    cs[0].prompt_token_ids = prompt
    out = run_chunks(d, cs)
    texts = [r.value.choices[0].text for r in results(out)]
    assert texts[0].startswith("Once upon") and "".join(texts) == "Once upon a time"
    assert not any("Once" in t for t in texts[1:])


@pytest.mark.parametrize("output, message", [
    (OutputOptions(stop=[f"s{i}" for i in range(100_000)]), "output.stop may hold at most 16 strings, got 100000"),
    (OutputOptions(stop=["x" * 5000]), "output.stop[0] must be a string of 1..1000 characters, got 5000"),
    (OutputOptions(kind="chat", top_logprobs=6), "output.top_logprobs must be 0..5, got 6"),
])
@pytest.mark.parametrize("restart", [False, True])
def test_seq_0_output_options_that_break_a_request_s_rules_end_it_at_once(d, tables, output, message, restart):
    """Generate holds a request's output options to the rules (docs/design.md §8), but a
    chunk may come from another producer: 100,000 stop strings in a seq 0 were searched
    for in every token's text (~7 ms a token, the worker's loop held for a long answer's
    worth). Such a seq 0, of a new request or of a new attempt, ends it with one error."""
    ids = encode_ids(tables, " one two three four five six seven eight nine ten") * 20
    if restart:
        assert len(results(d.process(chunks_for(tables, rid="opts", attempt="A")[0]))) == 1
    (bad,) = make_chunks("opts", ids, [len(ids)], output=output, attempt="B", finish_reason=None)
    out = d.process(bad)
    err = only_error(out)
    assert message in err.value.error.message and not d.is_active("opts") and d.is_finished("opts")
    assert [c.request_id for c in cancels(out)] == ["opts"]  # generate is told to stop it
    later = make_chunks("opts", ids + [5], [len(ids), 1], attempt="B")[1]
    assert d.process(later) == []  # dropped: a finished request's
    # generate's own abort of such a request (cancelled, or past its deadline, before its
    # options were checked) and its error chunk reach the client as generate wrote them
    (aborted,) = make_chunks("aborted", [], [0], output=output, finish_reason="abort")
    (result,) = results(d.process(aborted))
    assert result.final and not isinstance(result.value, ErrorResponse)
    (rejected,) = make_chunks("rejected", [], [0], output=output, finish_reason="error")
    rejected.error = ChunkError(message="output.top_logprobs must be 0..20, got 30")
    assert only_error(d.process(rejected)).value.error.message == "output.top_logprobs must be 0..20, got 30"


def test_echo_ids_out_of_vocabulary_are_a_bad_chunk(d, tables):
    c = GenerateChunk(request_id="bad-echo", attempt="a", seq=0, finish_reason="length", prompt_token_ids=[10**6],
                      output=OutputOptions(kind="completion", echo=True))
    err = only_error(d.process(c))
    assert "prompt_token_ids" in err.value.error.message


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("where, bad", [("candidate", 10**6), ("candidate", -3), ("entry", 10**6)])
def test_prompt_logprobs_ids_out_of_vocabulary_are_a_bad_chunk_not_a_crash(d, tables, stream, where, bad):
    """An echo chunk's prompt position naming an id past the vocabulary raised IndexError
    (the derender stopped, and so did each next owner of the partition); a negative one
    rendered some token from the end of the vocabulary. Both are a rule error now."""
    prompt = encode_ids(tables, " Once upon")
    good = GenerateLogProb(prompt[1], -1.5, 1)
    entry = GenerateLogProbsContent(token_id=prompt[1], logprob=-1.5, rank=1, top_logprobs=[good])
    if where == "candidate":
        entry.top_logprobs = [GenerateLogProb(bad, -0.5, 1), good]
    else:
        entry.token_id = bad
    c = GenerateChunk(request_id="bad-plp", attempt="a", seq=0, finish_reason="length", prompt_token_ids=prompt,
                      prompt_logprobs=[None, entry] + [None] * (len(prompt) - 2),
                      output=OutputOptions(kind="completion", echo=True, top_logprobs=1, stream=stream))
    err = only_error(d.process(c))
    assert f"prompt_logprobs[1] holds id {bad}, out of vocabulary" in err.value.error.message
    assert not d.is_active("bad-plp") and d.stats.render_failures == 0


def test_a_chunk_that_fails_to_render_ends_its_request_with_an_error_and_the_next_goes_on(d, tables, monkeypatch,
                                                                                          caplog):
    """A failure no rule foresaw (here: the text step raising) ends that request with an
    error result and a cancel to generate, logged with its traceback; the derender goes
    on with the next request, and the failed one's state is gone."""
    cs = chunks_for(tables, rid="boom")
    real = Derenderer._text

    def text(self, req, chunk):
        if chunk.request_id == "boom" and chunk.seq == 1:
            raise KeyError("a bug")
        return real(self, req, chunk)
    monkeypatch.setattr(Derenderer, "_text", text)
    first = run_chunks(d, cs[:1])
    with caplog.at_level("ERROR", logger="workers.derender.state"):
        out = d.process(cs[1])
    err = only_error(out)
    assert "could not be rendered (KeyError('a bug'))" in err.value.error.message
    assert [c.request_id for c in cancels(out)] == ["boom"]
    assert "Traceback" in caplog.text and "'boom'" in caplog.text
    assert d.stats.render_failures == 1 and not d.is_active("boom") and d.is_finished("boom")
    assert run_chunks(d, cs[2:]) == []  # its later chunks: dropped, the request is finished
    assert len(results(first)) == 1
    ok = run_chunks(d, chunks_for(tables, rid="next"))
    assert streamed_text(ok) == " one two three" and results(ok)[-1].final


def test_a_result_no_codec_writes_is_answered_with_an_error_in_its_place(d, tables):
    """The record-size rule encodes each result; a value no codec writes (a usage total
    of 4,301 digits, from a hostile chunk's prompt_token_count, once got this far) raised
    there, after the chunk was rendered, and stopped the worker on every restart. Now the request ends with an
    error result in its place, with the attempt and seq the result had."""
    import msgspec

    from workers.derender.undeliverable import within_record_limit
    from schemas.codec import JSON
    from workers.kafka.records import Outgoing

    (chunk,) = make_chunks("huge", encode_ids(tables, " one"), [len(encode_ids(tables, " one"))],
                           output=OutputOptions(kind="completion"))
    (result,) = results(d.process(chunk))
    usage = msgspec.structs.replace(result.value.usage, total_tokens=10**5000)  # past Python's 4,300 digits
    bad = msgspec.structs.replace(result, value=msgspec.structs.replace(result.value, usage=usage))
    out = within_record_limit(d, [bad], lambda o: Outgoing("t", o.request_id, o.value, JSON, headers=o.headers),
                              1_000_000)
    (only,) = out
    assert isinstance(only[0].value, ErrorResponse) and "could not be encoded" in only[0].value.error.message
    assert only[0].headers == result.headers and only[1].size() > 0


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_request_not_streamed_ends_once_its_result_cannot_fit_a_record(tables, kind):
    """A request not streamed held its text and logprobs until its end, only to end then
    with "result too large" (a long-context answer with top_logprobs 20: hundreds of MB,
    its first chunk's offset pinned all along, generate running on). With the record
    limit given, it ends at the chunk after which its result can no longer fit: the same
    error, and a cancel. One that fits is not ended early: the count is a lower bound."""
    ids = encode_ids(tables, " one two three four five six seven eight nine ten")
    output = OutputOptions(kind=kind, top_logprobs=3)
    whole = Derenderer(tables, max_logprobs=5)
    chunks = make_chunks("big", ids * 40, [len(ids)] * 40, output=output,
                         positions=[position(i, [i, 5, 6, 7]) for i in ids * 40])
    (result,) = results(run_chunks(whole, chunks))
    from schemas.codec import encode as encode_value
    size = len(encode_value(result.value, "application/json"))
    fits = Derenderer(tables, max_logprobs=5, max_result_bytes=size)
    assert results(run_chunks(fits, chunks)) == [result]
    early = Derenderer(tables, max_logprobs=5, max_result_bytes=size // 10)
    out = run_chunks(early, chunks)
    err = only_error(out)
    assert "result too large" in err.value.error.message and err.headers["genpipe-seq"] != str(len(chunks) - 1)
    assert [c.request_id for c in cancels(out)] == ["big"] and not early.is_active("big")
