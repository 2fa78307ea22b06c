"""The two ways a record can be bad.

`DecodeError`: the bytes are not a record at all (truncated msgpack, not JSON, an
unknown content-type). Workers send such records to the DLQ untouched.

`ValidationError`: the bytes decode, but a field has the wrong type, is missing or
breaks a rule. The message names the field, so it can go back to the requester as an
error result (`finish_reason=error`) instead of a traceback.
"""

from __future__ import annotations


class RecordError(Exception):
    """Base of every error about a record's bytes or contents."""


class DecodeError(RecordError):
    """The bytes do not decode as a record in the announced content-type."""


class ValidationError(RecordError):
    """The record decodes but breaks the schema or a rule; `field` names the culprit."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field

    def __str__(self) -> str:  # keep one line, no repr noise
        return self.message
