"""The engine process's side of the pipes (engine_process.py starts it and reads it): its
main, which runs the engine on an `EngineThread` and takes the worker's commands, and the
outbox thread that writes the engine's steps to the worker (docs/design.md §4)."""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from typing import Any, Callable

from schemas.errors import ValidationError
from workers.generate.chunks import ChunkPolicy
from workers.generate.engine_pipe import (Abort, Add, Failed, Ready, Step, Tune, decode_to_child, encode,
                                          write_frame)
from workers.generate.engine_thread import EngineThread, engine_limits, make_engine
from workers.generate.outputs import StepOutputs
from workers.generate.token_holder import TokenHolder
from workers.logs import setup_logging

log = logging.getLogger(__name__)


# How often the outbox looks for held tokens that fell due while no step came (their
# lateness at most): steps faster than this carry them out themselves.
RELEASE_TICK_S = 0.005
_WAKE = object()  # (in the outbox's queue: tokens are held now, so wait with the tick)
# Steps with no outputs send the worker an empty step this often (its stall watch: `deliver`).
BEAT_EVERY_S = 1.0
BEAT = Step(StepOutputs(), 0.0)  # (step_s 0: not a step in the metrics; past the holder)


class Outbox:
    """The child's messages to the worker, sent by a thread of their own, so the engine
    steps on while a step's outputs are encoded and written: a pipe holds 64 KB, a
    batch-256 step at k=20 is ~72 KB, and the write waits for the worker to read. A GPU
    engine overlaps that with its next step; with the synthetic one's 2 ms steps the
    generate stage ran 1.07x faster at k=0 and 1.24x at k=5 this way (BENCHMARKS.md,
    "Each stage alone").
    At most `depth` messages wait: past that the engine waits too, as it did on the
    pipe, so a worker that falls behind still slows the engine instead of growing
    this queue.

    A small step (at most `direct_max` outputs) with nothing ahead of it is written by
    the engine thread itself: its encoding costs the engine a few µs, and its tokens skip
    the hand-over to the outbox thread (the engine-to-worker hop at low load, p50 0.42 →
    0.33 ms on 2 vCPUs: BENCHMARKS.md, "Low-load latency: where a token's time goes").
    A big step still goes through the thread, as above. Order holds: a step goes direct
    only when every step queued before it is written (`_queued` counts those put and not
    yet written; only the engine thread puts). The outbox thread writes without holding
    `_lock`, so a put never waits on a write the worker is slow to read: it queues.

    With a `holder` (workers/generate/token_holder.py), what a step hands on is what the
    holder lets through, decided here rather than on the engine thread: in this thread
    the holder's walk over a step's tokens overlaps the engine's next step. Held tokens
    that fall due while no step comes leave within `RELEASE_TICK_S`.

    Should the thread fail, nothing it was to send can reach the worker: it logs why and
    calls `on_failure` (the child exits, so the worker sees its engine gone: its requests
    are not left waiting on steps that were dropped), and a later `put` raises."""

    def __init__(self, conn, depth: int = 4, direct_max: int = 8, holder: TokenHolder | None = None,
                 on_failure: Callable[[BaseException], None] | None = None):
        self._conn = conn
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._direct_max = direct_max
        self._lock = threading.Lock()  # guards _queued (and a direct write: none runs beside the thread's)
        self._queued = 0
        self.holder = holder
        # The holder's state, and what it hands on from there to the pipe: one step's
        # hand-on is written before another's is made, so a request's tokens stay in order.
        self._holding = threading.Lock()
        self._idle = False  # the thread waits for a message with no timeout: nothing was held (under _holding)
        self._gone = False  # a write failed: the worker is gone
        self.failure: BaseException | None = None  # what stopped the thread, if it failed
        self._on_failure = on_failure
        self._thread = threading.Thread(target=self._run, name="genpipe-engine-outbox", daemon=True)
        self._thread.start()

    def put(self, message: Step | Failed) -> None:
        with self._lock:
            if self._gone:
                return  # nothing to send to
            if self.failure is not None:
                raise RuntimeError(f"the engine's outbox failed: {self.failure!r}") from self.failure
            if self._queued == 0 and isinstance(message, Step) and len(message.outputs) <= self._direct_max:
                self._send(message, direct=True)
                return
            self._queued += 1
        while self._thread.is_alive():  # (gone once the worker is: nothing to send to)
            try:
                self._queue.put(message, timeout=0.1)
                return
            except queue.Full:
                continue
        if self.failure is not None:  # (it failed while this step waited for room)
            raise RuntimeError(f"the engine's outbox failed: {self.failure!r}") from self.failure

    def close(self, timeout: float = 10.0) -> None:
        """Send what waits, then stop the thread (at most `timeout` s: a worker that reads
        nothing more is not waited for)."""
        if not self._thread.is_alive():
            return  # the worker is gone
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _write(self, data: bytes) -> None:
        try:
            write_frame(self._conn, data)
        except (OSError, ValueError):
            self._gone = True  # the worker is gone (a broken pipe): the main loop sees EOF and stops us

    def _send(self, message: Step | Failed, direct: bool = False) -> None:
        """Write a message; a step through the holder first (what it hands on, if anything).
        `direct`: written by the engine thread (`put`), not the outbox thread."""
        if self.holder is None or not isinstance(message, Step) or message is BEAT:
            self._write(encode(message))
            return
        with self._holding:
            outputs = self.holder.step(message.outputs, time.monotonic())
            if outputs or outputs.batch:  # (a step that hands on nothing still carries its metrics)
                self._write(encode(Step(outputs, message.step_s)))
            # A direct step that left tokens held while the thread waits with no timeout:
            # wake it to release them when due (room: nothing is queued behind a direct
            # step). The thread's own steps need no wake, it looks again after each; and
            # its queue may be full then: a wake put there killed the thread (queue.Full),
            # and with it every later step of the engine.
            if direct and self._idle and self.holder.holding:
                self._idle = False
                self._queue.put_nowait(_WAKE)

    def _release(self) -> None:
        """Held tokens that fell due with no step to carry them (steps slower than a tick)."""
        with self._holding:
            due = self.holder.release(time.monotonic())
            if due is not None:
                self._write(encode(Step(due, 0.0)))

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:
            log.exception("the engine's outbox failed: its steps cannot reach the worker")
            self.failure = exc
            if self._on_failure is not None:
                self._on_failure(exc)

    def _serve(self) -> None:
        while True:
            if self.holder is not None:
                with self._holding:
                    self._idle = not self.holder.holding
            try:
                message = self._queue.get(timeout=None if self._idle or self.holder is None else RELEASE_TICK_S)
            except queue.Empty:
                self._release()
                continue
            if message is None:
                return
            if message is _WAKE:
                continue
            self._send(message)
            with self._lock:
                self._queued -= 1
            if self._gone:
                return


