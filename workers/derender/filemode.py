"""`genpipe derender --in CHUNKS --out RESULTS`: the derender without Kafka.

Input: JSON lines `{"key": "<request_id>", "value": <GenerateChunk as JSON>}` (what
`genpipe tail --topic chunks` or kcat prints for the chunk topic). Output: JSON lines
`{"key": ..., "headers": {...}, "value": <result>}` in the order a derender worker would
publish them, with the headers it would set (content-type, genpipe-schema and the
genpipe-* result headers). Bad lines are reported on stderr with their line number and
skipped; the run goes on.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import IO, Iterable, Iterator

import msgspec

from schemas.codec import HEADER_CONTENT_TYPE, HEADER_SCHEMA, JSON, decode, schema_header
from schemas.errors import RecordError
from schemas.records import Cancel, GenerateChunk
from workers.derender.chunk_rules import unanswerable_id
from workers.derender.state import CancelRequest, Derenderer, Result
from workers.derender.undeliverable import within_record_limit
from workers.kafka.records import Outgoing
from workers.kafka.settings import MAX_RECORD_BYTES


class _InLine(msgspec.Struct):
    value: msgspec.Raw
    key: str | None = None


_in_decoder = msgspec.json.Decoder(_InLine)
_encoder = msgspec.json.Encoder()


@dataclass
class Summary:
    lines: int = 0
    chunks: int = 0
    results: int = 0
    cancels: int = 0
    bad_lines: int = 0
    unfinished: int = 0


def parse_line(line: bytes) -> GenerateChunk:
    """One input line as a chunk; raises RecordError/ValueError with a one-line reason."""
    try:
        wrapped = _in_decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise ValueError(f"not a {{\"key\", \"value\"}} object: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    chunk = decode(bytes(wrapped.value), GenerateChunk, JSON)
    if wrapped.key is not None and wrapped.key != chunk.request_id:
        raise ValueError(f"key {wrapped.key!r} is not the chunk's request_id {chunk.request_id!r}")
    return chunk


def result_line(result: Result) -> bytes:
    headers = {HEADER_CONTENT_TYPE: JSON, HEADER_SCHEMA: schema_header(type(result.value))}
    headers.update(result.headers)
    return _encoder.encode({"key": result.request_id, "headers": headers, "value": result.value}) + b"\n"


def cancel_line(cancel: CancelRequest) -> bytes:
    value = Cancel(request_id=cancel.request_id, reason=cancel.reason)
    headers = {HEADER_CONTENT_TYPE: JSON, HEADER_SCHEMA: schema_header(Cancel)}
    return _encoder.encode({"key": cancel.request_id, "headers": headers, "value": value}) + b"\n"


def run(derenderer: Derenderer, lines: Iterable[bytes], out: IO[bytes], *,
        cancels: IO[bytes] | None = None, errors: IO[str] | None = None,
        source: str = "input", max_record_bytes: int = MAX_RECORD_BYTES) -> Summary:
    """Derender every line of `lines` into `out`; report bad lines on `errors`. A result
    over `max_record_bytes` becomes the error result a worker publishes in its place
    (`within_record_limit`, as `genpipe replay`): file mode wrote it whole."""
    errors = errors if errors is not None else sys.stderr
    summary = Summary()
    write = out.write
    for number, line in _numbered(lines):
        summary.lines += 1
        try:
            chunk = parse_line(line)
            if problem := unanswerable_id(chunk):  # (a worker sends it to the DLQ)
                raise ValueError(problem)
        except (RecordError, ValueError) as exc:
            summary.bad_lines += 1
            errors.write(f"genpipe derender: {source}:{number}: {_one_line(exc)}\n")
            continue
        summary.chunks += 1
        for output, _ in within_record_limit(derenderer, derenderer.process(chunk), _sized, max_record_bytes):
            if isinstance(output, Result):
                summary.results += 1
                write(result_line(output))
            else:
                summary.cancels += 1
                if cancels is not None:
                    cancels.write(cancel_line(output))
    summary.unfinished = len(derenderer.active_requests())
    derenderer.flush_logs()
    return summary


def _sized(output) -> Outgoing:
    """What the record-size rule measures: a result as a worker publishes it."""
    if isinstance(output, Result):
        return Outgoing("", output.request_id, output.value, JSON, headers=output.headers)
    return Outgoing("", output.request_id, Cancel(request_id=output.request_id, reason=output.reason))


def _numbered(lines: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    for number, line in enumerate(lines, 1):
        if line.strip():
            yield number, line


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
