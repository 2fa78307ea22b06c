"""The engine in a child process: model steps never share a GIL with the Kafka loop.

In one process the engine thread and the event loop take turns on the GIL; publishing a
step's chunks (building records, aiokafka's batching and acks) then costs the engine a
large share of its tokens/s — measured 28% on the tiny model, while the same publishing
from another process cost it nothing (BENCHMARKS.md, engine (c)). So by default the
worker runs the engine and its stepping thread (`EngineThread`) in a child process,
like vLLM v1's engine core, and talks to it through two one-way pipes:

    parent → child   Add(request) | Abort(request_id, reason) | Tune(lagging, stretch) | Stop()
    child → parent   Ready(limits) | Step(outputs, step_s) | Failed(error)

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
import os
import queue
import signal
import threading
import time
from typing import Any, Callable

import msgspec

from schemas.errors import ValidationError
from schemas.records import GenerateRequest
from schemas.validation import validate_request
from workers.generate.chunks import ChunkPolicy
from workers.generate.engine_thread import EngineThread, engine_limits
from workers.generate.logprob_entries import encode_pending
from workers.generate.outputs import StepOutputs
from workers.generate.token_holder import TokenHolder

log = logging.getLogger(__name__)


# --- the messages on the pipe (msgspec msgpack; tagged, so each says what it is) -------
#
# Not pickle: a step of a batch-256 engine is 256 outputs, and pickling msgspec
# structs cost ~5.7 µs per output (encode + decode) where msgspec's own codec costs ~0.9
# (BENCHMARKS.md, "Throughput": the engine child's CPU per token).

class Add(msgspec.Struct, tag=True):
    request: GenerateRequest


class Abort(msgspec.Struct, tag=True):
    request_id: str
    reason: str


class Tune(msgspec.Struct, tag=True):
    """The worker's state that the chunk policy reads (workers/generate/token_holder.py)."""

    lagging: bool
    stretch: float


class Stop(msgspec.Struct, tag=True):
    pass


class Ready(msgspec.Struct, tag=True):
    limits: dict[str, int]  # validate_request's keyword arguments: the parent checks requests


class Step(msgspec.Struct, tag=True):
    outputs: StepOutputs  # the engine's outputs of one step, column-wise (outputs.py)
    step_s: float


class Failed(msgspec.Struct, tag=True):
    error: str


# enc_hook: a step's logprob entries are encoded here, in the outbox thread, the whole
# step at once (workers/generate/logprob_wire.py StepEntries), not inside the step.
_encode = msgspec.msgpack.Encoder(enc_hook=encode_pending).encode
_decode_to_child = msgspec.msgpack.Decoder(Add | Abort | Tune | Stop).decode
_decode_from_child = msgspec.msgpack.Decoder(Ready | Step | Failed).decode

# The child's messages are framed here, not by multiprocessing (whose framing is its
# own business): a 4-byte big-endian length, then the msgpack bytes. The parent's
# commands go through multiprocessing's send_bytes/recv_bytes on the other pipe.
_LENGTH = 4


def write_frame(conn, payload: bytes) -> None:
    """One message to the worker (blocking; raises OSError once the worker is gone)."""
    data = memoryview(len(payload).to_bytes(_LENGTH, "big") + payload)
    fd = conn.fileno()
    while data:
        data = data[os.write(fd, data):]


def read_frame(conn) -> bytes:
    """One message from the child (blocking; raises EOFError at end of file)."""
    header = _read_exactly(conn.fileno(), _LENGTH)
    return _read_exactly(conn.fileno(), int.from_bytes(header, "big"))


