"""What a result the Kafka layer cannot deliver becomes (docs/design.md §5.5): the error
result that ends its request in its place, on the default results topic where the
client's library (or `genpipe tail`) finds it by request id. Pure: the worker and
`genpipe replay` apply the same rules."""

from __future__ import annotations

from typing import Callable

import msgspec
from aiokafka.errors import (MessageSizeTooLargeError, RecordListTooLargeError, TopicAuthorizationFailedError,
                             UnknownTopicOrPartitionError)

from workers.derender.state import Derenderer, Output, Result
from workers.kafka.records import Outgoing



def within_record_limit(derenderer: Derenderer, outputs: list, to_record: Callable[[Output], Outgoing],
                        limit: int, limit_of: Callable[[str], int] | None = None,
                        quiet: bool = False) -> list[tuple[Output, Outgoing]]:
    """The derenderer's outputs with their records. A result over `limit` bytes (a long
    non-streamed answer with many logprobs) would be refused by the broker, leaving its
    request unanswered and its offset held: the error result that ends the request
    (`Derenderer.fail`) goes in its place. `limit_of(topic)`, where given, is a topic's
    own limit, lower than `limit` for a reply topic whose `max.message.bytes` is
    (`Publisher.record_limit`). The worker and `genpipe replay` both apply it, so a
    replay reproduces the worker's records (but for reply topics' own limits: those are
    the broker's, read live). `quiet`: nothing logged (a replay of what was said)."""
    out = []
    for output in outputs:
        record = to_record(output)
        try:
            size = record.size()
        except (ValueError, OverflowError, TypeError) as exc:
            if not isinstance(output, Result):
                raise
            # A value no codec writes, from a chunk another producer wrote (a usage total of
            # 4,301 digits once got this far; chunks' integers are 64-bit now): raised here,
            # it stopped the worker, and every restart read the chunk again. The request
            # ends with an error in its place.
            message = f"its result could not be encoded ({exc!r})"
            if not quiet:
                derenderer.render_failures.log("request %s: %s", output.request_id, message)
            out.extend((o, to_record(o)) for o in derenderer.fail(output, message))
            continue
        if isinstance(output, Result) and (size > limit or limit_of is not None and size > limit_of(record.topic)):
            if size > limit:
                message = (f"result too large: {size} bytes, over the record size limit of {limit} "
                           f"bytes; ask for fewer logprobs (a non-streamed answer holds every token's "
                           f"logprobs in one result, a streamed one those of one chunk)")
            else:
                message = (f"result too large for reply_topic {record.topic!r}: {size} bytes, over the "
                           f"{limit_of(record.topic)} its max.message.bytes leaves for a record; raise the "
                           f"topic's max.message.bytes (to {limit} or more, the derender workers' "
                           f"--max-record-bytes) or ask for fewer logprobs")
            if not quiet:
                derenderer.answered_with_errors.log("request %s: %s", output.request_id, message)
            # the request asked for more than a record holds: the client's to change
            out.extend((o, to_record(o)) for o in derenderer.fail(output, message, "invalid_request_error", 400))
        else:
            out.append((output, record))
    return out


def refusal_message(topic: str, results_topic: str, exc: BaseException, max_record_bytes: int) -> str:
    """What a client is told when the broker refused its result for good."""
    where = f"the results topic {topic!r}" if topic == results_topic else f"reply_topic {topic!r}"
    name = type(exc).__name__
    if isinstance(exc, (MessageSizeTooLargeError, RecordListTooLargeError)):
        return (f"{where} refused the result as too large ({name}): the topic's max.message.bytes must hold "
                f"the derender workers' largest result batch (their --max-record-bytes is {max_record_bytes})")
    if isinstance(exc, UnknownTopicOrPartitionError):
        return f"{where} was deleted while the result was on its way to it"
    if isinstance(exc, TopicAuthorizationFailedError):
        return f"{where} refused the result ({name}): the derender workers may not write to it"
    return f"{where} refused the result ({name}: {exc})"


def answer_on_default_topic(derenderer: Derenderer, result: Result, message: str) -> list[Output]:
    """`result` cannot go to its reply topic (not allowed, missing, refused): end the
    request with an `invalid_request_error` on the default results topic instead, where
    the client's library (or `genpipe tail`) still finds it by request id."""
    return [msgspec.structs.replace(o, reply_topic=None) if isinstance(o, Result) else o
            for o in derenderer.fail(result, message, "invalid_request_error", 400)]
