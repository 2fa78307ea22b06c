"""EngineOutputs (workers/generate/service.py): engine steps reach the handler on the
event loop in order, and the engine waits while the loop has `max_steps_waiting` steps
it has not published yet, instead of piling them up. No broker, no model: the handler is
a stand-in whose publish steps the test finishes by hand."""

from __future__ import annotations

import asyncio
import threading
import time
import types

from workers.generate.service import EngineOutputs


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class Handler:
    """on_outputs as the real handler's: takes a step, returns its publish step."""

    def __init__(self, loop):
        self.loop = loop
        self.steps: list = []
        self.publishes: list[asyncio.Future] = []

    def on_outputs(self, outputs):
        self.steps.append(outputs)
        self.publishes.append(self.loop.create_future())
        return self.publishes[-1]

    def publish_all(self) -> None:
        self.loop.call_soon_threadsafe(lambda: [f.set_result(None) for f in self.publishes if not f.done()])


def test_the_engine_waits_while_steps_are_unpublished_and_every_step_arrives_in_order(loop):
    outputs = EngineOutputs(loop, max_steps_waiting=2)
    outputs.engine = types.SimpleNamespace(failure=None)
    handler = outputs.handler = Handler(loop)
    delivered = []

    def engine():
        for n in range(6):
            outputs.deliver([n], 0.0)
            delivered.append(n)

    stepping = threading.Thread(target=engine, daemon=True)
    stepping.start()
    wait_until(lambda: len(handler.steps) == 2)
    stepping.join(0.5)  # time enough for four more deliveries, were nothing holding them
    assert stepping.is_alive() and delivered == [0, 1], "the engine ran on past two unpublished steps"
    loop.call_soon_threadsafe(handler.publishes[0].set_result, None)  # one publish step done: one more step
    wait_until(lambda: len(handler.steps) == 3)
    while stepping.is_alive():
        handler.publish_all()
        stepping.join(0.05)
    handler.publish_all()
    wait_until(lambda: len(handler.steps) == 6)
    assert handler.steps == [[n] for n in range(6)]


def test_a_stopped_worker_does_not_hold_the_engine(loop):
    outputs = EngineOutputs(loop, max_steps_waiting=1)
    outputs.engine = types.SimpleNamespace(failure=None)
    handler = outputs.handler = Handler(loop)
    outputs.deliver([0], 0.0)
    wait_until(lambda: len(handler.steps) == 1)
    loop.call_soon_threadsafe(loop.stop)
    wait_until(lambda: not loop.is_running())
    loop.close()  # the worker has stopped with a step unpublished
    finished = threading.Event()
    threading.Thread(target=lambda: (outputs.deliver([1], 0.0), finished.set()), daemon=True).start()
    assert finished.wait(10), "deliver() kept waiting for a loop that is closed"


async def test_step_figures_reach_the_metrics_within_the_flush_interval_and_at_shutdown():
    """Each engine step's time, batch and longest gap reach the histograms in batches: at
    most StepMetrics.FLUSH_S after the step, and at once on `flush` (the worker's shutdown),
    so a scrape after a worker stopped counts every step it made."""
    from workers.generate.outputs import StepOutputs
    from workers.generate.service import StepMetrics

    metrics = StepMetrics(asyncio.get_running_loop())

    def counts() -> tuple[float, float, float, float]:
        return (metrics.step_time.series._sum.get(), sample(metrics.batch_size.series),
                sample(metrics.inter_token.series), sample(metrics.step_time.series))

    def sample(histogram) -> float:
        return sum(bucket.get() for bucket in histogram._buckets)

    before = counts()
    step = StepOutputs(("a", "b"), (5, 6), None, 1)
    step.batch, step.gap_s = 256, 0.004
    for _ in range(3):
        metrics.observe(step, 0.002)
    metrics.observe(step, 0.0)  # tokens handed on between steps: not a step
    deadline = time.monotonic() + 5 * StepMetrics.FLUSH_S + 5
    while counts()[3] < before[3] + 3:
        assert time.monotonic() < deadline, "the steps never reached the histograms"
        await asyncio.sleep(0.01)  # (the flush is a timer on this loop)
    after = counts()
    assert after[1] - before[1] == 3 and after[2] - before[2] == 3 and after[3] - before[3] == 3
    assert abs(after[0] - before[0] - 0.006) < 1e-9
    metrics.observe(step, 0.002)
    metrics.flush()
    assert counts()[3] == before[3] + 4
