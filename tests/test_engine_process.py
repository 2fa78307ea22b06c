"""The engine in a child process: same tokens as in-process, errors at add(), failures
seen; its steps read on an event loop, which stops reading while steps wait unpublished."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from schemas import GenerateRequest, SamplingParams
from schemas.errors import ValidationError
from workers.generate.engine import Engine
from workers.generate.engine_process import EngineProcess


def on_loop(loop, function, *args):
    """function(*args) run on `loop`; its result."""
    async def call():
        return function(*args)
    return asyncio.run_coroutine_threadsafe(call(), loop).result(60)


def started(engine, loop):
    engine.start()
    asyncio.run_coroutine_threadsafe(engine.read_steps(), loop).result(60)
    return engine


class Collector:
    """The step sink: gathers outputs per request; signals finals and failures."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.finals: dict[str, str] = {}
        self.calls_after_failure = 0
        self.changed = threading.Condition()

    def __call__(self, outputs, step_s):
        with self.changed:
            if not outputs:
                self.calls_after_failure += 1
            for out in outputs:
                self.tokens.setdefault(out.request_id, []).extend(out.token_ids)
                if out.finish_reason is not None:
                    self.finals[out.request_id] = out.finish_reason
            self.changed.notify_all()

    def wait(self, condition, timeout: float = 60.0) -> None:
        with self.changed:
            assert self.changed.wait_for(condition, timeout), "timed out waiting on the engine process"


def request(rid: str, prompt: list[int], **sampling) -> GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    return GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=SamplingParams(**sampling))


def test_engine_process_streams_the_same_tokens_and_stops_cleanly(tiny_model_dir, loop):
    prompts = {"a": [1, 50, 60, 70], "b": [1, 300, 301], "c": [1, 9, 8, 7, 6, 5]}
    alone = Engine(str(tiny_model_dir), max_batch=4)
    for rid, prompt in prompts.items():
        alone.add(request(rid, prompt, max_tokens=12, ignore_eos=True))
    expected: dict[str, list[int]] = {}
    while alone.has_work():
        for out in alone.step():
            expected.setdefault(out.request_id, []).extend(out.token_ids)

    got = Collector()
    # Paced (20 ms a step): "long" needs ~40 s to reach the context length, so the abort
    # lands while it runs even on a starved machine.
    engine = EngineProcess(dict(model_dir=str(tiny_model_dir), max_batch=4), got, min_step_s=0.02)
    started(engine, loop)
    try:
        assert engine.limits == {"max_logprobs": 20, "vocab_size": alone.vocab_size,
                                 "max_model_len": alone.max_model_len}
        # invalid requests are refused here, by add(), like the in-process engine does
        with pytest.raises(ValidationError, match="prompt_token_ids"):
            engine.add(request("bad", [1, alone.vocab_size + 5]))
        for rid, prompt in prompts.items():
            engine.add(request(rid, prompt, max_tokens=12, ignore_eos=True))
        engine.add(request("long", [1, 2, 3], max_tokens=100_000, ignore_eos=True))
        got.wait(lambda: all(rid in got.finals for rid in prompts))
        engine.abort("long")
        got.wait(lambda: "long" in got.finals)
        child = engine._process
    finally:
        on_loop(loop, engine.stop)
    assert {rid: got.tokens[rid] for rid in prompts} == expected
    assert got.finals["long"] == "abort" and "bad" not in got.tokens
    assert not child.is_alive() and child.exitcode == 0
    assert engine.failure is None


def test_engine_process_failures_are_reported(tiny_model_dir, tmp_path, loop):
    # a model that cannot load: start() says why
    broken = EngineProcess(dict(model_dir=str(tmp_path / "no-such-model")), Collector())
    with pytest.raises(RuntimeError, match="engine process failed to start: .*no-such-model"):
        broken.start()

    # the child dying mid-flight: failure is set and deliver is told (the worker then exits)
    got = Collector()
    engine = EngineProcess(dict(model_dir=str(tiny_model_dir), max_batch=2), got)
    started(engine, loop)
    try:
        os.kill(engine._process.pid, signal.SIGKILL)
        got.wait(lambda: got.calls_after_failure == 1)
        assert isinstance(engine.failure, RuntimeError)
        assert "engine process exited (exit code -9)" in str(engine.failure)
        with pytest.raises(RuntimeError, match="engine process is gone"):
            engine.add(request("late", [1, 2, 3]))
    finally:
        on_loop(loop, engine.stop)


