"""Running a worker process: producer, consumer loop, signals, clean exit.

Both workers call `serve()` with their handler factory; everything Kafka-shaped about a
process's life (start order, SIGTERM/SIGINT → graceful drain, flush, final commit, stop
order) lives here once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Awaitable, Callable, Sequence

from workers.broker.topics import record_limit_problems
from workers.kafka.clients import MAX_BATCH_BYTES, KafkaUnreachable, make_producer, start_client, stop_producer
from workers.kafka.loop import ConsumerLoop, Handler
from workers.kafka.offsets import PartitionOffsets
from workers.kafka.publisher import MAX_RECORD_BYTES, SHUTDOWN_WAIT_S, Publisher, request_size_for
from workers.kafka.settings import KafkaSettings
from workers.startup import StartupError, one_line

log = logging.getLogger(__name__)

HandlerFactory = Callable[[Publisher, PartitionOffsets], Handler]


async def serve(settings: KafkaSettings, *, topic: str | Sequence[str], group_id: str, make_handler: HandlerFactory,
                stop: asyncio.Event | None = None, grace_s: float = 30.0,
                background: Callable[[asyncio.Event], list[Awaitable]] | None = None,
                producer_overrides: dict | None = None, loop_options: dict | None = None,
                on_ready: Callable[[], None] | None = None, worker: str = "worker",
                max_record_bytes: int = MAX_RECORD_BYTES, uses: Sequence[str] = (),
                writes: Sequence[str] = ()) -> int:
    """Run one worker until `stop` is set; return an exit code.

    `topic`: the topic (or topics) the worker consumes. `uses`: the topics it writes or
    follows besides those (checked at start,
    like `topic` and the DLQ). `writes`: those of `uses` its large records go to (chunks,
    results): checked at start, with the DLQ, to take records of `max_record_bytes`. Without a `stop` event the worker owns the process: SIGTERM/SIGINT set its own. With
    one (several workers in one process, tests), the caller decides when to stop.
    """
    loop = asyncio.get_running_loop()
    installed = []
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, stop.set)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread: nothing to install

    # The producer's own request limit must not refuse what `max_record_bytes` allows.
    overrides = {"max_request_size": request_size_for(max_record_bytes), **(producer_overrides or {})}
    producer = make_producer(settings, **overrides)
    try:
        await start_client(producer, settings)
    except KafkaUnreachable as exc:
        raise StartupError(one_line(exc)) from exc
    publisher = Publisher(producer, settings.topic("dlq"), max_record_bytes)
    # The deployment's own topics must exist: a worker that finds one missing only when it
    # first publishes there would stop mid-work; say it now, in one line.
    consumed = [topic] if isinstance(topic, str) else list(topic)
    needed = dict.fromkeys([*consumed, *uses, settings.topic("dlq")])
    missing = [t for t in needed if not await publisher.partition_count(t)]
    if missing:
        await producer.stop()
        raise StartupError(f"topic{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                           f"{'do' if len(missing) > 1 else 'does'} not exist on {settings.bootstrap_servers} "
                           f"(or this worker may not see {'them' if len(missing) > 1 else 'it'}): create them with "
                           f"`genpipe topics create --topic-prefix {settings.topic_prefix}`")
    problems = _record_limit_problems(publisher, [*writes, settings.topic("dlq")], max_record_bytes)
    if problems:
        await producer.stop()
        raise StartupError("; ".join(problems))
    offsets = PartitionOffsets()
    consumer_loop = ConsumerLoop(settings, consumed, group_id, make_handler(publisher, offsets), offsets,
                                 worker=worker, **(loop_options or {}))
    tasks = [asyncio.ensure_future(t) for t in (background(stop) if background else [])]
    failures: list[BaseException] = []

    def watch(task: asyncio.Future) -> None:
        # A background task (the generate worker's cancel follower) that dies would leave
        # the worker running half-blind (cancels ignored): stop it, exit non-zero, so a
        # supervisor restarts it.
        if task.cancelled() or task.exception() is None:
            return
        log.error("%s worker: background task failed, stopping: %r", worker, task.exception())
        failures.append(task.exception())
        stop.set()

    for task in tasks:
        task.add_done_callback(watch)
    ready_task = None
    if on_ready is not None:
        async def announce():
            await consumer_loop.ready.wait()
            on_ready()
        ready_task = asyncio.ensure_future(announce())
    try:
        await consumer_loop.run(stop, grace_s=grace_s)
        await publisher.flush_at_shutdown()
        return 1 if failures else 0
    finally:
        stop.set()
        for task in tasks + ([ready_task] if ready_task else []):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # (what a stuck flush left was not committed: Publisher.flush_at_shutdown)
        await stop_producer(producer, 1.0 if publisher.stuck else SHUTDOWN_WAIT_S, f"{worker} worker")
        for sig in installed:
            loop.remove_signal_handler(sig)


def _record_limit_problems(publisher: Publisher, topics: list[str], max_record_bytes: int) -> list[str]:
    """The topics of `topics` whose `max.message.bytes` refuses what this worker writes
    there (workers/broker/topics.py `record_limit_problems`), from the limits the publisher
    read when it looked the topics up (workers/kafka/topic_metadata.py). A topic whose
    limit could not be read (the worker may not describe it: a deployment's ACLs need not
    allow it) is not checked, and the log says so."""
    limits = {topic: publisher.topics.limits[topic] for topic in topics if topic in publisher.topics.limits}
    unread = [topic for topic in topics if topic not in limits]
    if unread:
        log.info("record limits of %s not checked (this worker may not describe them)", ", ".join(unread))
    return record_limit_problems(limits, max_record_bytes, MAX_BATCH_BYTES)
