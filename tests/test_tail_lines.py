"""`genpipe tail` / `submit --json` lines for records of any shape (no broker)."""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace

import pytest

from workers.results import record_json


def _record(value: bytes | None, headers=()):
    return SimpleNamespace(key=b"k", value=value, headers=list(headers), topic="genpipe.dlq", partition=0, offset=7,
                           timestamp=1)


@pytest.mark.parametrize("value, error", [
    (bytes.fromhex("d40000"), "Encoding objects of type msgspec.msgpack.Ext is unsupported"),  # an extension value
    (bytes.fromhex("81c001"), "Only dicts with str-like or number-like keys are supported"),  # a nil map key
    (b"\x91" * 5000 + b"\xc0", "maximum recursion depth exceeded"),  # nested past the decoder's depth
    (b"\xc1", "MessagePack data is malformed"),
])
def test_a_record_the_workers_sent_to_the_dlq_is_a_line_not_the_end_of_the_command(value, error):
    """Such records decoded as msgpack but could not be written as JSON (a TypeError
    traceback), or went past the decoder's depth (the command printed one line and
    stopped): `tail --topic dlq` could never get past the first one."""
    line = json.loads(record_json(_record(value)))
    assert line["value"] is None and error in line["value_error"]
    assert base64.b64decode(line["value_base64"]) == value
    assert (line["key"], line["topic"], line["offset"]) == ("k", "genpipe.dlq", 7)


def test_json_and_msgpack_values_are_shown_as_they_are():
    assert json.loads(record_json(_record(b'{"a": [1, 2]}', [("content-type", b"application/json")])))[
        "value"] == {"a": [1, 2]}
    assert json.loads(record_json(_record(bytes.fromhex("81a16101"))))["value"] == {"a": 1}


def test_a_stray_record_among_a_request_s_results_is_its_error_not_a_crash():
    """A record on the reply topic with the request's key that the client cannot read
    becomes an error result in the stream; `assemble` (what `complete()` and `submit`
    return) crashed on it unless it came last, and a record without a value (a
    tombstone) crashed `decode_result` with AttributeError."""
    from schemas import Completion, CompletionChoice, ErrorResponse
    from schemas.errors import DecodeError
    from schemas.openai import ErrorInfo
    from workers.results import assemble, decode_result

    def part(text: str) -> Completion:
        return Completion(id="cmpl-r", created=0, model="m", choices=[CompletionChoice(text=text)])
    stray = ErrorResponse(error=ErrorInfo(message="unreadable result record", type="server_error"))
    assert assemble([part("a"), stray, part("b")]) is stray
    with pytest.raises(DecodeError, match="without a value"):
        decode_result(None, [])