def big_step(n: int, tokens: int = 2000):
    from workers.generate.engine_pipe import Step
    from workers.generate.outputs import RequestOutput, StepOutputs

    # ~10 KB each: a few fill the pipe's buffer, so the writes really wait on the reader
    return Step(StepOutputs(others=[RequestOutput(request_id=f"r-{n}", token_ids=list(range(tokens)))]), float(n))


def test_the_outbox_sends_every_step_in_order_even_those_waiting_at_close():
    import multiprocessing

    from workers.generate.engine_child import Outbox
    from workers.generate.engine_pipe import decode_from_child, read_frame

    reader, writer = multiprocessing.Pipe(duplex=False)
    outbox = Outbox(writer, depth=2)
    received = []

    def engine():
        for n in range(30):
            outbox.put(big_step(n))
        outbox.close()

    def worker():
        received.extend(decode_from_child(read_frame(reader)).step_s for _ in range(30))

    sender, taker = threading.Thread(target=engine), threading.Thread(target=worker)
    sender.start()  # puts wait on the full queue while nothing reads: the engine slows, nothing is dropped
    taker.start()
    sender.join(60)
    taker.join(60)
    assert not sender.is_alive() and not taker.is_alive()
    assert received == [float(n) for n in range(30)]


def test_a_small_step_goes_out_on_the_engine_thread_but_never_ahead_of_queued_ones(monkeypatch):
    """A small step with nothing queued is written by the engine thread itself (its
    tokens skip the hand-over to the outbox thread: low-load latency); one that comes
    while bigger steps still wait for the worker to read goes behind them, and putting
    it never waits on a write the worker is slow to read."""
    import fcntl
    import multiprocessing
    import termios

    from workers.generate import engine_child
    from workers.generate.engine_child import Outbox
    from workers.generate.engine_pipe import Step, decode_from_child, encode, read_frame
    from workers.generate.outputs import RequestOutput, StepOutputs

    writers: dict[float, str] = {}
    real_write = engine_child.write_frame

    def write_frame(conn, payload):
        writers[decode_from_child(payload).step_s] = threading.current_thread().name
        real_write(conn, payload)

    monkeypatch.setattr(engine_child, "write_frame", write_frame)

    def small(n: int):
        return Step(StepOutputs.of([RequestOutput(request_id=f"s-{n}", token_ids=[n])]), float(n))

    def big(n: int):  # two outputs (over direct_max), ~30 KB: two fill most of the pipe
        return Step(StepOutputs(others=[RequestOutput(request_id=f"b-{n}-{i}", token_ids=list(range(5000, 10000)))
                                        for i in range(2)]), float(n))

    def in_pipe() -> int:
        return int.from_bytes(fcntl.ioctl(reader.fileno(), termios.FIONREAD, b"\0\0\0\0"), "little")

    reader, writer = multiprocessing.Pipe(duplex=False)
    outbox = Outbox(writer, depth=8, direct_max=1)
    outbox.put(small(0))
    assert writers == {0.0: threading.current_thread().name}, "a small step with nothing queued was handed over"
    assert decode_from_child(read_frame(reader)).step_s == 0.0
    first = [big(1), big(2), big(3)]
    for step in first:
        outbox.put(step)
    frame = 4 + len(encode(big(1)))
    wait_until(lambda: in_pipe() > 2 * frame)  # nothing reads: the outbox thread now waits inside a write
    rest = [big(4), small(5), big(6), small(7)]
    put = threading.Event()
    threading.Thread(target=lambda: ([outbox.put(step) for step in rest], put.set()), daemon=True).start()
    assert put.wait(10), "a put waited on a write the worker was not reading"
    received = [decode_from_child(read_frame(reader)).step_s for _ in first + rest]
    assert received == [step.step_s for step in first + rest]
    assert writers[5.0] == writers[7.0] == "genpipe-engine-outbox"
    outbox.close()


