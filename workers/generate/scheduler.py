"""Continuous-batching scheduler: who runs this step, and which KV-cache row they own.

Plain data in, plain data out; no torch. A request moves WAITING → PREFILL → DECODE
and leaves the moment it finishes. Each step:

- chunked prefill, bounded by `prefill_chunk` prompt tokens per step: requests already
  part-way through their prompt continue first (FIFO), then waiting requests are
  admitted, by priority then arrival, while a cache row is free and budget is left. A long prompt therefore takes
  several steps and never stalls the decoding requests, which run every step;
- every DECODE request feeds its last sampled token.

Rows: decoding requests always hold rows `0..n_decode-1` (so the model runner reads
their KV as one view of the cache); prefilling requests take free rows from the top.
When a request finishes, the last decoding row moves into its hole; when a prefill
completes, the request moves to row `n_decode`. Those moves come back as
`(src, dst, length)` triples for the model runner (`-1` is its scratch row): copying
the cached K/V of one request, never recomputing it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from schemas.records import GenerateRequest, SamplingParams
from workers.generate.admission import queue_by_priority

WAITING, PREFILL, DECODE, FINISHED = "waiting", "prefill", "decode", "finished"

Move = tuple[int, int, int]  # (src row, dst row, positions to copy); -1 = scratch row


@dataclass(eq=False, slots=True)
class Sequence:
    """Engine-side state of one request."""

    request: GenerateRequest
    max_output: int  # max_tokens capped by the room left in the context
    eos: int | None = None  # primary EOS (finish "stop", stop_token_id None); None if ignore_eos
    stop_ids: frozenset[int] = frozenset()  # stop_token_ids (+ secondary EOS ids)
    ends: frozenset[int] = frozenset()  # eos and stop_ids: a sampled id the stop rules must look at
    suppress_ids: tuple[int, ...] = ()  # masked while len(output) < min_tokens
    generator: Any = None  # torch.Generator for a seeded request
    sampling_row: tuple = ()  # sampler.sampling_row(params): its row of the step's sampling tensors
    status: str = WAITING
    row: int = -1
    num_computed: int = 0  # positions whose K/V are in the cache
    output: list[int] = field(default_factory=list)
    prompt_logprobs: list | None = None
    sent_first: bool = False
    uid: int = 0  # unique per engine, never reused (unlike id())
    tier: int = 0  # 0 interactive, 1 bulk: its place in the waiting queue (admission.py)
    # The request's, as attributes rather than properties: read for every row of a step.
    request_id: str = field(init=False)
    prompt: list[int] = field(init=False)
    params: SamplingParams = field(init=False)

    def __post_init__(self) -> None:
        self.request_id = self.request.request_id
        self.prompt = self.request.prompt_token_ids
        self.params = self.request.sampling


@dataclass
class ScheduledPrefill:
    seq: Sequence
    start: int
    length: int
    final: bool  # the chunk ends the prompt: its last position yields the first token


@dataclass
class ScheduleOutput:
    decode: list[Sequence]  # decode[i].row == i
    prefills: list[ScheduledPrefill]

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefills)


class Scheduler:
    def __init__(self, max_rows: int, prefill_chunk: int):
        if max_rows < 1 or prefill_chunk < 1:
            raise ValueError("max_rows and prefill_chunk must be >= 1")
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.prefilling: list[Sequence] = []
        self.decoding: list[Sequence] = []  # index == row
        self.owner: list[Sequence | None] = [None] * max_rows

    # --- queries -----------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    def __iter__(self):
        yield from self.decoding
        yield from self.prefilling
        yield from self.waiting

    # --- changes -----------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = WAITING
        queue_by_priority(self.waiting, seq)

    def schedule(self) -> ScheduleOutput:
        budget = self.prefill_chunk
        prefills: list[ScheduledPrefill] = []
        for seq in self.prefilling:
            if budget <= 0:
                break
            prefills.append(self._chunk(seq, budget))
            budget -= prefills[-1].length
        while budget > 0 and self.waiting and self.num_running() < self.max_rows:
            seq = self.waiting.popleft()
            seq.row = self._free_row()
            self.owner[seq.row] = seq
            seq.status = PREFILL
            self.prefilling.append(seq)
            prefills.append(self._chunk(seq, budget))
            budget -= prefills[-1].length
        return ScheduleOutput(decode=list(self.decoding), prefills=prefills)

    def promote(self, seq: Sequence) -> list[Move]:
        """Prefill done (and the first token sampled): move seq to row n_decode."""
        self.prefilling.remove(seq)
        target = len(self.decoding)
        moves: list[Move] = []
        src = seq.row
        if src != target:
            other = self.owner[target]
            if other is None:
                moves.append((src, target, seq.num_computed))
                self.owner[src] = None
            else:  # a prefilling request sits there: swap through the scratch row
                moves += [(src, -1, seq.num_computed), (target, src, other.num_computed),
                          (-1, target, seq.num_computed)]
                other.row = src
                self.owner[src] = other
        seq.row = target
        self.owner[target] = seq
        seq.status = DECODE
        self.decoding.append(seq)
        return moves

    def finish(self, seq: Sequence) -> tuple[list[Move], int | None]:
        """Remove seq wherever it is. Returns (moves, freed row or None)."""
        moves: list[Move] = []
        freed = None
        if seq.status == WAITING:
            self.waiting.remove(seq)
        elif seq.status == PREFILL:
            self.prefilling.remove(seq)
            self.owner[seq.row] = None
            freed = seq.row
        elif seq.status == DECODE:
            hole, last = seq.row, len(self.decoding) - 1
            tail = self.decoding.pop()
            if hole != last:
                moves.append((last, hole, tail.num_computed))
                self.decoding[hole] = tail
                tail.row = hole
                self.owner[hole] = tail
            self.owner[last] = None
            freed = last
        seq.status = FINISHED
        seq.row = -1
        return moves, freed

    # --- helpers -----------------------------------------------------------------

    def _chunk(self, seq: Sequence, budget: int) -> ScheduledPrefill:
        start = seq.num_computed
        length = min(len(seq.prompt) - start, budget)
        return ScheduledPrefill(seq, start, length, final=start + length == len(seq.prompt))

    def _free_row(self) -> int:
        for row in range(self.max_rows - 1, -1, -1):
            if self.owner[row] is None:
                return row
        raise RuntimeError("no free row")  # guarded by num_running() < max_rows
