"""What an engine step produces: plain data, no torch.

The engine child process sends these to the worker (msgspec msgpack, as arrays:
workers/generate/engine_process.py); keeping the class out of the torch-importing engine
module lets the worker process decode them without loading torch (~0.5 GB resident for
the CUDA build, BENCHMARKS.md "Soak")."""

from __future__ import annotations

import msgspec

from schemas.records import FinishReason, GenerateLogProbsContent


class RequestOutput(msgspec.Struct, kw_only=True, gc=False, array_like=True):
    """What one step produced for one request."""

    request_id: str
    # A tuple when decoded from the pipe (a tuple of numbers is dropped from the garbage
    # collector's view, a list is not); the engine builds lists, which encode the same.
    token_ids: tuple[int, ...]  # 0 or 1 new ids
    # Aligned with token_ids, if asked: each position's GenerateLogProbsContent as msgpack,
    # which the worker puts into its chunk records as it is (logprobs_raw). The engine
    # hands over PendingEntry objects, encoded a step at a time as the step is sent
    # (logprob_wire.py StepEntries; the pipe's enc_hook), so bytes once decoded.
    logprobs: tuple[bytes, ...] | None = None
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the stop_token_ids entry (or secondary EOS) that ended it
    prompt_logprobs: list[GenerateLogProbsContent | None] | None = None  # first output only
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # all ids generated so far, these included
    sampled_at_ns: int = 0