def test_the_outbox_hands_on_what_its_holder_lets_through_and_held_tokens_once_due_without_a_step():
    """With a token holder (the chunk policy), the outbox writes what it hands on: a
    request's first token at once, the next ones held, and those leave by the delay cap
    though no further step comes to carry them; nothing is lost or reordered."""
    import multiprocessing
    import time

    from workers.generate.chunks import ChunkPolicy
    from workers.generate.engine_child import RELEASE_TICK_S, Outbox
    from workers.generate.engine_pipe import Step, decode_from_child, read_frame
    from workers.generate.outputs import StepCollector
    from workers.generate.token_holder import TokenHolder

    def step(tokens: list[int]) -> Step:
        collector = StepCollector()
        for n, token in enumerate(tokens):
            collector.token(f"r{n}", token)
        collector.sampled_at_ns = time.time_ns()
        return Step(collector.done(), 0.002)

    # one chunk a second per request, but no token held past 0.3 s
    holder = TokenHolder(ChunkPolicy(max_records_per_s=2.0, max_delay_s=0.3, max_tokens=100))
    reader, writer = multiprocessing.Pipe(duplex=False)
    outbox = Outbox(writer, depth=4, direct_max=8, holder=holder)
    outbox.put(step([10, 20]))  # first tokens: at once
    first = decode_from_child(read_frame(reader))
    assert first.outputs.token_ids == (10, 20) and first.outputs.batch == 2
    for n in range(1, 4):
        started = time.monotonic()
        outbox.put(step([10 + n, 20 + n]))
        held = decode_from_child(read_frame(reader))  # a step that hands on nothing still says its size
        assert not held.outputs and held.outputs.batch == 2
    assert time.monotonic() - started < 0.2
    assert not reader.poll(0.1)
    assert reader.poll(0.3 + 10 * RELEASE_TICK_S), "held tokens waited past the delay cap"
    released = decode_from_child(read_frame(reader))
    assert {out.request_id: out.token_ids for out in released.outputs.others} == {"r0": (11, 12, 13), "r1": (21, 22, 23)}
    assert released.step_s == 0.0 and not holder.held["r0"].pending_ids
    outbox.close()


def test_a_held_step_met_by_a_full_queue_does_not_stop_the_outbox():
    """A step the outbox thread takes from its queue, whose tokens the holder keeps, while
    the engine has filled the queue behind it. Before, the thread then put a wake-up into
    that full queue (queue.Full) and died: every later step of the engine was dropped and
    its requests waited for good (seen at k=5 on a 3-broker cluster, where publishing lags
    and the queue stays full). Every token must arrive, in order."""
    import multiprocessing

    from workers.generate.chunks import ChunkPolicy
    from workers.generate.engine_child import Outbox
    from workers.generate.engine_pipe import Step, decode_from_child, read_frame
    from workers.generate.outputs import StepCollector
    from workers.generate.token_holder import TokenHolder

    class GatedHolder(TokenHolder):
        """Its second step waits for the test to fill the outbox's queue."""

        def __init__(self, policy):
            super().__init__(policy)
            self.steps, self.in_step, self.gate = 0, threading.Event(), threading.Event()

        def step(self, outputs, now):
            self.steps += 1
            if self.steps == 2:
                self.in_step.set()
                assert self.gate.wait(30)
            return super().step(outputs, now)

    def step(n: int) -> Step:
        collector = StepCollector()
        collector.token("r0", n)
        collector.token("r1", 100 + n)
        return Step(collector.done(), 0.002)

    holder = GatedHolder(ChunkPolicy(max_records_per_s=1000.0, max_delay_s=0.05, max_tokens=100))
    reader, writer = multiprocessing.Pipe(duplex=False)
    outbox = Outbox(writer, depth=2, direct_max=0, holder=holder)  # (every step through the thread)
    outbox.put(step(0))  # first tokens: handed on at once; the thread is idle after it
    assert decode_from_child(read_frame(reader)).outputs.token_ids == (0, 100)
    outbox.put(step(1))  # held (the thread, in the holder, waits for the gate)
    assert holder.in_step.wait(30)
    outbox.put(step(2))
    outbox.put(step(3))  # the queue is full now
    holder.gate.set()
    for n in range(4, 10):
        outbox.put(step(n))  # (were the thread gone, these would be dropped)
    got: dict[str, list[int]] = {"r0": [0], "r1": [100]}
    while got["r0"] != list(range(10)) or got["r1"] != list(range(100, 110)):
        assert reader.poll(10), f"tokens stopped arriving: {got}"
        for out in decode_from_child(read_frame(reader)).outputs:
            got[out.request_id].extend(out.token_ids)
    assert outbox.failure is None
    outbox.close()


