"""`genpipe replay`: re-derender a range of the chunk log into a topic or a file.

The chunk topic is the durable log of everything the model sampled (docs/design.md §6):
a fresh derenderer fed a range of it reproduces the workers' results record for record,
by the same rules (`within_record_limit` included). It reads through the shared
group-less follower (workers/kafka/follow.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import time
from collections import Counter

from workers.cli_options import quiet_kafka_logs, resolve_topic, stdout_gone, topic_arg
from workers.derender.chunk_rules import unanswerable_id
from workers.derender.commands import add_derender_options, add_stalled_request_option
from workers.kafka.settings import KafkaSettings
from workers.startup import one_line

_REPLAY_EPILOG = """\
The chunk topic is the durable log of everything the model sampled; replaying a range
of it through a fresh derenderer reproduces the results record for record (values and
headers), e.g. after a derender bug fix or to fill a new topic:

  genpipe topics create --topic genpipe.results-v2    # the target topic, once
  genpipe replay --from 0 --to-topic genpipe.results-v2
  genpipe replay --from 2025-01-31T12:00:00Z --out results.jsonl

--from OFFSET applies to every partition (clipped to the oldest retained offset);
--from ISO-TIME starts each partition at its first record at or after that time. The
range ends at --to OFFSET (exclusive) or at the end offsets seen when the replay starts.
Requests whose first chunk (seq 0) lies before the range cannot be rebuilt and are
skipped and reported on stderr. Cancels (stop strings) are not sent.
The --out lines have the format of `genpipe derender --out`.
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "replay",
        help="re-derender a range of the chunk topic into a topic or a file",
        description="Re-derender a range of the chunk topic (every partition) with a fresh "
                    "derenderer and write the results to a topic or a JSON-lines file.",
        epilog=_REPLAY_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--from", dest="start", required=True, metavar="OFFSET|ISO-TIME",
                   help="first offset (every partition) or a time such as 2025-01-31T12:00:00Z")
    p.add_argument("--to", dest="end", type=int, default=None, metavar="OFFSET",
                   help="stop before this offset in every partition (default: the end offsets "
                        "when the replay starts)")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--to-topic", type=topic_arg, metavar="TOPIC",
                        help="publish the results to this (existing) topic")
    target.add_argument("--out", metavar="FILE", help="write the results as JSON lines; - for stdout")
    p.add_argument("--chunks-topic", type=topic_arg, default=None, metavar="TOPIC",
                   help="topic to read (default: <prefix>.chunks)")
    add_derender_options(p)
    add_stalled_request_option(p)
    KafkaSettings.add_arguments(p)
    p.set_defaults(func=run_replay)


def parse_start(value: str) -> tuple[str, int]:
    """`--from`: ("offset", n) or ("time", epoch ms)."""
    from datetime import datetime

    text = value.strip()
    try:
        offset = int(text)
    except ValueError:
        pass
    else:
        if offset < 0:
            raise ValueError(f"--from offset must be >= 0, got {offset}")
        return "offset", offset
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith("Z") else text)
    except ValueError:
        raise ValueError(f"--from must be an offset or an ISO time such as 2025-01-31T12:00:00Z, "
                         f"got {value!r}") from None
    epoch_ms = int(when.timestamp() * 1000)  # a time without offset is local time
    if epoch_ms < 0:  # (Kafka's time lookup raised on it: a traceback)
        raise ValueError(f"--from time must be 1970 or later, got {value!r}")
    return "time", epoch_ms


