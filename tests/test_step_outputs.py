"""A step's outputs column-wise (workers/generate/outputs.py StepOutputs), as the engine
process sends them to the worker: whatever a step holds, the worker reads back every
request's new tokens, logprob entries, sampling time, end and prompt logprobs as the
engine gave them; and the plain outputs, nearly all of a busy step, travel as columns."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from workers.generate.engine_pipe import Step, decode_from_child, encode
from workers.generate.outputs import RequestOutput, StepOutputs


@st.composite
def outputs(draw):
    """An engine step: distinct requests, most with one token and nothing more, the others
    with an end, prompt logprobs, no token or two (the engines give 0 or 1); logprob
    entries or not; sampling times that mostly agree (an engine stamps a step once)."""
    ids = draw(st.lists(st.text(min_size=1, max_size=6), max_size=12, unique=True))
    usual, odd = draw(st.integers(0, 2**63 - 1)), draw(st.integers(0, 2**63 - 1))
    step = []
    for rid in ids:
        kind = draw(st.sampled_from(["plain", "plain", "plain", "end", "prompt", "empty", "two"]))
        tokens = draw(st.lists(st.integers(0, 300_000), min_size={"empty": 0, "two": 2}.get(kind, 1),
                               max_size={"empty": 0, "two": 2}.get(kind, 1)))
        asked = draw(st.booleans())
        out = RequestOutput(
            request_id=rid, token_ids=tokens,
            logprobs=[draw(st.binary(min_size=1, max_size=8)) for _ in tokens] if asked else None,
            sampled_at_ns=draw(st.sampled_from([usual, usual, odd])))
        if kind in ("end", "empty") or draw(st.integers(0, 3)) == 0:
            out.finish_reason = draw(st.sampled_from(["stop", "length", "abort"]))
            if out.finish_reason == "stop" and tokens:
                out.stop_token_id = tokens[-1]
        if kind == "prompt":
            out.prompt_logprobs = [None]
        step.append(out)
    return step


def through_the_pipe(step: list[RequestOutput]) -> StepOutputs:
    message = decode_from_child(encode(Step(StepOutputs.of(step), 0.25)))
    assert isinstance(message, Step) and message.step_s == 0.25
    return message.outputs


@given(outputs())
def test_the_worker_reads_every_output_as_the_engine_gave_it(step):
    got = through_the_pipe(step)
    assert len(got) == len(step)
    tokens: dict[str, list] = {}
    for rid, token, entry, sampled_at in got.new_tokens():
        tokens.setdefault(rid, []).append((token, entry, sampled_at))
    assert tokens == {out.request_id: [(token, out.logprobs[i] if out.logprobs else None, out.sampled_at_ns)
                                       for i, token in enumerate(out.token_ids)]
                      for out in step if out.token_ids}
    others = {out.request_id: (out.finish_reason, out.stop_token_id, out.prompt_logprobs) for out in got.others}
    for out in step:  # whatever more than a token an output says, the worker reads it
        if out.finish_reason is not None or out.prompt_logprobs is not None:
            assert others[out.request_id] == (out.finish_reason, out.stop_token_id, out.prompt_logprobs)


@given(outputs())
def test_outputs_with_one_token_and_nothing_more_travel_as_columns(step):
    got = through_the_pipe(step)
    plain = [out for out in step if len(out.token_ids) == 1 and out.finish_reason is None
             and out.prompt_logprobs is None]
    same_time = [out for out in plain if out.sampled_at_ns == plain[0].sampled_at_ns]
    assert got.request_ids == tuple(out.request_id for out in same_time)
    assert len(got.others) == len(step) - len(same_time)
    if not any(out.logprobs for out in same_time):
        assert got.logprobs is None  # nobody asked: no column of Nones on the pipe


def test_a_busy_step_is_columns_only():
    step = [RequestOutput(request_id=f"r-{i}", token_ids=[100 + i], logprobs=[b"\x81"] if i % 2 else None,
                          num_output_tokens=7, sampled_at_ns=123) for i in range(256)]
    got = through_the_pipe(step)
    assert got.others == [] and got.token_ids == tuple(range(100, 356)) and got.sampled_at_ns == 123
    assert got.logprobs == tuple(b"\x81" if i % 2 else None for i in range(256))


def test_the_engines_put_every_plain_token_in_the_columns(tiny_model_dir):
    from schemas import GenerateRequest, SamplingParams
    from workers.generate.engine import Engine
    from workers.generate.synthetic import SyntheticEngine

    def requests():
        return [GenerateRequest(request_id="plain", prompt_token_ids=[1, 5, 6],
                                sampling=SamplingParams(max_tokens=3, ignore_eos=True)),
                GenerateRequest(request_id="logprobs", prompt_token_ids=[1, 7],
                                sampling=SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2)),
                GenerateRequest(request_id="prompt", prompt_token_ids=[1, 8, 9],
                                sampling=SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=1))]

    for engine in (Engine(str(tiny_model_dir), max_batch=4), SyntheticEngine(step_s=0.0, max_batch=4)):
        for request in requests():
            engine.add(request)
        steps = []
        while engine.has_work():
            steps.append(engine.step())
        steps = [step for step in steps if step]
        assert len(steps) == 3, type(engine).__name__  # one token each a step, the last with the end
        first, middle, last = steps
        # the first token of a request that asked for prompt logprobs carries them: not plain
        assert first.request_ids == ("plain", "logprobs") and [o.request_id for o in first.others] == ["prompt"]
        assert first.others[0].prompt_logprobs is not None and len(first.others[0].token_ids) == 1
        assert middle.request_ids == ("plain", "logprobs", "prompt") and middle.others == []
        assert middle.logprobs[0] is None and middle.logprobs[2] is None and middle.logprobs[1]
        assert middle.sampled_at_ns > first.sampled_at_ns
        assert last.request_ids == () and {o.request_id: o.finish_reason for o in last.others} == \
            {"plain": "length", "logprobs": "length", "prompt": "length"}
