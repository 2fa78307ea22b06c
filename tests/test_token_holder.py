"""The engine side's token holder (workers/generate/token_holder.py): pure, no engine.

Steps are made as an engine makes them (StepCollector): each running request's one new
token in the columns, ends and prompt logprobs as RequestOutputs. What the holder hands on
is what the worker publishes at once, so these pin what leaves and when."""

from workers.generate.chunks import ChunkPolicy
from workers.generate.outputs import RequestOutput, StepCollector, StepOutputs
from workers.generate.token_holder import TokenHolder

STEP = 0.002


def engine_step(tokens: dict[str, int], at: float, *, entries: dict | None = None,
                others: list[RequestOutput] = ()) -> StepOutputs:
    step = StepCollector()
    for request_id, token in tokens.items():
        step.token(request_id, token, (entries or {}).get(request_id))
    for out in others:
        step.output(out)
    step.sampled_at_ns = round(at * 1e9)
    return step.done()


def handed_on(step: StepOutputs | None) -> dict[str, tuple[int, ...]]:
    """request id -> the token ids handed on for it, whichever form carried them."""
    if step is None:
        return {}
    got = {rid: (token,) for rid, token in zip(step.request_ids, step.token_ids)}
    got.update({out.request_id: out.token_ids for out in step.others})
    return got


def test_at_low_load_every_token_leaves_at_its_step_in_the_columns():
    holder = TokenHolder(ChunkPolicy())  # 3 running at 10,000 chunks/s: 0.3 ms apart, under a step
    for n in range(5):
        out = holder.step(engine_step({"a": 10 + n, "b": 20 + n, "c": 30 + n}, 1.0 + n * STEP), 1.0 + n * STEP)
        assert out.request_ids == ("a", "b", "c") and out.token_ids == (10 + n, 20 + n, 30 + n)
        assert not out.others and out.batch == 3


def test_a_large_batch_hands_on_each_request_about_every_interval_with_all_its_tokens():
    policy = ChunkPolicy(max_records_per_s=10_000, max_delay_s=0.02, max_tokens=16)
    holder = TokenHolder(policy)
    ids = [f"r{i}" for i in range(256)]  # 256 running: a request's chunks 25.6 ms apart, capped by the 20 ms delay
    received: dict[str, list[int]] = {rid: [] for rid in ids}
    handed = 0
    for n in range(40):
        now = 5.0 + n * STEP
        out = holder.step(engine_step({rid: n for rid in ids}, now), now)
        assert out.batch == 256
        for rid, tokens in handed_on(out).items():
            received[rid].extend(tokens)
            handed += 1
    # the first step hands every request's first token on at once (time to first token) ...
    assert all(tokens[0] == 0 for tokens in received.values())
    # ... then each request's tokens wait up to the 20 ms delay cap: 10 steps' worth
    assert all(tokens == list(range(len(tokens))) for tokens in received.values()), "in order, none lost"
    assert 256 * 2 <= handed <= 256 * 5  # about one hand-on per 10 steps each, not 40
    held = sum(len(state.pending_ids) for state in holder.held.values())
    assert held + sum(map(len, received.values())) == 256 * 40
    assert holder.holding == sum(1 for state in holder.held.values() if state.pending_ids)


def test_held_tokens_keep_their_logprob_entries_and_the_time_they_were_first_held():
    holder = TokenHolder(ChunkPolicy(max_records_per_s=1.0, max_delay_s=10.0, max_tokens=100))
    holder.step(engine_step({"a": 1}, 1.0, entries={"a": b"e1"}), 1.0)  # the first token: at once
    for n, t in enumerate((1.1, 1.2, 1.3)):
        out = holder.step(engine_step({"a": 2 + n}, t, entries={"a": b"e%d" % (2 + n)}), t)
        assert not handed_on(out), "held: the rate aim spaces the chunks a second apart"
    out = holder.step(engine_step({"a": 5}, 2.05, entries={"a": b"e5"}), 2.05)  # a second after the first
    (run,) = out.others
    assert run.token_ids == (2, 3, 4, 5) and run.logprobs == (b"e2", b"e3", b"e4", b"e5")
    assert run.held_since == 1.1 and run.sampled_at_ns == round(2.05e9)


def test_an_end_leaves_at_once_after_the_tokens_held_before_it_and_the_request_is_forgotten():
    holder = TokenHolder(ChunkPolicy(max_records_per_s=1.0, max_delay_s=10.0, max_tokens=100))
    holder.step(engine_step({"a": 1, "b": 1}, 1.0), 1.0)
    holder.step(engine_step({"a": 2, "b": 2}, 1.1), 1.1)
    final = RequestOutput(request_id="a", token_ids=(3,), finish_reason="stop", stop_token_id=3, sampled_at_ns=7)
    out = holder.step(engine_step({"b": 3}, 1.2, others=[final]), 1.2)
    (end,) = out.others
    assert end.request_id == "a" and end.token_ids == (2, 3) and end.finish_reason == "stop"
    assert end.stop_token_id == 3 and end.held_since == 1.1
    assert "a" not in holder.held and holder.held["b"].pending_ids == [2, 3]
    assert holder.holding == 1  # (what the engine process's outbox waits by)
    # an abort of a request with nothing held goes on as the engine made it
    abort = RequestOutput(request_id="z", token_ids=(), finish_reason="abort")
    assert holder.step(engine_step({}, 1.3, others=[abort]), 1.3).others == [abort]


def test_held_tokens_fall_due_between_steps_and_wait_s_says_when():
    holder = TokenHolder(ChunkPolicy(max_records_per_s=0.0, max_delay_s=0.02, max_tokens=100))
    holder.tune(lagging=True, stretch=1.0)  # a lagging producer: tokens held up to the delay cap, the first too
    assert not handed_on(holder.step(engine_step({"a": 1}, 1.0), 1.0))
    assert not handed_on(holder.step(engine_step({"a": 2}, 1.005), 1.005))
    assert abs(holder.wait_s(1.010) - 0.010) < 1e-9
    assert holder.release(1.0199) is None
    released = holder.release(1.02)
    assert handed_on(released) == {"a": (1, 2)} and released.batch == 0  # not an engine step
    assert holder.wait_s(1.03) == float("inf")
    holder.tune(lagging=False, stretch=1.0)  # keeping up again, and no rate aim: every token at its step
    assert handed_on(holder.step(engine_step({"a": 3}, 1.04), 1.04)) == {"a": (3,)}


def test_the_worker_s_stretch_holds_longer():
    policy = ChunkPolicy(max_records_per_s=0.0, max_delay_s=0.02, max_tokens=100, saturated_stretch=4.0)
    holder = TokenHolder(policy)
    holder.tune(lagging=True, stretch=4.0)
    holder.step(engine_step({"a": 1}, 1.0), 1.0)
    holder.step(engine_step({"a": 2}, 1.01), 1.01)
    assert holder.release(1.0799) is None  # the delay cap of 20 ms, stretched to 80
    assert handed_on(holder.release(1.08)) == {"a": (1, 2)}


def test_the_longest_gap_between_a_request_s_tokens_is_reported_per_step():
    holder = TokenHolder(ChunkPolicy())
    assert holder.step(engine_step({"a": 1}, 1.0), 1.0).gap_s == 0.0  # a first token: no gap
    holder.step(engine_step({"b": 1}, 1.004), 1.004)
    assert abs(holder.step(engine_step({"a": 2, "b": 2}, 1.006), 1.006).gap_s - 0.006) < 1e-9