def run_replay(args: argparse.Namespace) -> int:

    from aiokafka.errors import KafkaError

    from workers.derender.service import DerenderWorkerConfig
    from workers.derender.state import Derenderer

    try:
        start = parse_start(args.start)
    except ValueError as exc:
        print(f"genpipe replay: {exc}", file=sys.stderr)
        return 2
    if args.end is not None and args.end < 0:
        print("genpipe replay: --to must be >= 0", file=sys.stderr)
        return 2
    tokenizer = args.tokenizer
    if tokenizer is None:
        from workers.models.tinymodel import default_model_dir

        tokenizer = str(default_model_dir("spm"))
    model_name = args.model_name or DerenderWorkerConfig().model_name
    try:
        derenderer = Derenderer(tokenizer, model_name=model_name, max_logprobs=args.max_logprobs,
                                max_result_bytes=args.max_record_bytes)
    except (OSError, ValueError) as exc:
        print(f"genpipe replay: cannot load tokenizer {tokenizer}: {one_line(exc)}", file=sys.stderr)
        return 2
    quiet_kafka_logs()
    sink = partial = None
    try:
        target = os.path.realpath(args.out) if args.out not in (None, "-") else None
        if args.out == "-":
            sink = sys.stdout.buffer
        elif target is not None and os.path.exists(target) and not os.path.isfile(target):
            # a pipe, a device, /dev/stdout: written as it is
            sink = open(target, "wb")
        elif target is not None:
            # A file is written beside it, then renamed: opened in place, a replay that
            # failed (a broker away) had already emptied the previous run's file
            sink = open(f"{target}.partial-{os.getpid()}", "wb")
            partial = sink.name
            if os.path.exists(target):
                shutil.copymode(target, partial)
        summary = asyncio.run(replay(args, derenderer, start, sink))
        if partial is not None:
            sink.close()
            os.replace(partial, target)
            partial = None
    except BrokenPipeError:
        return stdout_gone()
    except (KafkaError, RuntimeError, OSError) as exc:
        print(f"genpipe replay: {one_line(exc)}", file=sys.stderr)
        return 1
    finally:
        if partial is not None:
            sink.close()
            os.unlink(partial)
        elif sink is not None and args.out != "-":
            sink.close()
    print(f"genpipe replay: {summary['chunks']} chunks from {summary['partitions']} partition(s) -> "
          f"{summary['results']} results to {summary['target']}; {summary['skipped_requests']} partial "
          f"request(s) skipped, {summary['undecodable']} undecodable chunk(s), "
          f"{summary['unfinished']} unfinished request(s)", file=sys.stderr)
    return 0


STALL_S = 60.0  # give up when the range stops advancing this long