def test_an_outbox_that_fails_says_so_and_drops_nothing_silently():
    """The outbox thread failing (here its holder raises) is reported to `on_failure` (in
    the engine process: exit, so the worker sees its engine gone) and every later put
    raises, instead of steps being dropped while the engine goes on."""
    import multiprocessing

    from workers.generate.chunks import ChunkPolicy
    from workers.generate.engine_child import Outbox
    from workers.generate.token_holder import TokenHolder

    class BrokenHolder(TokenHolder):
        def step(self, outputs, now):
            raise ZeroDivisionError("a bug in the holder")

    failures = []
    failed = threading.Event()
    reader, writer = multiprocessing.Pipe(duplex=False)
    outbox = Outbox(writer, depth=2, direct_max=0, holder=BrokenHolder(ChunkPolicy()),
                    on_failure=lambda exc: (failures.append(exc), failed.set()))
    outbox.put(big_step(0))
    assert failed.wait(30)
    assert isinstance(failures[0], ZeroDivisionError)
    with pytest.raises(RuntimeError, match="outbox failed.*a bug in the holder"):
        outbox.put(big_step(1))


def test_a_worker_gone_does_not_hang_the_engine_on_the_outbox():
    import multiprocessing

    from workers.generate.engine_child import Outbox

    reader, writer = multiprocessing.Pipe(duplex=False)
    outbox = Outbox(writer, depth=2)
    reader.close()  # the worker exited: the next write breaks the pipe
    done = threading.Event()

    def engine():
        for n in range(20):
            outbox.put(big_step(n))
        done.set()

    threading.Thread(target=engine, daemon=True).start()
    assert done.wait(30), "put() kept waiting for a worker that is gone"
    outbox.close(timeout=5)


class Sink:
    """A step sink whose publish steps the test finishes by hand."""

    def __init__(self, loop):
        self.loop = loop
        self.steps: list[float] = []
        self.publishes: list[asyncio.Future] = []

    def __call__(self, outputs, step_s):
        self.steps.append(step_s)
        self.publishes.append(self.loop.create_future())
        return self.publishes[-1]

    def publish(self, count: int) -> None:
        """Finish the first `count` unfinished publish steps."""
        def finish():
            for future in [f for f in self.publishes if not f.done()][:count]:
                future.set_result(None)
        self.loop.call_soon_threadsafe(finish)


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_the_reader_stops_reading_while_steps_wait_unpublished_and_loses_none(loop):
    import multiprocessing
    import types

    from workers.generate.engine_child import Outbox
    from workers.generate.engine_process import StepReader

    reader, writer = multiprocessing.Pipe(duplex=False)
    sink = Sink(loop)
    engine = types.SimpleNamespace(max_steps_waiting=2, _step_sink=sink, _child_gone=lambda: None,
                                   _fail=lambda exc: None)
    transport, _ = asyncio.run_coroutine_threadsafe(
        loop.connect_read_pipe(lambda: StepReader(engine), reader), loop).result(10)
    outbox = Outbox(writer, depth=1)
    written = []

    def child():
        for n in range(40):  # ~10 KB each: 400 KB, several times what a pipe holds
            outbox.put(big_step(n))
            written.append(n)
        outbox.close()

    stepping = threading.Thread(target=child, daemon=True)
    stepping.start()
    wait_until(lambda: len(sink.steps) == 2)
    stepping.join(1.0)  # time enough to write everything, were nothing holding the child
    assert stepping.is_alive() and len(written) < 40, "the child wrote on while nothing was published"
    assert len(sink.steps) == 2, "steps were handed on past two unpublished ones"
    sink.publish(1)  # one publish step done: one more step
    wait_until(lambda: len(sink.steps) == 3)
    while len(sink.steps) < 40:
        sink.publish(40)
        time.sleep(0.01)
    stepping.join(10)
    assert not stepping.is_alive()
    assert sink.steps == [float(n) for n in range(40)]
    on_loop(loop, transport.close)


