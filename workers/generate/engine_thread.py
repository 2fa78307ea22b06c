"""The engine's own thread: model steps never run on the asyncio event loop.

Kafka heartbeats, fetches and acks are tasks on the loop (aiokafka); a model step that
blocked it would get the worker evicted from its group. The thread steps the engine
while it has work and hands each step's outputs and duration to `deliver` (the worker
posts them to its loop; the engine process sends them down its pipe).

`min_step_s` paces the steps: a step that took less is followed by a wait (cut short
when a request arrives). The built-in tiny model steps in a few ms on a CPU, far faster
than a real model on a GPU; pacing it (e.g. 20 ms ≈ 50 tokens/s per request) lets
benchmarks and demos measure the Kafka side at a realistic token rate.

Given the worker's chunk `policy` (an engine in the worker's own process: the engine
process holds tokens in its outbox thread instead), the thread holds each request's
tokens until its chunk is due (token_holder.py) and hands on only those: after each
step, and in the pause between paced steps as they fall due. A token is held at most the
policy's `max_delay_s`, or to the end of the step under way if that is longer (a long
prefill).
Without a policy every token is handed on at its step.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from schemas.validation import validate_request
from workers.generate.chunks import ChunkPolicy
from workers.generate.outputs import StepOutputs
from workers.generate.token_holder import TokenHolder

log = logging.getLogger(__name__)

# deliver(outputs, step_seconds), called on the engine thread after every step; after a
# failure once more with (StepOutputs(), 0.0) and `failure` set.
Deliver = Callable[[StepOutputs, float], None]


class EngineThread:
    def __init__(self, engine, deliver: Deliver, min_step_s: float = 0.0, policy: ChunkPolicy | None = None):
        self.engine = engine
        self.min_step_s = min_step_s
        self.holder = TokenHolder(policy) if policy is not None else None
        self._deliver = deliver
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="genpipe-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def validate(self, request) -> None:
        """Raises schemas ValidationError for a request the engine would refuse."""
        validate_request(request, **engine_limits(self.engine))

    def add(self, request, *, validated: bool = False, tier: int = 0) -> None:
        """Validate (unless the caller did: `validated`) and queue (raises schemas
        ValidationError); the thread admits it next step. `tier`: 0 interactive, 1 bulk."""
        self.engine.add(request, validated=validated, tier=tier)
        self._wake.set()

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self.engine.abort(request_id, reason)
        self._wake.set()

    def tune(self, lagging: bool, stretch: float) -> None:
        """The worker's state for the chunk policy (TokenHolder.tune); any thread."""
        if self.holder is not None:
            self.holder.tune(lagging, stretch)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.engine.has_work():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                started = time.perf_counter()
                outputs = self.engine.step()
                step_s = time.perf_counter() - started
                if self.holder is not None:
                    outputs = self.holder.step(outputs, time.monotonic())
                self._deliver(outputs, step_s)
                self._pause(started + self.min_step_s)
        except BaseException as exc:  # surface to the worker, which exits non-zero
            log.exception("engine thread failed")
            self.failure = exc
            self._deliver(StepOutputs(), 0.0)

    def _pause(self, until: float) -> None:
        """Wait until `until` (perf_counter) for the next paced step, handing on held
        tokens as they fall due; a new request ends the pause."""
        while (left := until - time.perf_counter()) > 0:
            wait = left if self.holder is None else min(left, self.holder.wait_s(time.monotonic()))
            if self._wake.wait(wait):
                self._wake.clear()
                return
            if self.holder is not None and (due := self.holder.release(time.monotonic())) is not None:
                self._deliver(due, 0.0)


def engine_limits(engine) -> dict[str, int]:
    """validate_request's keyword arguments for an engine (the model's or the synthetic one)."""
    return dict(max_logprobs=engine.max_logprobs, vocab_size=engine.vocab_size, max_model_len=engine.max_model_len)


def make_engine(options: dict[str, Any]):
    """The engine `options` describe: `Engine(**options)`, or with a "synthetic" entry the
    benchmarking `SyntheticEngine(**options["synthetic"])` (no model)."""
    if "synthetic" in options:
        from workers.generate.synthetic import SyntheticEngine

        return SyntheticEngine(**options["synthetic"])
    from workers.generate.engine import Engine

    return Engine(**options)
