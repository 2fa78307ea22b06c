"""Kafka records <-> genpipe records: keys, values, headers, DLQ copies.

Every record genpipe writes carries `content-type` and `genpipe-schema` headers; every
record it reads is decoded by its content-type (sniffed when absent, for kcat users).
"""

from __future__ import annotations

import time
from typing import Any

from schemas import MSGPACK, Headers, decode_record, encode, headers_for
from schemas.headers import (HEADER_DLQ_CUT, HEADER_DLQ_ERROR, HEADER_DLQ_OFFSET, HEADER_DLQ_PARTITION,
                             HEADER_DLQ_TIME, HEADER_DLQ_TOPIC)



class Outgoing:
    """One record to publish: the value is a schemas Struct, encoded (with its headers)
    once, when first needed: sizing it for the record limit, or sending it. Build a new
    Outgoing rather than change one. A plain slotted class: the generate worker makes one
    per chunk, and a dataclass's generated __init__ (a dict per record for `headers`)
    cost ~1.1 µs where this costs ~0.5."""

    __slots__ = ("topic", "key", "value", "content_type", "headers", "partition", "_encoded", "_headers")

    def __init__(self, topic: str, key: str, value: Any, content_type: str = MSGPACK,
                 headers: dict[str, str] | None = None, partition: int | None = None):
        self.topic = topic
        self.key = key
        self.value = value
        self.content_type = content_type
        self.headers = headers  # genpipe-* headers beyond content-type and schema, as text (None: none)
        self.partition = partition  # None: the producer's key hashing decides
        self._encoded: bytes | None = None
        self._headers: Headers | None = None

    def __repr__(self) -> str:
        return (f"Outgoing(topic={self.topic!r}, key={self.key!r}, value={self.value!r}, "
                f"content_type={self.content_type!r}, headers={self.headers!r}, partition={self.partition!r})")

    def kafka_headers(self) -> Headers:
        headers = self._headers
        if headers is None:
            headers = self._headers = headers_for(self.value, self.content_type)
            if self.headers:  # text values (no str() each: a derender result has two or three)
                for name, value in self.headers.items():
                    headers.append((name, value.encode()))
        return headers

    def kafka_key(self) -> bytes:
        return self.key.encode()

    def kafka_value(self) -> bytes:
        if self._encoded is None:
            self._encoded = encode(self.value, self.content_type)
        return self._encoded

    def size(self) -> int:
        """Bytes of value, key and headers: what counts against the record size limit."""
        n = len(self.kafka_value()) + len(self.key.encode())
        for name, value in self.kafka_headers():  # (a loop: a generator per record cost more)
            n += len(name) + len(value)
        return n


class DlqCopy:
    """A refused record's copy for the DLQ, its bytes as they came (`dlq_copy`): published
    as an Outgoing is (workers/kafka/publisher.py), on its key's partition."""

    __slots__ = ("topic", "key", "value", "headers", "partition")

    def __init__(self, topic: str, key: bytes | None, value: bytes | None, headers: Headers):
        self.topic, self.key, self.value, self.headers = topic, key, value, headers
        self.partition = None  # the producer's partitioner's choice

    def kafka_key(self) -> bytes | None:
        return self.key

    def kafka_value(self) -> bytes | None:
        return self.value

    def kafka_headers(self) -> Headers:
        return self.headers


def decode_message(message, record_type: Any) -> Any:
    """Decode a consumed aiokafka record's value; raises schemas DecodeError/ValidationError."""
    return decode_record(message.value, message.headers, record_type)


def message_key(message) -> str | None:
    return message.key.decode("utf-8", "replace") if message.key is not None else None


def dlq_copy(message, error: str, limit: int) -> tuple[bytes | None, bytes | None, Headers]:
    """The DLQ record (key, value, headers) for a refused `message`: its own key, bytes and
    headers, plus where it came from and why it was refused.

    A record just under its topic's limit grows past it with our headers, and the broker
    refused the copy: the generate worker then held the record's offset for good (its
    partition committed no further), the derender lost the copy. So a copy over `limit`
    is cut to fit: the original headers go if they take more than a quarter of the room,
    the key is cut to a quarter, the value to what is left, and HEADER_DLQ_CUT says what
    the original held. The whole record stays at its source offset while the topic's
    retention keeps it."""
    original = list(message.headers or ())
    ours = [
        (HEADER_DLQ_TOPIC, message.topic.encode()),
        (HEADER_DLQ_PARTITION, str(message.partition).encode()),
        (HEADER_DLQ_OFFSET, str(message.offset).encode()),
        (HEADER_DLQ_ERROR, error.encode("utf-8", "replace")[:4096]),
        (HEADER_DLQ_TIME, str(int(time.time() * 1000)).encode()),
    ]
    key, value = message.key, message.value
    key_size, value_size = len(key or b""), len(value or b"")
    original_size = _headers_size(original)
    if key_size + value_size + original_size + _headers_size(ours) <= limit:
        return key, value, original + ours
    ours.append((HEADER_DLQ_CUT, (f"key {key_size} bytes, value {value_size} bytes, {len(original)} headers "
                                  f"({original_size} bytes): cut to fit the record limit of {limit} bytes").encode()))
    room = max(0, limit - _headers_size(ours))
    if original_size > room // 4:
        original = []
    room -= _headers_size(original)
    if key is not None:
        key = key[:room // 4]
        room -= len(key)
    if value is not None:
        value = value[:room]
    return key, value, original + ours


def _headers_size(headers: Headers) -> int:
    return sum(len(name) + len(value or b"") for name, value in headers)