async def replay(args: argparse.Namespace, derenderer, start: tuple[str, int], sink) -> dict:
    """Re-derender the chunk range; results to `args.to_topic` or `sink`; the summary."""
    from schemas import JSON, GenerateChunk, RecordError
    from workers.derender.filemode import result_line
    from workers.derender.stalls import StalledRequests
    from workers.derender.state import Result
    from workers.derender.undeliverable import within_record_limit
    from workers.kafka.clients import make_consumer, make_producer, start_client, stop_consumer, stop_producer
    from workers.kafka.follow import assign_range, batches
    from workers.kafka.publisher import Publisher, request_size_for
    from workers.kafka.records import Outgoing, decode_message

    settings = KafkaSettings.from_args(args, client_id="genpipe-replay")
    topic = resolve_topic(settings, args.chunks_topic, "chunks")
    summary = {"chunks": 0, "results": 0, "skipped_requests": 0, "undecodable": 0, "unfinished": 0,
               "partitions": 0, "target": args.to_topic or args.out}
    consumer = make_consumer(settings, group_id=None, auto_offset_reset="earliest")
    producer = publisher = None
    try:
        await start_client(consumer, settings)
        if args.to_topic is not None and args.to_topic not in await consumer.topics():
            raise RuntimeError(f"topic {args.to_topic!r} does not exist: create it first "
                               f"(genpipe topics create --topic {args.to_topic})")
        stop = await assign_range(consumer, topic, start, args.end, timeout_s=5.0)
        summary["partitions"] = len(stop)
        if args.to_topic is not None:
            producer = make_producer(settings, max_request_size=request_size_for(args.max_record_bytes))
            await start_client(producer, settings)
            publisher = Publisher(producer, settings.topic("dlq"), args.max_record_bytes)
        # request id -> its attempts that began before the range (not rebuilt); a later
        # attempt of it, whole in the range, is, and the skipped ones' chunks are dropped
        # (a straggler after the new attempt's seq 0 was a "seq gap" error in its place)
        skipped: dict[str, set[str]] = {}
        stalls = StalledRequests(args.stalled_request_s) if args.stalled_request_s > 0 else None
        failures: list = []
        last_progress = time.monotonic()
        async for records in batches(consumer, poll_ms=200, until=stop):
            if records:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > STALL_S:
                left = {tp.partition: (await consumer.position(tp), stop[tp]) for tp in stop}
                raise RuntimeError(f"no progress for {STALL_S:g} s reading {topic}; partition: "
                                   f"(position, stop) = {left}")
            outgoing: list[Outgoing] = []  # this poll's results, for one publish_batch
            for message in records:
                try:
                    chunk = decode_message(message, GenerateChunk)
                    if problem := unanswerable_id(chunk):  # (the worker sent it to the DLQ)
                        raise RecordError(problem)
                except RecordError as exc:
                    summary["undecodable"] += 1
                    print(f"genpipe replay: skipping undecodable chunk at {message.topic}[{message.partition}]"
                          f"@{message.offset}: {one_line(exc)}", file=sys.stderr)
                    continue
                summary["chunks"] += 1
                rid = chunk.request_id
                outputs = []
                if chunk.attempt in skipped.get(rid, ()):
                    pass
                elif chunk.seq != 0 and not (derenderer.is_active(rid) or derenderer.is_finished(rid)):
                    skipped.setdefault(rid, set()).add(chunk.attempt)  # began before the range: cannot be rebuilt
                else:
                    outputs = derenderer.process(chunk)
                if stalls is not None:  # the requests the worker ended at this chunk, as it did (first)
                    stalled = stalls.chunk(message.partition, rid, message.timestamp, derenderer.is_active(rid))
                    if stalled:
                        outputs = [o for sid in stalled for o in derenderer.end_stalled(sid, args.stalled_request_s)
                                   ] + outputs
                if not outputs:
                    continue

                def to_record(output, partition=message.partition) -> Outgoing:
                    if not isinstance(output, Result):  # a cancel: never published here
                        return Outgoing(settings.topic("cancel"), output.request_id, None)  # unused
                    return Outgoing(args.to_topic or "", output.request_id, output.value, JSON,
                                    headers=output.headers, partition=partition)

                for output, record in within_record_limit(derenderer, outputs, to_record, args.max_record_bytes):
                    if not isinstance(output, Result):
                        continue  # a stop-string cancel: the live pipeline sent it already
                    summary["results"] += 1
                    if publisher is not None:
                        outgoing.append(record)
                    else:
                        sink.write(result_line(output))
            if outgoing:
                # A poll's results as one producer batch per partition, in order: a send
                # each cost 4-25 µs more per result (BENCHMARKS.md, "`genpipe replay`'s sends").
                for future, count in Counter(await publisher.publish_batch(outgoing)).items():
                    future.add_done_callback(lambda f, n=count: failures.extend([f.exception()] * n)
                                             if not f.cancelled() and f.exception() else None)
        if publisher is not None:
            # Bounded: the producer keeps batches until sent, and with the target's leader
            # away the flush (and the stop after it) never ended, the error never said
            try:
                await asyncio.wait_for(publisher.flush(), STALL_S)
            except asyncio.TimeoutError:
                raise RuntimeError(f"results not acknowledged within {STALL_S:g} s by {args.to_topic} (is the "
                                   f"broker reachable? does every partition of it have a leader?)") from None
            if failures:
                raise RuntimeError(f"{len(failures)} result(s) could not be published: {failures[0]}")
        elif sink is not None:
            sink.flush()
        summary["skipped_requests"] = sum(not (derenderer.is_active(rid) or derenderer.is_finished(rid))
                                          for rid in skipped)  # (one restarted in range was rebuilt)
        summary["unfinished"] = len(derenderer.active_requests())
        return summary
    finally:
        derenderer.flush_logs()
        await stop_consumer(consumer, "genpipe replay")
        if producer is not None:
            await stop_producer(producer, 10.0, "genpipe replay")