def _read_exactly(fd: int, size: int) -> bytes:
    parts, left = [], size
    while left:
        part = os.read(fd, left)
        if not part:
            raise EOFError("the engine process closed its pipe")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


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
            target=_child_main, args=(child_commands, child_steps, self.engine_options, self.min_step_s,
                                      self.threads, self.policy),
            name="genpipe-engine", daemon=True)
        self._process.start()
        child_commands.close()  # the child's copies are the only ones left: its exit means EOF here
        child_steps.close()
        if not self._steps.poll(self.start_timeout_s):
            self._process.kill()
            raise RuntimeError(f"the engine process did not load its model within {self.start_timeout_s:.0f} s")
        try:
            message = _decode_from_child(read_frame(self._steps))
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

    def add(self, request, *, validated: bool = False) -> None:
        """Validate here (raises schemas ValidationError; skipped when the caller has:
        `validated`) and queue it in the child, which does not validate it again."""
        if not validated:
            self.validate(request)
        self._send(Add(request))

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
                self._commands.send_bytes(_encode(message))
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
        while self.waiting < limit and len(buffer) - start >= _LENGTH:
            end = start + _LENGTH + int.from_bytes(buffer[start:start + _LENGTH], "big")
            if len(buffer) < end:
                break
            message = _decode_from_child(buffer[start + _LENGTH:end])
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


def make_engine(options: dict[str, Any]):
    """The engine `options` describe: `Engine(**options)`, or with a "synthetic" entry the
    benchmarking `SyntheticEngine(**options["synthetic"])` (no model)."""
    if "synthetic" in options:
        from workers.generate.synthetic import SyntheticEngine

        return SyntheticEngine(**options["synthetic"])
    from workers.generate.engine import Engine

    return Engine(**options)


# How often the outbox looks for held tokens that fell due while no step came (their
# lateness at most): steps faster than this carry them out themselves.
RELEASE_TICK_S = 0.005
_WAKE = object()  # (in the outbox's queue: tokens are held now, so wait with the tick)


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
        if self.holder is None or not isinstance(message, Step):
            self._write(_encode(message))
            return
        with self._holding:
            outputs = self.holder.step(message.outputs, time.monotonic())
            if outputs or outputs.batch:  # (a step that hands on nothing still carries its metrics)
                self._write(_encode(Step(outputs, message.step_s)))
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
                self._write(_encode(Step(due, 0.0)))

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


def _child_main(commands, steps, engine_options: dict[str, Any], min_step_s: float, threads: int,
                policy: ChunkPolicy | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C / SIGTERM reach the whole process
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # group; the worker drains, then stops us
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
        write_frame(steps, _encode(Failed(f"{type(exc).__name__}: {exc}")))
        return
    # Start-up (torch, transformers, the model) is over: as the worker does once it is up
    # (workers/gc_tuning.py). Left out, the child's full collections rescanned all of it
    # while serving: 150-200 ms each, the engine thread stalled, twice in one k=5
    # throughput run (BENCHMARKS.md, "The collector's young threshold").
    tune_after_startup()
    write_frame(steps, _encode(Ready(engine_limits(engine))))
    outbox = Outbox(steps, holder=TokenHolder(policy) if policy is not None else None, on_failure=_exit_failed)

    def deliver(outputs: list, step_s: float) -> None:
        if thread.failure is not None:
            outbox.put(Failed(f"{type(thread.failure).__name__}: {thread.failure}"))
        elif outputs:
            outbox.put(Step(outputs, step_s))

    thread = EngineThread(engine, deliver, min_step_s=min_step_s)  # (tokens are held in the outbox)
    thread.start()
    try:
        while thread.failure is None:
            message = _decode_to_child(commands.recv_bytes())
            if isinstance(message, Add):
                try:
                    thread.add(message.request, validated=True)  # by the parent, against our limits
                except ValidationError as exc:  # a duplicate id
                    log.warning("engine refused %s: %s", message.request.request_id, exc)
            elif isinstance(message, Abort):
                thread.abort(message.request_id, message.reason)
            elif isinstance(message, Tune):
                if outbox.holder is not None:
                    outbox.holder.tune(message.lagging, message.stretch)
            else:
                break
    except (EOFError, OSError):
        pass  # the worker is gone: so are we
    finally:
        thread.stop()
        outbox.close()  # what the last steps made goes out before we exit
    # Skip the interpreter's teardown: its collections over every object torch and
    # transformers made kept a core busy for ~2 s after each stop (measured), and the
    # worker waits for us. Nothing is left to clean up: the engine thread has stopped,
    # the OS frees the rest.
    logging.shutdown()
    os._exit(0)