def _exit_failed(exc: BaseException) -> None:
    """The child can no longer reach the worker (its outbox failed): exit at once, so the
    worker sees its engine gone (`EngineProcess._child_gone`) and stops, its requests left
    uncommitted for the next owner, instead of waiting for steps that were dropped."""
    logging.shutdown()
    os._exit(1)


def child_main(commands, steps, engine_options: dict[str, Any], min_step_s: float, threads: int,
                policy: ChunkPolicy | None = None, log_level: int = logging.WARNING) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C / SIGTERM reach the whole process
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # group; the worker drains, then stops us
    # The worker's level and format (a spawned process starts with neither: its warnings
    # came bare, its INFO lines not at all)
    setup_logging(log_level)
    import torch
    from transformers.utils import logging as hf_logging

    from workers.gc_tuning import tune_after_startup

    if threads:
        torch.set_num_threads(threads)
    # No tqdm bar in a worker's log; and a bar's lock is a multiprocessing semaphore that
    # the exit below would leave for the resource tracker to report as leaked.
    hf_logging.disable_progress_bar()
    try:
        engine = make_engine(engine_options)
    except BaseException as exc:
        write_frame(steps, encode(Failed(f"{type(exc).__name__}: {exc}")))
        return
    # Start-up (torch, transformers, the model) is over: as the worker does once it is up
    # (workers/gc_tuning.py). Left out, the child's full collections rescanned all of it
    # while serving: 150-200 ms each, the engine thread stalled, twice in one k=5
    # throughput run (BENCHMARKS.md, "The collector's young threshold").
    tune_after_startup()
    write_frame(steps, encode(Ready(engine_limits(engine))))
    outbox = Outbox(steps, holder=TokenHolder(policy) if policy is not None else None, on_failure=_exit_failed)

    handed = [time.monotonic()]  # when a step last went to the worker

    def deliver(outputs: list, step_s: float) -> None:
        if thread.failure is not None:
            outbox.put(Failed(f"{type(thread.failure).__name__}: {thread.failure}"))
        elif outputs:
            outbox.put(Step(outputs, step_s))
            handed[0] = time.monotonic()
        elif time.monotonic() - handed[0] >= BEAT_EVERY_S:
            # Steps with nothing to hand on (the parts of a long prompt's prefill) sent
            # nothing: the worker's stall watch heard no step for as long as the prefill
            # took, and past --engine-stall-s stopped the worker as stuck (and the next
            # owner, re-running the request, the same way). An empty step says it steps.
            outbox.put(BEAT)
            handed[0] = time.monotonic()

    thread = EngineThread(engine, deliver, min_step_s=min_step_s)  # (tokens are held in the outbox)
    thread.start()
    stopped = True  # by the worker (Stop, or it is gone), not by the engine's failure
    try:
        while thread.failure is None:
            message = decode_to_child(commands.recv_bytes())
            if isinstance(message, Add):
                try:
                    thread.add(message.request, validated=True, tier=message.tier)  # (validated by the parent)
                except ValidationError as exc:  # a duplicate id
                    log.warning("engine refused %s: %s", message.request.request_id, exc)
            elif isinstance(message, Abort):
                thread.abort(message.request_id, message.reason)
            elif isinstance(message, Tune):
                if outbox.holder is not None:
                    outbox.holder.tune(message.lagging, message.stretch)
            else:
                break
        else:
            stopped = False
    except (EOFError, OSError):
        pass  # the worker is gone: so are we
    if not stopped:  # the engine failed: its Failed goes to the worker before we exit
        thread.stop()
        outbox.close()
        logging.shutdown()
    # Stopped by the worker, which reads no more steps: out at once, the engine mid-step
    # or not. Waiting for the engine thread and the outbox (a step the worker would not
    # read) held a child whose write waited on a full pipe, the worker blocked in
    # `EngineProcess.stop` on the loop that reads it, until the worker killed it: 10 s of
    # a shutdown under load (tests/test_engine_process.py).
    # Skip the interpreter's teardown: its collections over every object torch and
    # transformers made kept a core busy for ~2 s after each stop (measured), and the
    # worker waits for us. Nothing is left to clean up: the OS frees the rest. (Nor is
    # logging shut down with the threads still running: a handler's lock held by one
    # stuck on a full stderr would hold the exit. A line logged is written already.)
    os._exit(0)
