"""What an engine step produces: plain data, no torch.

The engine child process sends these to the worker (msgspec msgpack, as arrays:
workers/generate/engine_pipe.py); keeping the class out of the torch-importing engine
module lets the worker process decode them without loading torch (~0.5 GB resident for
the CUDA build, BENCHMARKS.md "Soak")."""

from __future__ import annotations

from itertools import chain, repeat
from typing import Iterable, Iterator

import msgspec

from schemas.records import FinishReason, GenerateLogProbsContent


class RequestOutput(msgspec.Struct, kw_only=True, gc=False, array_like=True):
    """What one step produced for one request."""

    request_id: str
    # A tuple when decoded from the pipe (a tuple of numbers is dropped from the garbage
    # collector's view, a list is not); the engine builds lists, which encode the same.
    token_ids: tuple[int, ...]  # the new ids: 0 or 1 from a step, more from the holder (token_holder.py)
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
    sampled_at_ns: int = 0  # when the newest of token_ids was sampled
    held_since: float = 0.0  # when the first of token_ids reached the holder (monotonic; 0: not held)


class StepOutputs(msgspec.Struct, gc=False, array_like=True):
    """One engine step's outputs, the common case column-wise: what an engine's `step()`
    returns and the engine process sends the worker.

    At batch 256 nearly every output of a step is one new token and nothing else, so those
    are aligned columns (ids, tokens, logprob entries) rather than a struct each: a struct
    per output cost the engine ~0.3 µs to build, and the worker ~0.44 µs to decode where
    the columns cost ~0.13, and the worker's handler walks the columns in one tight loop
    (BENCHMARKS.md, "A step's outputs column-wise"). Everything else (an end, prompt
    logprobs, no token) is a RequestOutput in `others`. An engine gives a request at most
    one output a step, so a request is in the columns or in `others`, not both. Iterating
    gives one RequestOutput per request (the columns' first), for code that wants that
    (tests, tools), not for the worker's hot path."""

    request_ids: tuple[str, ...] = ()  # requests with exactly one new token and nothing more
    token_ids: tuple[int, ...] = ()  # aligned with request_ids
    # Aligned with request_ids when any of them asked for logprobs (None for those that did
    # not); None when none did. Bytes once decoded (PendingEntry in the engine process).
    logprobs: tuple[bytes | None, ...] | None = None
    sampled_at_ns: int = 0  # when the column tokens were sampled
    others: list[RequestOutput] = []
    # Set by the holder (token_holder.py), which hands on only what is due: the engine
    # step's size and the longest gap between a request's previous token and the step's
    # (0 when it handed on no step: tokens that fell due between steps).
    batch: int = 0
    gap_s: float = 0.0

    def __len__(self) -> int:
        return len(self.request_ids) + len(self.others)

    def __iter__(self) -> Iterator[RequestOutput]:
        entries = self.logprobs or (None,) * len(self.request_ids)
        for rid, token, entry in zip(self.request_ids, self.token_ids, entries):
            yield RequestOutput(request_id=rid, token_ids=(token,), logprobs=None if entry is None else (entry,),
                                sampled_at_ns=self.sampled_at_ns)
        yield from self.others

    @classmethod
    def of(cls, outputs: Iterable[RequestOutput]) -> StepOutputs:
        """Outputs made one struct each (tests, tools), in this form: an output joins the
        columns when it holds one token and nothing more and was sampled when the first
        such output was."""
        step = StepCollector()
        sampled_at = None
        for out in outputs:
            if (len(out.token_ids) == 1 and out.finish_reason is None and out.prompt_logprobs is None
                    and (sampled_at is None or out.sampled_at_ns == sampled_at)):
                sampled_at = out.sampled_at_ns
                step.token(out.request_id, out.token_ids[0], out.logprobs[0] if out.logprobs else None)
            else:
                step.output(out)
        step.sampled_at_ns = sampled_at or 0
        return step.done()

    def new_tokens(self) -> Iterable[tuple[str, int, bytes | None, int]]:
        """(request_id, token id, its logprob entry or None, sampled_at_ns) for each new
        token of the step: the columns', then those of `others`."""
        entries = self.logprobs if self.logprobs is not None else repeat(None)
        tokens = zip(self.request_ids, self.token_ids, entries, repeat(self.sampled_at_ns))
        if not self.others:
            return tokens
        return chain(tokens, ((out.request_id, token, out.logprobs[i] if out.logprobs else None, out.sampled_at_ns)
                              for out in self.others for i, token in enumerate(out.token_ids)))


class StepCollector:
    """A step's outputs as an engine makes them: each request's one new token into the
    columns (`token`), anything else as a RequestOutput (`output`); `done` gives the step.
    The engine sets `sampled_at_ns` when it samples the step's tokens."""

    __slots__ = ("request_ids", "token_ids", "logprobs", "others", "sampled_at_ns")

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []  # an entry or None per token
        self.others: list[RequestOutput] = []
        self.sampled_at_ns = 0

    def token(self, request_id: str, token_id: int, entry=None) -> int:
        """One request's new token (and its logprob entry, if asked); returns its column
        index (`set_entry`: entries made for the whole step after its tokens)."""
        self.request_ids.append(request_id)
        self.token_ids.append(token_id)
        self.logprobs.append(entry)
        return len(self.token_ids) - 1

    def tokens(self, request_ids: list[str], token_ids: list[int], entries: list) -> None:
        """Many requests' new tokens at once, as `token` one by one in that order."""
        self.request_ids += request_ids
        self.token_ids += token_ids
        self.logprobs += entries

    def set_entry(self, index: int, entry) -> None:
        self.logprobs[index] = entry

    def output(self, out: RequestOutput) -> None:
        self.others.append(out)

    def done(self) -> StepOutputs:
        entries = self.logprobs
        asked = entries.count(None) < len(entries)
        return StepOutputs(tuple(self.request_ids), tuple(self.token_ids), tuple(entries) if asked else None,
                           self.sampled_at_ns, self.others)
