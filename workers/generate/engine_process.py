"""The engine in a child process: model steps never share a GIL with the Kafka loop.

In one process the engine thread and the event loop take turns on the GIL; publishing a
step's chunks (building records, aiokafka's batching and acks) then costs the engine a
large share of its tokens/s — measured 28% on the tiny model, while the same publishing
from another process cost it nothing (BENCHMARKS.md, engine (c)). So by default the
worker runs the engine and its stepping thread (`EngineThread`) in a child process,
like vLLM v1's engine core, and talks to it through two one-way pipes:

    parent → child   Add(request, tier) | Abort(request_id, reason) | Tune(lagging, stretch) | Stop()
    child → parent   Ready(limits) | Step(outputs, step_s) | Failed(error)

(the messages and their framing: engine_pipe.py; the child's side: engine_child.py).

The worker reads the child's pipe on its event loop (`StepReader`, an asyncio protocol),
not on a thread of its own: a reader thread had to win the GIL back from the busy loop
after every read, which cost it ~370 µs of CPU per batch-256 step where decoding the
step costs ~120 (BENCHMARKS.md, "The engine pipe read on the event loop"), and delayed
steps by up to the interpreter's 5 ms switch interval. Reading on the loop also makes
backpressure plain flow control: with `max_steps_waiting` steps not yet published, the
reader stops reading; the pipe fills, the child's outbox waits, and so does the engine.

`EngineProcess` has EngineThread's interface (add/abort/stop/failure), so the worker
does not know which one it drives. Requests are validated in the parent against the
limits the child reports, so an invalid request still raises at `add()` and gets its
error chunk. The child ignores SIGINT/SIGTERM (the worker decides when the engine stops:
it drains first) and exits when the worker goes away (end of file on its pipe).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
from typing import Any, Callable

from schemas.validation import validate_request
from workers.generate.chunks import ChunkPolicy
from workers.generate.engine_child import child_main
from workers.generate.engine_pipe import (LENGTH_BYTES, Abort, Add, Failed, Ready, Step, Stop, Tune, decode_from_child,
                                          encode, read_frame)
from workers.generate.outputs import StepOutputs

log = logging.getLogger(__name__)


# step_sink(outputs, step_s), called on the event loop for every step the child sends;
# returns the step's publish task (the reader counts those until done), or None if the
# step started none. After a failure it is called once more with (StepOutputs(), 0.0)
# and `failure` set.
StepSink = Callable[[StepOutputs, float], "asyncio.Future | None"]


class EngineProcess:
    def __init__(self, engine_options: dict[str, Any], step_sink: StepSink, *, min_step_s: float = 0.0,
                 threads: int = 0, start_timeout_s: float = 600.0, max_steps_waiting: int = 4,
                 policy: ChunkPolicy | None = None):
        self.engine_options = engine_options  # Engine(**engine_options) in the child
        self.min_step_s = min_step_s
        self.policy = policy  # the chunk policy the child's outbox holds tokens by (None: it holds none)
        self.threads = threads
        self.start_timeout_s = start_timeout_s
        self.max_steps_waiting = max_steps_waiting
        self.failure: BaseException | None = None
        self.limits: dict[str, int] = {}
        self._step_sink = step_sink
        self._commands = None  # parent → child
        self._steps = None  # child → parent
        self._process = None
        self._transport: asyncio.ReadTransport | None = None
        self._reaping: asyncio.Task | None = None
        self._send_lock = threading.Lock()
        self._stopping = False

    def start(self) -> None:
        """Start the child and wait until its model is loaded (blocking: call it off the
        loop); then `read_steps()` on the loop."""
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads/CUDA
        child_commands, self._commands = context.Pipe(duplex=False)
        self._steps, child_steps = context.Pipe(duplex=False)
        self._process = context.Process(
            target=child_main, args=(child_commands, child_steps, self.engine_options, self.min_step_s,
                                      self.threads, self.policy, logging.getLogger().getEffectiveLevel()),
            name="genpipe-engine", daemon=True)
        self._process.start()
        child_commands.close()  # the child's copies are the only ones left: its exit means EOF here
        child_steps.close()
        if not self._steps.poll(self.start_timeout_s):
            self._process.kill()
            raise RuntimeError(f"the engine process did not load its model within {self.start_timeout_s:.0f} s")
        try:
            message = decode_from_child(read_frame(self._steps))
        except EOFError:
            self._process.join(5)
            raise RuntimeError(f"the engine process exited while starting (exit code {self._process.exitcode})") from None
        if not isinstance(message, Ready):
            self._process.join(5)
            raise RuntimeError(f"the engine process failed to start: {getattr(message, 'error', message)}")
        self.limits = message.limits

    async def read_steps(self) -> None:
        """Hand the child's steps to the step sink from now on, on this event loop."""
        loop = asyncio.get_running_loop()
        self._transport, _ = await loop.connect_read_pipe(lambda: StepReader(self), self._steps)

    def validate(self, request) -> None:
        """Raises schemas ValidationError for a request the engine would refuse."""
        validate_request(request, **self.limits)

    def add(self, request, *, validated: bool = False, tier: int = 0) -> None:
        """Validate here (raises schemas ValidationError; skipped when the caller has:
        `validated`) and queue it in the child, which does not validate it again. `tier`:
        0 interactive, 1 bulk."""
        if not validated:
            self.validate(request)
        self._send(Add(request, tier))

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self._send(Abort(request_id, reason))

    def tune(self, lagging: bool, stretch: float) -> None:
        self._send(Tune(lagging, stretch))

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the child (blocking, at most `timeout` s before it is killed). On the loop
        that reads its steps, or after that loop has closed."""
        self._stopping = True
        if self._process is None:
            return
        try:
            self._send(Stop())
        except RuntimeError:
            pass  # already gone
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("engine process did not stop within %.0f s; killing it", timeout)
            self._process.kill()
            self._process.join(5)
        self._commands.close()
        if self._transport is None:
            self._steps.close()
            return
        try:
            self._transport.close()  # and the pipe it reads
        except RuntimeError:  # its loop has closed
            self._steps.close()

    def _send(self, message: Add | Abort | Stop) -> None:
        try:
            with self._send_lock:  # the loop and stop() may both send
                self._commands.send_bytes(encode(message))
        except (OSError, ValueError) as exc:  # broken pipe / closed: the child is gone
            raise RuntimeError(f"the engine process is gone: {exc}") from exc

    def _child_gone(self) -> None:
        """End of file on the child's pipe: it exited. Unless we stopped it, that is a
        failure; it is reaped first (off the loop), so the exit code is known."""
        if self._stopping or self.failure is not None:
            return

        async def reap() -> None:
            await asyncio.to_thread(self._process.join, 5)
            self._fail(RuntimeError(f"the engine process exited (exit code {self._process.exitcode})"))

        self._reaping = asyncio.ensure_future(reap())

    def _fail(self, exc: BaseException) -> None:
        """The engine is unusable: say so once; the worker's next tick stops it."""
        if self.failure is not None:
            return
        log.error("%s", exc)
        self.failure = exc
        try:
            self._step_sink(StepOutputs(), 0.0)
        except Exception:  # (the sink may be what failed: the failure stands, tick sees it)
            log.exception("the step sink failed on the engine's failure")


