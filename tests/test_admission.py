"""The admission order of waiting requests (workers/generate/admission.py): pure, no broker."""

from dataclasses import dataclass

import pytest

from schemas import GenerateRequest
from workers.generate.admission import WaitingQueue


@dataclass
class Item:
    request: GenerateRequest
    tier: int = 0


def item(rid, priority=0, deadline_ms=None, prompt=3, tier=0):
    return Item(GenerateRequest(request_id=rid, prompt_token_ids=[1] * prompt, priority=priority,
                                deadline_ms=deadline_ms), tier)


def drain(queue):
    out = []
    while (i := queue.pop()) is not None:
        out.append(i.request.request_id)
    return out


def test_lower_priority_first_then_earlier_deadline_then_arrival():
    q = WaitingQueue()
    for i in [item("bulk-1", 10), item("late", 0, 9_000), item("none-1", 0), item("soon", 0, 5_000),
              item("bulk-2", 10, 1), item("none-2", 0), item("urgent", -5)]:
        q.push(i)
    assert drain(q) == ["urgent", "soon", "late", "none-1", "none-2", "bulk-2", "bulk-1"]
    assert len(q) == 0 and q.tokens == 0


def test_at_equal_priority_interactive_goes_before_bulk():
    q = WaitingQueue()
    q.push(item("bulk-early", 0, 1_000), tier=1)
    q.push(item("bulk-urgent", -1), tier=1)
    q.push(item("chat", 0))
    assert q.by_tier == [1, 2]
    assert drain(q) == ["bulk-urgent", "chat", "bulk-early"]
    assert q.by_tier == [0, 0]


def test_the_best_interactive_request_can_be_taken_from_behind_better_bulk_ones():
    """Bulk's rows full: the worker takes the best interactive request, however many
    better bulk ones wait in front of it; the bulk ones keep their place."""
    q = WaitingQueue()
    for i in range(3):
        q.push(item(f"bulk-{i}", -5), tier=1)
    q.push(item("chat-late", 0, 9_000))
    q.push(item("chat-soon", 0, 5_000))
    q.remove("chat-soon")  # (cancelled while waiting: a stale entry on top of the tier)
    q.push(item("chat-urgent", -1))
    assert q.peek_tier() == 1
    assert q.pop(tier=0).request.request_id == "chat-urgent"
    assert q.pop(tier=0).request.request_id == "chat-late"
    assert q.pop(tier=0) is None and q.by_tier == [0, 3]
    assert drain(q) == ["bulk-0", "bulk-1", "bulk-2"]


def test_expired_leave_the_queue_and_nothing_else_does():
    q = WaitingQueue()
    q.push(item("a", 0, 1_000))
    q.push(item("b", 5, 2_000))
    q.push(item("c", 0, 3_000))
    q.push(item("d", 0))
    assert [i.request.request_id for i in q.expired(2_000)] == ["a", "b"]
    assert q.expired(2_500) == []
    assert drain(q) == ["c", "d"]


def test_bounded_by_requests_and_by_prompt_tokens():
    q = WaitingQueue(max_requests=3, max_tokens=100)
    q.push(item("a", prompt=10))
    q.push(item("b", prompt=10))
    assert not q.full()
    q.push(item("c", prompt=10))
    assert q.full()  # by count
    q.pop()
    assert not q.full()
    q.push(item("big", prompt=90))
    assert q.full() and q.tokens == 110  # by tokens (push is never refused: the caller pauses)
    with pytest.raises(KeyError):
        q.push(item("big"))
    with pytest.raises(ValueError):
        WaitingQueue(max_requests=0)


def test_remove_and_take_all_keep_the_order_of_the_rest():
    q = WaitingQueue()
    for rid, p in [("a", 3), ("b", 1), ("c", 2), ("d", 0)]:
        q.push(item(rid, p))
    assert q.remove("b").request.request_id == "b"
    assert q.remove("b") is None
    assert "b" not in q and "c" in q
    taken = q.take_all(keep=lambda i: i.request.request_id != "c")
    assert [i.request.request_id for i in taken] == ["c"]
    assert drain(q) == ["d", "a"]


