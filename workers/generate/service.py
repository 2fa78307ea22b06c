"""Wiring one generate worker: engine (in a child process or a thread) + cancel follower + loop."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from schemas import Cancel, RecordError
from workers.generate.admission import WaitingQueue
from workers.generate.engine_process import EngineProcess
from workers.generate.engine_thread import EngineThread, make_engine
from workers.generate.logprob_entries import resolve_pending
from workers.generate.outputs import StepOutputs
from workers.generate.stall import ENGINE_STALL_S, StallWatch
from workers.generate.chunks import W, ChunkPolicy
from workers.generate.worker import GenerateHandler
from workers.kafka.follow import follow
from workers.kafka.records import decode_message
from schemas.validation import DEFAULT_MAX_LOGPROBS
from workers.kafka.publisher import MAX_RECORD_BYTES
from workers.kafka.reply_topics import reply_topic_rule
from workers.kafka.runtime import serve
from workers.kafka.settings import KafkaSettings
from workers.log_digest import LogDigest
from workers.metrics import BATCH_SIZE, INTER_TOKEN, STEP_TIME, HistogramBatch, series
from workers.startup import StartupError, one_line

log = logging.getLogger(__name__)


@dataclass
class GenerateWorkerConfig:
    model: str | None = None  # None: the built-in tiny spm model
    device: str = "cpu"
    dtype: str = "float32"
    max_batch: int = 32
    max_model_len: int | None = None
    prefill_chunk: int = 512
    cuda_graphs: str = "auto"  # Engine(decode_graphs=): "auto" or "off"
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    group_id: str = "genpipe-generate"
    grace_s: float = 30.0
    commit_interval_s: float = 0.5
    cancel_lookback_s: float = 300.0  # cancels this old still stop a request that arrives late
    policy: ChunkPolicy = field(default_factory=ChunkPolicy)
    min_step_s: float = 0.0  # pace engine steps (simulates a bigger model; see EngineThread)
    engine_in: str = "process"  # "process": a child process (see engine_process); "thread": this one
    threads: int = 0  # torch CPU threads of the engine (0: torch's default)
    max_record_bytes: int = MAX_RECORD_BYTES  # largest chunk record published (see publisher)
    engine: str = "model"  # or "synthetic": no model, `synthetic_step_s` a step (benchmarks only)
    synthetic_step_s: float = 0.002
    synthetic_tokens: str = "hash"  # or "prompt": the prompt's ids repeated (workers/generate/synthetic.py)
    reply_topic_pattern: str | None = None  # None: workers.kafka.reply_topics.DEFAULT_PATTERN
    queue_requests: int = 1024  # read-ahead queue of requests not yet started (admission.py)
    queue_tokens: int = 1_000_000  # ... and of their prompt tokens
    group_instance_id: str | None = None  # static membership (docs/design.md §7)
    assignor: str = "sticky"  # or "roundrobin": aiokafka's default, nothing kept (benchmark reference)
    engine_stall_s: float = ENGINE_STALL_S  # no step this long with requests in the engine: stuck (stall.py); 0 off

    @property
    def engine_slots(self) -> int:
        """Requests handed to the engine at once: a batch plus a little headroom, so a
        freed row is refilled at the next step while the best waiting requests stay in
        the worker's priority queue (the engine itself runs its queue in arrival order)."""
        return self.max_batch + max(1, self.max_batch // 4)

    @property
    def bulk_limit(self) -> int:
        """Bulk requests in the engine at most: 1/16 of the rows (at least one) stay free for
        interactive requests (docs/design.md §4, "Scheduling")."""
        return max(1, self.max_batch - max(1, self.max_batch // 16))


def engine_options(config: GenerateWorkerConfig) -> dict:
    """make_engine(options): the same engine whether it is built here or in the child."""
    from workers.models.tinymodel import default_model_dir

    if config.engine == "synthetic":  # the tiny model's vocabulary, so its tokenizer derenders it
        return {"synthetic": dict(step_s=config.synthetic_step_s, max_batch=config.max_batch,
                                  vocab_size=_vocab_size(config.model or str(default_model_dir("spm"))),
                                  max_model_len=config.max_model_len or 2048, max_logprobs=config.max_logprobs,
                                  tokens=config.synthetic_tokens)}

    return dict(model_dir=config.model or str(default_model_dir("spm")), device=config.device,
                dtype=config.dtype, max_batch=config.max_batch, max_model_len=config.max_model_len,
                prefill_chunk=config.prefill_chunk, max_logprobs=config.max_logprobs,
                decode_graphs=config.cuda_graphs)


def load_engine(config: GenerateWorkerConfig):
    return make_engine(engine_options(config))


def _vocab_size(model_dir: str) -> int:
    import json
    from pathlib import Path

    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


class EngineOutputs:
    """Carries engine steps to the handler on the event loop. The engine is built first
    (it needs the callback), the handler later (it needs the engine): this is the one
    link between them.

    At most `max_steps_waiting` steps are between the engine and the end of their publish
    step; past that the engine waits. An engine process's steps are read on the loop
    (`on_step`), whose reader pauses (workers/generate/engine_process.py); an engine
    thread in this process hands them over in `deliver`, which waits. Without the bound
    an event loop that falls behind (a saturated host, a slow broker) kept every step in
    its ready queue: chunk ages of 0.4-3.3 s at p99 measured at k=5 on 2 cores, with
    memory to match, and the loop's heartbeats and fetches waiting behind them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_steps_waiting: int = 4,
                 stall_s: float = ENGINE_STALL_S):
        self.loop = loop
        self.max_steps_waiting = max_steps_waiting
        self.stall = StallWatch(stall_s)  # every step counts as the engine's progress (stall.py)
        self.engine = None
        self.handler: GenerateHandler | None = None
        self.metrics = StepMetrics(loop)
        self._room = threading.BoundedSemaphore(max_steps_waiting)

    def on_step(self, outputs: StepOutputs, step_s: float) -> asyncio.Future | None:
        """On the loop: one step to the handler; returns its publish step (None: none)."""
        self.stall.stepped()
        self.metrics.observe(outputs, step_s)
        return self._publish(outputs)

    def deliver(self, outputs: StepOutputs, step_s: float) -> None:
        """On an engine thread of this process: waits for room, then hands the step over."""
        self.stall.stepped()
        if outputs or self.engine.failure is not None:
            while not self._room.acquire(timeout=0.5):
                if self.loop.is_closed():
                    return  # the worker has stopped: nobody will take these
            self.loop.call_soon_threadsafe(self._on_loop, outputs, step_s)
        elif step_s and not self.loop.is_closed():  # (a step that handed on nothing: its figures still count)
            try:
                self.loop.call_soon_threadsafe(self.metrics.observe, outputs, step_s)
            except RuntimeError:
                pass  # the loop closed meanwhile: the worker has stopped

    def _on_loop(self, outputs: StepOutputs, step_s: float) -> None:
        self.metrics.observe(outputs, step_s)
        published = self._publish(outputs)
        if published is None:
            self._room.release()
        else:
            published.add_done_callback(lambda _: self._room.release())

    def _publish(self, outputs: StepOutputs) -> asyncio.Future | None:
        if self.handler is None:  # (a failure can come before the first request)
            return None
        if not outputs and self.engine.failure is None:
            return None
        return self.handler.on_outputs(outputs)


class StepMetrics:
    """Each engine step's figures for the metrics endpoint (its time, its batch, the
    longest gap between a request's tokens), observed on the loop and added to the
    histograms at most every FLUSH_S (HistogramBatch): three Histogram.observe calls a
    step, each walking its buckets under locks, were 3.5% of a generate worker's py-spy
    samples at batch 256 (1.6% batched: BENCHMARKS.md, "A broker away, and a step's
    metrics in batches"). A scrape sees a step at most FLUSH_S late; `flush` at shutdown."""

    FLUSH_S = 0.25

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.step_time = HistogramBatch(series(STEP_TIME, W))
        self.batch_size = HistogramBatch(series(BATCH_SIZE, W))
        self.inter_token = HistogramBatch(series(INTER_TOKEN, W))
        self._due: asyncio.TimerHandle | None = None  # the next flush, while observations wait

    def observe(self, outputs: StepOutputs, step_s: float) -> None:
        if not step_s:  # tokens the holder handed on between steps: no step
            return
        self.step_time.observe(step_s)
        self.batch_size.observe(outputs.batch or len(outputs))  # (batch: the holder's; it hands on fewer)
        if outputs.gap_s:
            self.inter_token.observe(outputs.gap_s)
        if self._due is None:
            self._due = self.loop.call_later(self.FLUSH_S, self.flush)

    def flush(self) -> None:
        if self._due is not None:
            self._due.cancel()
            self._due = None
        self.step_time.flush()
        self.batch_size.flush()
        self.inter_token.flush()


async def run_generate_worker(settings: KafkaSettings, config: GenerateWorkerConfig, *, engine=None,
                              stop: asyncio.Event | None = None,
                              on_ready: Callable[[], None] | None = None) -> int:
    """Serve until stopped. `engine`: an Engine already built (it then steps in a thread
    of this process); otherwise one is loaded from `config`, in a child process unless
    config.engine_in is "thread"."""
    rule = reply_topic_rule(settings.topic_prefix, config.reply_topic_pattern)  # a bad pattern fails before the model loads
    outputs = EngineOutputs(asyncio.get_running_loop(), stall_s=config.engine_stall_s)
    if engine is None and config.engine_in == "process":
        outputs.engine = EngineProcess(engine_options(config), outputs.on_step, min_step_s=config.min_step_s,
                                       threads=config.threads, max_steps_waiting=outputs.max_steps_waiting,
                                       policy=config.policy)
        try:
            await asyncio.to_thread(outputs.engine.start)  # loads the model; the loop stays free
        except RuntimeError as exc:
            raise StartupError(f"cannot load the model {config.model or '(built-in tiny)'}: {one_line(exc)}") from exc
        await outputs.engine.read_steps()
    else:
        if engine is None:
            try:
                engine = load_engine(config)
            except Exception as exc:
                raise StartupError(f"cannot load the model {config.model or '(built-in tiny)'}: "
                                   f"{type(exc).__name__}: {one_line(exc)}") from exc
        def deliver(step: list, step_s: float) -> None:
            resolve_pending(step)  # the logprob entries as bytes, on the engine thread: no pipe encodes them
            outputs.deliver(step, step_s)

        outputs.engine = EngineThread(engine, deliver, min_step_s=config.min_step_s, policy=config.policy)
        outputs.engine.start()  # idle until the first request arrives

    def make_handler(publisher, offsets):
        outputs.handler = GenerateHandler(settings, publisher, offsets, outputs.engine,
                                          max_running=config.engine_slots, policy=config.policy,
                                          reply_rule=rule,
                                          waiting=WaitingQueue(config.queue_requests, config.queue_tokens),
                                          bulk_limit=config.bulk_limit, stall=outputs.stall)
        return outputs.handler

    unreadable_cancels = LogDigest(log, logging.WARNING, "unreadable cancels")  # (clients write that topic)

    def on_cancel(message) -> None:
        try:
            cancel = decode_message(message, Cancel)
        except RecordError as exc:  # every worker reads this topic: log, don't DLQ n copies
            unreadable_cancels.log("unreadable cancel at %s[%d]@%d: %s", message.topic, message.partition,
                                   message.offset, exc)
            return
        outputs.handler.cancel(cancel.request_id)

    def background(stop_event):
        since = int((time.time() - config.cancel_lookback_s) * 1000)
        return [follow(settings, settings.topic("cancel"), on_cancel, stop_event, since_ms=since)]

    try:
        return await serve(settings, topic=[settings.topic("requests"), settings.topic("requests.bulk")],
                           group_id=config.group_id,
                           make_handler=make_handler, stop=stop, grace_s=config.grace_s,
                           background=background, on_ready=on_ready, worker=W,
                           loop_options={"commit_interval_s": config.commit_interval_s,
                                         "group_instance_id": config.group_instance_id,
                                         "assignor": config.assignor},
                           max_record_bytes=config.max_record_bytes,
                           uses=[settings.topic("chunks"), settings.topic("cancel")],
                           writes=[settings.topic("chunks")])
    finally:
        outputs.engine.stop()
        outputs.metrics.flush()
        unreadable_cancels.flush()