def test_a_failure_from_the_child_is_reported_once_and_ends_the_reading(loop):
    import multiprocessing
    import types

    from workers.generate.engine_pipe import Failed, encode, write_frame
    from workers.generate.engine_process import StepReader

    reader, writer = multiprocessing.Pipe(duplex=False)
    sink, failures, gone = Sink(loop), [], []
    engine = types.SimpleNamespace(max_steps_waiting=2, _step_sink=sink, _child_gone=lambda: gone.append(1),
                                   _fail=failures.append)
    transport, _ = asyncio.run_coroutine_threadsafe(
        loop.connect_read_pipe(lambda: StepReader(engine), reader), loop).result(10)
    for n in range(3):
        write_frame(writer, encode(big_step(n, tokens=10)))
    write_frame(writer, encode(Failed("RuntimeError: CUDA out of memory")))
    write_frame(writer, encode(big_step(9, tokens=10)))  # nothing after a failure is read
    wait_until(lambda: len(sink.steps) == 2)
    sink.publish(1)  # room for step 2
    wait_until(lambda: len(sink.steps) == 3)
    sink.publish(1)  # room again: the failure is read
    wait_until(lambda: failures)
    sink.publish(1)  # step 2's publish makes room once more: nothing more may be read
    wait_until(lambda: all(f.done() for f in sink.publishes))
    on_loop(loop, lambda: None)  # (after the callbacks that publish scheduled)
    wait_until(lambda: transport.is_closing() and gone)
    assert sink.steps == [0.0, 1.0, 2.0]
    assert [str(exc) for exc in failures] == ["engine failed: RuntimeError: CUDA out of memory"]


def test_a_step_the_worker_cannot_take_fails_the_engine_instead_of_stalling_it(loop):
    """A step sink (the worker's handler) that raises: asyncio alone would log it and the
    reader would stop for good, the worker looking healthy with its steps stalled. The
    engine fails instead, with the reason, and nothing after that step is handed on."""
    import multiprocessing
    import types

    from workers.generate.engine_pipe import encode
    from workers.generate.engine_process import StepReader

    reader, writer = multiprocessing.Pipe(duplex=False)
    steps, failures = [], []

    def sink(outputs, step_s):
        steps.append(step_s)
        if step_s == 1.0:
            raise KeyError("r-1")
        return None

    engine = types.SimpleNamespace(max_steps_waiting=2, _step_sink=sink, _child_gone=lambda: None,
                                   _fail=failures.append)
    transport, _ = asyncio.run_coroutine_threadsafe(
        loop.connect_read_pipe(lambda: StepReader(engine), reader), loop).result(10)
    frames = [encode(big_step(n, tokens=10)) for n in range(4)]  # one write (< PIPE_BUF): one read
    os.write(writer.fileno(), b"".join(len(frame).to_bytes(4, "big") + frame for frame in frames))
    wait_until(lambda: failures and transport.is_closing())
    assert steps == [0.0, 1.0]
    assert [str(exc) for exc in failures] == ["reading the engine's steps failed: KeyError: 'r-1'"]