def test_stale_entries_do_not_grow_without_bound():
    q = WaitingQueue()
    q.push(item("keep", 99))
    for n in range(5_000):  # pushed and removed many times while one request stays
        q.push(item(f"r{n}", 0, 10**12))
        q.remove(f"r{n}")
    assert sum(map(len, q._order)) < 200 and len(q._deadlines) < 200
    assert drain(q) == ["keep"]


def test_requests_run_with_deadlines_far_ahead_leave_nothing_behind():
    # Each request admitted (`pop`) left its deadline's entry until the deadline passed:
    # with deadlines far ahead (a client may set any), one per request for good.
    q = WaitingQueue()
    q.push(item("keep", 99))
    for n in range(5_000):
        q.push(item(f"r{n}", 0, 2**62))
        assert q.pop().request.request_id == f"r{n}"
    assert sum(map(len, q._order)) < 200 and len(q._deadlines) < 200
    assert drain(q) == ["keep"]


def test_engines_queue_beyond_their_batch_by_priority_then_arrival():
    from collections import deque

    from workers.generate.admission import queue_by_priority

    queue = deque()
    for i in [item("a"), item("b", 5), item("c"), item("d", -1), item("e", 0, 10)]:
        queue_by_priority(queue, i)
    assert [i.request.request_id for i in queue] == ["d", "e", "a", "c", "b"]


def test_engines_queue_beyond_their_batch_interactive_before_bulk_within_a_priority():
    from collections import deque

    from workers.generate.admission import queue_by_priority

    queue = deque()
    for i in [item("bulk", tier=1), item("bulk-urgent", -1, tier=1), item("late", 3), item("chat"),
              item("bulk-due", 0, 10, tier=1), item("chat-due", 0, 20)]:
        queue_by_priority(queue, i)
    # priority first; then interactive before bulk, even one with a deadline
    assert [i.request.request_id for i in queue] == ["bulk-urgent", "chat-due", "chat", "bulk-due", "bulk", "late"]


def test_the_model_engine_and_the_synthetic_one_start_a_better_request_first():
    from schemas import SamplingParams
    from workers.generate.scheduler import Scheduler, Sequence
    from workers.generate.synthetic import SyntheticEngine

    requests = [GenerateRequest(request_id=rid, prompt_token_ids=[1], priority=priority,
                                sampling=SamplingParams(max_tokens=1, ignore_eos=True))
                for rid, priority in [("first", 0), ("low", 9), ("high", -9)]]
    engine = SyntheticEngine(step_s=0.0, max_batch=1, vocab_size=100)
    for r in requests:
        engine.add(r)
    order = []
    while engine.has_work():
        order += [o.request_id for o in engine.step() if o.finish_reason]
    assert order == ["high", "first", "low"]

    scheduler = Scheduler(max_rows=1, prefill_chunk=8)
    for r in requests:
        scheduler.add(Sequence(r, max_output=1))
    assert [p.seq.request_id for p in scheduler.schedule().prefills] == ["high"]


def test_the_engines_start_an_interactive_request_before_a_bulk_one_handed_earlier():
    """The worker hands an engine up to a quarter of a batch beyond its rows: a bulk
    request handed while no interactive one waited must not take the next free row from
    an interactive one handed after it (through the engine process's pipe:
    tests/test_engine_process.py)."""
    from schemas import SamplingParams
    from workers.generate.scheduler import Scheduler, Sequence
    from workers.generate.synthetic import SyntheticEngine

    def req(rid, max_tokens=1):
        return GenerateRequest(request_id=rid, prompt_token_ids=[1], sampling=SamplingParams(
            max_tokens=max_tokens, ignore_eos=True))

    handed = [("running", 0), ("bulk", 1), ("chat", 0)]
    engine = SyntheticEngine(step_s=0.0, max_batch=1, vocab_size=100)
    for rid, tier in handed:
        engine.add(req(rid), tier=tier)
    order = []
    while engine.has_work():
        order += [o.request_id for o in engine.step() if o.finish_reason]
    assert order == ["running", "chat", "bulk"]

    scheduler = Scheduler(max_rows=1, prefill_chunk=8)
    for rid, tier in handed[1:]:
        seq = Sequence(req(rid), max_output=1)
        seq.tier = tier
        scheduler.add(seq)
    assert [p.seq.request_id for p in scheduler.schedule().prefills] == ["chat"]
