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
