"""The engine in a child process: model steps never share a GIL with the Kafka loop.

In one process the engine thread and the event loop take turns on the GIL; publishing a
step's chunks (building records, aiokafka's batching and acks) then costs the engine a
large share of its tokens/s — measured 28% on the tiny model, while the same publishing
from another process cost it nothing (BENCHMARKS.md, engine (c)). So by default the
worker runs the engine and its stepping thread (`EngineThread`) in a child process,
like vLLM v1's engine core, and talks to it through a pipe:

    parent → child   Add(request) | Abort(request_id, reason) | Stop()
    child → parent   Ready(limits) | Step(outputs, step_s) | Failed(error)

`EngineProcess` has EngineThread's interface (add/abort/stop/failure), so the worker
does not know which one it drives. Requests are validated in the parent against the
limits the child reports, so an invalid request still raises at `add()` and gets its
error chunk. The child ignores SIGINT/SIGTERM (the worker decides when the engine stops:
it drains first) and exits when the worker goes away (end of file on its pipe).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import threading
from typing import Any

import msgspec

from schemas.errors import ValidationError
from schemas.records import GenerateRequest
from schemas.validation import validate_request
from workers.generate.engine_thread import Deliver, EngineThread, engine_limits
from workers.generate.outputs import RequestOutput

log = logging.getLogger(__name__)


# --- the messages on the pipe (msgspec msgpack; tagged, so each says what it is) -------
#
# Not pickle: a step of a batch-256 engine is 256 RequestOutputs, and pickling msgspec
# structs cost ~5.7 µs per output (encode + decode) where msgspec's own codec costs ~0.9
# (BENCHMARKS.md, "Throughput": the engine child's CPU per token).

class Add(msgspec.Struct, tag=True):
    request: GenerateRequest


class Abort(msgspec.Struct, tag=True):
    request_id: str
    reason: str


class Stop(msgspec.Struct, tag=True):
    pass


class Ready(msgspec.Struct, tag=True):
    limits: dict[str, int]  # validate_request's keyword arguments: the parent checks requests


class Step(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]  # the engine's outputs of one step
    step_s: float


class Failed(msgspec.Struct, tag=True):
    error: str


_encode = msgspec.msgpack.Encoder().encode
_decode_to_child = msgspec.msgpack.Decoder(Add | Abort | Stop).decode
_decode_from_child = msgspec.msgpack.Decoder(Ready | Step | Failed).decode


class EngineProcess:
    def __init__(self, engine_options: dict[str, Any], deliver: Deliver, *, min_step_s: float = 0.0,
                 threads: int = 0, start_timeout_s: float = 600.0):
        self.engine_options = engine_options  # Engine(**engine_options) in the child
        self.min_step_s = min_step_s
        self.threads = threads
        self.start_timeout_s = start_timeout_s
        self.failure: BaseException | None = None
        self.limits: dict[str, int] = {}
        self._deliver = deliver
        self._conn = None
        self._process = None
        self._reader: threading.Thread | None = None
        self._send_lock = threading.Lock()
        self._stopping = False

    def start(self) -> None:
        """Start the child and wait until its model is loaded (blocking: call it off the loop)."""
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads/CUDA
        self._conn, child_end = context.Pipe()
        self._process = context.Process(
            target=_child_main, args=(child_end, self.engine_options, self.min_step_s, self.threads),
            name="genpipe-engine", daemon=True)
        self._process.start()
        child_end.close()  # the child's copy is the only one left: its exit means EOF here
        if not self._conn.poll(self.start_timeout_s):
            self._process.kill()
            raise RuntimeError(f"the engine process did not load its model within {self.start_timeout_s:.0f} s")
        try:
            message = _decode_from_child(self._conn.recv_bytes())
        except EOFError:
            self._process.join(5)
            raise RuntimeError(f"the engine process exited while starting (exit code {self._process.exitcode})") from None
        if not isinstance(message, Ready):
            self._process.join(5)
            raise RuntimeError(f"the engine process failed to start: {getattr(message, 'error', message)}")
        self.limits = message.limits
        self._reader = threading.Thread(target=self._read, name="genpipe-engine-reader", daemon=True)
        self._reader.start()

    def validate(self, request) -> None:
        """Raises schemas ValidationError for a request the engine would refuse."""
        validate_request(request, **self.limits)

    def add(self, request) -> None:
        """Validate here (raises schemas ValidationError) and queue it in the child."""
        self.validate(request)
        self._send(Add(request))

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self._send(Abort(request_id, reason))

    def stop(self, timeout: float = 10.0) -> None:
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
        self._conn.close()

    def _send(self, message: Add | Abort | Stop) -> None:
        try:
            with self._send_lock:  # the loop and stop() may both send
                self._conn.send_bytes(_encode(message))
        except (OSError, ValueError) as exc:  # broken pipe / closed: the child is gone
            raise RuntimeError(f"the engine process is gone: {exc}") from exc

    def _read(self) -> None:
        """Reader thread: hand every step to `deliver`; notice the child failing or dying."""
        while True:
            try:
                message = _decode_from_child(self._conn.recv_bytes())
            except (EOFError, OSError):
                if not self._stopping:
                    self._process.join(5)  # reap it, so the exit code is known (EOF can come first)
                    self._fail(RuntimeError(f"the engine process exited (exit code {self._process.exitcode})"))
                return
            if isinstance(message, Step):
                self._deliver(message.outputs, message.step_s)
            elif isinstance(message, Failed):
                self._fail(RuntimeError(f"engine failed: {message.error}"))
                return

    def _fail(self, exc: BaseException) -> None:
        log.error("%s", exc)
        self.failure = exc
        self._deliver([], 0.0)


def make_engine(options: dict[str, Any]):
    """The engine `options` describe: `Engine(**options)`, or with a "synthetic" entry the
    benchmarking `SyntheticEngine(**options["synthetic"])` (no model)."""
    if "synthetic" in options:
        from workers.generate.synthetic import SyntheticEngine

        return SyntheticEngine(**options["synthetic"])
    from workers.generate.engine import Engine

    return Engine(**options)


class Outbox:
    """The child's messages to the worker, sent by a thread of their own, so the engine
    steps on while a step's outputs are encoded and written: a pipe holds 64 KB, a
    batch-256 step at k=20 is ~72 KB, and the write waits for the worker's reader thread
    (which waits for its process's GIL). A GPU engine overlaps that with its next step;
    with the synthetic one's 2 ms steps the generate stage ran 1.07x faster at k=0 and
    1.24x at k=5 this way (BENCHMARKS.md, "Each stage alone").
    At most `depth` messages wait: past that the engine waits too, as it did on the
    pipe, so a worker that falls behind still slows the engine instead of growing
    this queue."""

    def __init__(self, conn, depth: int = 4):
        self._conn = conn
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, name="genpipe-engine-outbox", daemon=True)
        self._thread.start()

    def put(self, message: Step | Failed) -> None:
        while self._thread.is_alive():  # (gone once the worker is: nothing to send to)
            try:
                self._queue.put(message, timeout=0.1)
                return
            except queue.Full:
                continue

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

    def _run(self) -> None:
        try:
            while (message := self._queue.get()) is not None:
                self._conn.send_bytes(_encode(message))
        except (OSError, ValueError):
            pass  # the worker is gone (a broken pipe): the main loop sees EOF and stops us


def _child_main(conn, engine_options: dict[str, Any], min_step_s: float, threads: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C / SIGTERM reach the whole process
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # group; the worker drains, then stops us
    import torch
    from transformers.utils import logging as hf_logging

    if threads:
        torch.set_num_threads(threads)
    # No tqdm bar in a worker's log; and a bar's lock is a multiprocessing semaphore that
    # the exit below would leave for the resource tracker to report as leaked.
    hf_logging.disable_progress_bar()
    try:
        engine = make_engine(engine_options)
    except BaseException as exc:
        conn.send_bytes(_encode(Failed(f"{type(exc).__name__}: {exc}")))
        return
    conn.send_bytes(_encode(Ready(engine_limits(engine))))
    outbox = Outbox(conn)

    def deliver(outputs: list, step_s: float) -> None:
        if thread.failure is not None:
            outbox.put(Failed(f"{type(thread.failure).__name__}: {thread.failure}"))
        elif outputs:
            outbox.put(Step(outputs, step_s))

    thread = EngineThread(engine, deliver, min_step_s=min_step_s)
    thread.start()
    try:
        while thread.failure is None:
            message = _decode_to_child(conn.recv_bytes())
            if isinstance(message, Add):
                try:
                    thread.add(message.request)
                except ValidationError as exc:  # validated by the parent already: a duplicate id
                    log.warning("engine refused %s: %s", message.request.request_id, exc)
            elif isinstance(message, Abort):
                thread.abort(message.request_id, message.reason)
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
