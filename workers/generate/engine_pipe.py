"""The two pipes between the generate worker and its engine process: the messages each
way and how they are framed. engine_process.py is the worker's side, engine_child.py the
child's (docs/design.md §4).

    parent → child   Add(request, tier) | Abort(request_id, reason) | Tune(lagging, stretch) | Stop()
    child → parent   Ready(limits) | Step(outputs, step_s) | Failed(error)
"""

from __future__ import annotations

import os

import msgspec

from schemas.records import GenerateRequest
from workers.generate.logprob_entries import encode_pending
from workers.generate.outputs import StepOutputs

# The messages are msgspec msgpack, tagged, so each says what it is. Not pickle: a step
# of a batch-256 engine is 256 outputs, and pickling msgspec structs cost ~5.7 µs per
# output (encode + decode) where msgspec's own codec costs ~0.9 (BENCHMARKS.md,
# "Throughput": the engine child's CPU per token).

class Add(msgspec.Struct, tag=True):
    request: GenerateRequest
    tier: int = 0  # 0 interactive, 1 bulk: its place in the engine's waiting queue


class Abort(msgspec.Struct, tag=True):
    request_id: str
    reason: str


class Tune(msgspec.Struct, tag=True):
    """The worker's state that the chunk policy reads (workers/generate/token_holder.py)."""

    lagging: bool
    stretch: float


class Stop(msgspec.Struct, tag=True):
    pass


class Ready(msgspec.Struct, tag=True):
    limits: dict[str, int]  # validate_request's keyword arguments: the parent checks requests


class Step(msgspec.Struct, tag=True):
    outputs: StepOutputs  # the engine's outputs of one step, column-wise (outputs.py)
    step_s: float


class Failed(msgspec.Struct, tag=True):
    error: str


# enc_hook: a step's logprob entries are encoded here, in the outbox thread, the whole
# step at once (workers/generate/logprob_wire.py StepEntries), not inside the step.
encode = msgspec.msgpack.Encoder(enc_hook=encode_pending).encode
decode_to_child = msgspec.msgpack.Decoder(Add | Abort | Tune | Stop).decode
decode_from_child = msgspec.msgpack.Decoder(Ready | Step | Failed).decode

# The child's messages are framed here, not by multiprocessing (whose framing is its
# own business): a 4-byte big-endian length, then the msgpack bytes. The parent's
# commands go through multiprocessing's send_bytes/recv_bytes on the other pipe.
LENGTH_BYTES = 4


def write_frame(conn, payload: bytes) -> None:
    """One message to the worker (blocking; raises OSError once the worker is gone)."""
    data = memoryview(len(payload).to_bytes(LENGTH_BYTES, "big") + payload)
    fd = conn.fileno()
    while data:
        data = data[os.write(fd, data):]


def read_frame(conn) -> bytes:
    """One message from the child (blocking; raises EOFError at end of file)."""
    header = _read_exactly(conn.fileno(), LENGTH_BYTES)
    return _read_exactly(conn.fileno(), int.from_bytes(header, "big"))


def _read_exactly(fd: int, size: int) -> bytes:
    parts, left = [], size
    while left:
        part = os.read(fd, left)
        if not part:
            raise EOFError("the engine process closed its pipe")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)
