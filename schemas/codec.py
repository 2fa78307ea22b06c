"""Encoding and decoding records, chosen by the `content-type` header.

Readers accept both codecs (msgpack and JSON), so `kcat` users can produce JSON. When a
record has no content-type header the codec is sniffed: every genpipe record is a map,
so JSON starts with `{` (after optional white space) while msgpack starts with a map
marker (0x80-0x8f, 0xde, 0xdf) — the two never collide.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import msgspec

from schemas.errors import DecodeError, ValidationError
from schemas.records import SCHEMA_VERSION

MSGPACK = "application/x-msgpack"
JSON = "application/json"
CONTENT_TYPES = (MSGPACK, JSON)
HEADER_CONTENT_TYPE = "content-type"
HEADER_SCHEMA = "genpipe-schema"

Headers = list[tuple[str, bytes]]

_msgpack_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()


def schema_header(record_type: type) -> str:
    """The `genpipe-schema` value for a record type, e.g. `GenerateRequest/v1`."""
    return f"{record_type.__name__}/v{SCHEMA_VERSION}"


def encode(record: Any, content_type: str = MSGPACK) -> bytes:
    if content_type == MSGPACK:
        return _msgpack_encoder.encode(record)
    if content_type == JSON:
        return _json_encoder.encode(record)
    raise ValueError(f"unsupported content-type {content_type!r}; expected one of {CONTENT_TYPES}")


_BASE_HEADERS: dict[tuple[type, str], tuple[tuple[str, bytes], ...]] = {}


def headers_for(record: Any, content_type: str = MSGPACK, extra: Iterable[tuple[str, bytes]] = ()) -> Headers:
    # The two fixed headers are the same for every record of a type: built once per
    # (type, content type), not per record (every published record comes through here).
    base = _BASE_HEADERS.get((type(record), content_type))
    if base is None:
        base = _BASE_HEADERS[(type(record), content_type)] = (
            (HEADER_CONTENT_TYPE, content_type.encode()),
            (HEADER_SCHEMA, schema_header(type(record)).encode()),
        )
    headers = list(base)
    headers.extend(extra)
    return headers


def header_bytes(headers: Iterable[tuple[str, bytes]] | None, name: str) -> bytes | None:
    """The last value of header `name` as sent (Kafka allows repeats; the last wins)."""
    value = None
    for key, raw in headers or ():
        if key == name:
            value = raw
    return value


def header_value(headers: Iterable[tuple[str, bytes]] | None, name: str) -> str | None:
    """The last value of header `name` as text."""
    raw = header_bytes(headers, name)
    return raw.decode("utf-8", "replace") if raw is not None else None


def sniff_content_type(data: bytes) -> str:
    stripped = data.lstrip(b" \t\r\n")
    return JSON if stripped[:1] == b"{" else MSGPACK


# The content-type header values genpipe writes, as read from a record: every record read
# (a request, a chunk) asks for its codec, and these skip parsing the value.
_WRITTEN_TYPES = {MSGPACK.encode(): MSGPACK, JSON.encode(): JSON}


def content_type_of(data: bytes, headers: Iterable[tuple[str, bytes]] | None) -> str:
    """The record's codec: its content-type header, or sniffed when there is none."""
    raw = header_bytes(headers, HEADER_CONTENT_TYPE)
    written = _WRITTEN_TYPES.get(raw) if raw is not None else None
    if written is not None:
        return written
    declared = raw.decode("utf-8", "replace") if raw is not None else None
    if declared is None or declared.strip() == "":
        return sniff_content_type(data)
    # Accept parameters such as "application/json; charset=utf-8".
    media = declared.split(";", 1)[0].strip().lower()
    if media in ("application/msgpack", "application/vnd.msgpack"):
        media = MSGPACK
    if media not in CONTENT_TYPES:
        raise DecodeError(
            f"unsupported content-type {declared!r}; expected {MSGPACK} or {JSON}")
    return media


_DECODERS: dict[tuple[Any, str], Any] = {}


def _decoder(record_type: Any, content_type: str):
    decoder = _DECODERS.get((record_type, content_type))
    if decoder is None:
        if content_type not in CONTENT_TYPES:
            raise DecodeError(f"unsupported content-type {content_type!r}; expected {MSGPACK} or {JSON}")
        module = msgspec.msgpack if content_type == MSGPACK else msgspec.json
        decoder = _DECODERS[(record_type, content_type)] = module.Decoder(record_type)
    return decoder


def decode(data: bytes, record_type: Any, content_type: str | None = None) -> Any:
    """Decode `data` as `record_type`.

    Raises DecodeError when the bytes are not a record at all and ValidationError (with
    the field named) when they decode but do not fit the type.
    """
    # The hot path of every worker: one dict lookup, then msgspec.
    decoder = _decoder(record_type, content_type or sniff_content_type(data))
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise validation_error_from_msgspec(exc) from None
    except msgspec.DecodeError as exc:
        kind = "msgpack" if decoder.__class__ is msgspec.msgpack.Decoder else "JSON"
        raise DecodeError(f"not a valid {kind} record: {exc}") from None
    except TypeError:
        raise DecodeError(f"record value must be bytes, got {type(data).__name__}") from None
    except RecursionError:
        # msgspec gives up on values nested ~1,000 deep (an unknown field's too, skipped
        # unread): the record is not one, not a fault of the worker reading it
        raise DecodeError("not a valid record: nested too deeply") from None


def decode_record(data: bytes, headers: Iterable[tuple[str, bytes]] | None, record_type: Any) -> Any:
    """Decode a Kafka record's value using its headers to pick the codec."""
    if data is None:
        raise DecodeError("record has no value (tombstone)")
    return decode(data, record_type, content_type_of(data, headers))


class _Address(msgspec.Struct):
    request_id: str
    reply_topic: Any = None  # (any type: read only when it is a string)


def peek_request_id(data: bytes, headers: Iterable[tuple[str, bytes]] | None = None) -> str | None:
    """The record's request_id if it can be read at all, even when other fields are bad.

    Lets a worker answer an invalid request with an error result rather than the DLQ.
    """
    return peek_address(data, headers)[0]


def peek_address(data: bytes, headers: Iterable[tuple[str, bytes]] | None = None) -> tuple[str | None, str | None]:
    """(request_id, reply_topic) of a record that does not decode as a request, each
    None where it cannot be read: the error answer goes where the requester reads (a
    client reading its own reply topic waited for one sent to the shared results topic
    until it timed out). The reply topic must still pass the deployment's rule."""
    try:
        peeked = decode_record(data, headers, _Address)
    except Exception:
        return None, None
    return peeked.request_id, peeked.reply_topic if isinstance(peeked.reply_topic, str) else None


_MSGSPEC_PATH = re.compile(r"^(?P<msg>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?$", re.S)


def validation_error_from_msgspec(exc: msgspec.ValidationError) -> ValidationError:
    """Turn msgspec's "Expected `int`, got `str` - at `$.a[0]`" into "a[0]: expected int, got str"."""
    match = _MSGSPEC_PATH.match(str(exc))
    msg = match.group("msg") if match else str(exc)
    path = (match.group("path") or "") if match else ""
    path = path.lstrip(".")
    msg = msg.replace("`", "")
    missing = re.match(r"Object missing required field (\S+)", msg)
    if missing:
        field = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return ValidationError(f"{field} is required", field=field)
    msg = msg[:1].lower() + msg[1:]
    if match and match.group("key"):
        where = path or "the record"
        return ValidationError(f"a key of {where}: {msg}", field=path or None)
    if path:
        return ValidationError(f"{path}: {msg}", field=path)
    return ValidationError(msg, field=None)