class StepReader(asyncio.Protocol):
    """The child's pipe, read on the event loop: frames cut from what arrives, decoded,
    and handed to the engine's step sink. While `max_steps_waiting` steps handed on have
    publish tasks not yet done, reading pauses (the frames already read wait here), so
    the pipe fills and the child waits: the engine steps no faster than the worker
    publishes."""

    def __init__(self, engine: EngineProcess):
        self.engine = engine
        self.transport: asyncio.ReadTransport | None = None
        self.buffer = bytearray()
        self.waiting = 0  # steps handed on whose publish task is not done
        # Our own flag, not transport.is_reading(): the pipe transport of Python 3.11.2
        # (Debian 12's, in our image) lacks it and raises NotImplementedError, which
        # stalled the worker's steps (caught by the compose smoke test, not by 3.11.7).
        self.paused = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._hand_on_or_fail()

    def connection_lost(self, exc) -> None:
        self.engine._child_gone()

    def _hand_on_or_fail(self) -> None:
        """`_hand_on`; if that raises (a bug: the child's frames are our own, never a
        client's), the engine fails with the reason and reading ends. Otherwise asyncio
        would only log the exception from this loop callback, and a reader that raised
        while paused never resumes: the worker's steps stall while it looks healthy (a
        transport method missing on Python 3.11.2 did exactly that once)."""
        try:
            self._hand_on()
        except Exception as exc:
            log.exception("reading the engine's steps failed")
            self.buffer.clear()
            self.engine._fail(RuntimeError(f"reading the engine's steps failed: {type(exc).__name__}: {exc}"))
            self.transport.close()

    def _hand_on(self) -> None:
        """Every whole frame in the buffer, while there is room; then pause or resume."""
        buffer, start, limit = self.buffer, 0, self.engine.max_steps_waiting
        while self.waiting < limit and len(buffer) - start >= LENGTH_BYTES:
            end = start + LENGTH_BYTES + int.from_bytes(buffer[start:start + LENGTH_BYTES], "big")
            if len(buffer) < end:
                break
            message = decode_from_child(buffer[start + LENGTH_BYTES:end])
            start = end
            if isinstance(message, Step):
                published = self.engine._step_sink(message.outputs, message.step_s)
                if published is not None:
                    self.waiting += 1
                    published.add_done_callback(self._published)
            elif isinstance(message, Failed):  # the child's last message: nothing more is read
                buffer.clear()
                self.engine._fail(RuntimeError(f"engine failed: {message.error}"))
                self.transport.close()
                return
        del buffer[:start]
        if self.waiting >= limit:
            if not self.paused:
                self.paused = True
                self.transport.pause_reading()
        elif self.paused and not self.transport.is_closing():
            self.paused = False
            self.transport.resume_reading()

    def _published(self, _) -> None:
        self.waiting -= 1
        if self.paused and self.waiting < self.engine.max_steps_waiting:
            self._hand_on_or_fail()  # the frames read before the pause first