def test_a_failed_engine_is_reported_once_even_if_the_sink_raises_on_it():
    from workers.generate.engine_process import EngineProcess
    from workers.generate.outputs import StepOutputs

    calls = []

    def sink(outputs, step_s):
        calls.append(outputs)
        raise RuntimeError("the handler is gone too")

    engine = EngineProcess({}, sink)
    engine._fail(RuntimeError("first"))
    engine._fail(RuntimeError("second"))
    assert str(engine.failure) == "first" and calls == [StepOutputs()] and not calls[0]


def test_a_long_prefill_tells_the_worker_that_the_engine_steps(tiny_model_dir, loop):
    """Steps with nothing to hand on (the parts of a long prompt's prefill, 4 tokens a
    step here) sent the worker nothing: its stall watch heard no step for as long as the
    prefill took, and past --engine-stall-s stopped the worker as stuck (a long context
    on a CPU: minutes), and every next owner of the request the same way. Now such steps
    send an empty step every second: no tokens, no step in the metrics (step_s 0)."""
    arrivals: list[tuple[int, float]] = []
    first_token = threading.Event()

    def sink(outputs, step_s):
        arrivals.append((len(outputs), step_s))
        if len(outputs):
            first_token.set()
    engine = EngineProcess(dict(model_dir=str(tiny_model_dir), max_batch=4, prefill_chunk=4), sink,
                           min_step_s=0.02)  # 600 / 4 steps of 20 ms: 3 s of prefill
    started(engine, loop)
    try:
        engine.add(request("long", [5] * 600, max_tokens=2, ignore_eos=True))
        assert first_token.wait(60)
    finally:
        on_loop(loop, engine.stop)
    beats = [step_s for n, step_s in arrivals[:arrivals.index(next(a for a in arrivals if a[0]))]]
    assert len(beats) >= 2 and set(beats) == {0.0}


def test_the_engine_child_queues_an_interactive_request_before_a_bulk_one_handed_earlier(loop):
    """The tier crosses the pipe: with the one row busy, a bulk request handed first
    waits for the interactive one handed after it (tests/test_admission.py: the engines)."""
    got = Collector()
    # 50 ms steps: "running" holds the one row (~1 s) while the other two reach the child's queue
    engine = EngineProcess(dict(synthetic=dict(step_s=0.05, max_batch=1, vocab_size=100)), got)
    started(engine, loop)
    try:
        on_loop(loop, engine.add, request("running", [1], max_tokens=20, ignore_eos=True))
        on_loop(loop, lambda: engine.add(request("bulk", [1], max_tokens=1, ignore_eos=True), tier=1))
        on_loop(loop, lambda: engine.add(request("chat", [1], max_tokens=1, ignore_eos=True), tier=0))
        got.wait(lambda: len(got.finals) == 3)
    finally:
        on_loop(loop, engine.stop)
    assert list(got.finals) == ["running", "chat", "bulk"]


def test_a_child_stepping_with_steps_unread_stops_when_told_not_killed(loop, caplog):
    """The worker stops its engine on the loop that reads the child's steps; the child
    then waited for its engine thread and outbox, whose write of a step (~72 KB at batch
    256 and k = 20; a pipe holds 64 KB) waited for that loop: killed after 10 s, every
    shutdown under load. It now exits at once, as told."""
    import logging

    steps = []
    engine = EngineProcess(dict(synthetic=dict(step_s=0.002, max_batch=256, vocab_size=32000)),
                           lambda outputs, step_s: steps.append(len(outputs)))
    started(engine, loop)
    for i in range(256):
        on_loop(loop, engine.add, request(f"r{i}", [1, 2], max_tokens=100_000, ignore_eos=True, logprobs=20))
    deadline = time.monotonic() + 60
    while sum(steps) < 256 * 50:  # (the batch full and stepping)
        assert time.monotonic() < deadline, "the engine did not step"
        time.sleep(0.01)
    child = engine._process
    with caplog.at_level(logging.WARNING, logger="workers.generate.engine_process"):
        on_loop(loop, engine.stop)
    assert child.exitcode == 0, f"exit code {child.exitcode} (killed: -9)"
    assert "did not stop" not in caplog.text
