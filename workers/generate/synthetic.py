"""A synthetic engine: GPU-like step times with no model, for fleet and throughput
benchmarks (`genpipe generate-worker --engine synthetic --step-ms S --max-batch B`).

Like vLLM's dummy weights, it is a benchmarking tool and never a default: it runs the
real worker, Kafka and derender path while the "model" costs nothing but a fixed step
time. Each step takes `step_s` (measured from the step's start) and gives every running
request its next token, up to `max_batch` requests at once (the rest wait in order).
Tokens are a deterministic function of (request id, position), never a special id, so a
benchmark can check every answer (or, with `tokens="prompt"`, the request's prompt ids
over and over: a benchmark's own text, ASCII or CJK, through the derender); logprobs,
when asked, have the wire shape with made-up values. A request ends with "length" at
`max_tokens` (or the context), with "stop" on one of its `stop_token_ids` once
`min_tokens` are out, or with "abort" (cancel, deadline).
Same interface as `Engine` (add/abort from any thread; has_work/step from one).
"""

from __future__ import annotations

import time
import zlib
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from schemas.records import GenerateRequest
from schemas.validation import DEFAULT_MAX_LOGPROBS
from workers.generate.admission import queue_by_priority
from workers.generate.inbox import Inbox
from workers.generate.logprob_entries import RowLogprobs
from workers.generate.logprob_wire import PendingEntry, StepEntries, pending_entries
from workers.generate.model_runner import ModelInfo
from workers.generate.outputs import RequestOutput, StepCollector, StepOutputs

# How output tokens are chosen: "hash" (synthetic_token) or "prompt" (the prompt's ids,
# repeated: whatever text the benchmark chose, special ids included if it sent any).
TOKEN_RULES = ("hash", "prompt")
FIRST_ORDINARY_ID = 3  # the tiny vocabularies' specials are 0..2 (spm) or the last id (byte-level)


def synthetic_token(request_id: str, index: int, vocab_size: int) -> int:
    """The `index`-th output token of a request: deterministic, never a special id."""
    span = vocab_size - FIRST_ORDINARY_ID - 1
    return FIRST_ORDINARY_ID + (zlib.crc32(request_id.encode()) + 7919 * index) % span


def synthetic_row(token_id: int, k: int, vocab_size: int) -> RowLogprobs:
    """One position's logprobs in the real engine's row form (`.content()` is the wire
    form): the token at rank 1, then k-1 neighbours (prompt logprobs)."""
    others = [(token_id + j) % vocab_size for j in range(1, k)]
    return RowLogprobs(token_id, 1, -0.5, [token_id, *others], [-0.5 - j for j in range(k)])


def synthetic_entries(token_ids: list[int], ks: list[int], vocab_size: int) -> list[PendingEntry]:
    """`synthetic_row`'s entries for a step's rows (row i: token_ids[i], with ks[i] top
    entries), encoded as the real engine encodes a step's (logprob_wire.py: `bytes(entry)`,
    the whole step at once when first asked for), so the engine child and the worker pay
    what they pay for a model's logprobs."""
    n, k_max = len(token_ids), max(ks)
    tokens = np.asarray(token_ids, dtype=np.int64)
    slots = np.arange(k_max, dtype=np.int64)
    top_ids = (tokens[:, None] + slots) % vocab_size
    top_values = np.broadcast_to(-0.5 - slots.astype(np.float64), (n, k_max))
    step = StepEntries(tokens, np.ones(n, dtype=np.int64), np.full(n, -0.5), top_ids, top_values, ks, vocab_size)
    return pending_entries(step, n)


@dataclass
class _Running:
    request: GenerateRequest
    max_output: int
    produced: int = 0
    first: bool = True
    stop_ids: frozenset = field(default_factory=frozenset)
    tier: int = 0  # 0 interactive, 1 bulk (admission.py)


class SyntheticEngine:
    def __init__(self, *, step_s: float = 0.002, max_batch: int = 256, vocab_size: int = 2000,
                 max_model_len: int = 2048, max_logprobs: int = DEFAULT_MAX_LOGPROBS, tokens: str = "hash"):
        if tokens not in TOKEN_RULES:
            raise ValueError(f"tokens must be one of {', '.join(TOKEN_RULES)}, got {tokens!r}")
        self.step_s = step_s
        self.tokens = tokens
        self.max_batch = max_batch
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.info = ModelInfo(vocab_size, max_model_len, [], "synthetic")
        self.native = True
        self.steps = 0
        self._inbox = Inbox()
        self._waiting: deque[_Running] = deque()
        self._running: dict[str, _Running] = {}
        # Requests with a deadline, and when: only those are checked each step (a scan of
        # every request was ~7% of the engine process's CPU at batch 256).
        self._deadlines: dict[str, int] = {}

    # --- any thread ----------------------------------------------------------------

    def add(self, request: GenerateRequest, *, validated: bool = False, tier: int = 0) -> None:
        self._inbox.add(request, validated=validated, tier=tier, max_logprobs=self.max_logprobs,
                        vocab_size=self.vocab_size, max_model_len=self.max_model_len)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self._inbox.abort(request_id, reason)

    def has_work(self) -> bool:
        return bool(self._inbox or self._waiting or self._running)

    # --- the stepping thread ---------------------------------------------------------------

    def num_running(self) -> int:
        return len(self._running)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def step(self) -> StepOutputs:
        started = time.monotonic()
        outputs = StepCollector()
        self._drain_inbox(outputs)
        self._expire(outputs)
        while self._waiting and len(self._running) < self.max_batch:
            state = self._waiting.popleft()
            self._running[state.request.request_id] = state
        if not self._running:
            return outputs.done()
        self.steps += 1
        wait = self.step_s - (time.monotonic() - started)
        if wait > 0:
            time.sleep(wait)  # the "model": a fixed step time, GIL released
        now_ns = outputs.sampled_at_ns = time.time_ns()
        # (where its entry goes: a column index or an output, token, k): logprobs, a step at a time
        asking: list[tuple[int | RequestOutput, int, int]] = []
        for rid, state in list(self._running.items()):
            p = state.request.sampling
            if state.max_output == 0:  # max_tokens 0: the prompt only
                out = RequestOutput(request_id=rid, token_ids=[], finish_reason="length",
                                    num_prompt_tokens=len(state.request.prompt_token_ids), sampled_at_ns=now_ns)
                out.prompt_logprobs = self._prompt_logprobs(state.request)
                outputs.output(out)
                self._finish(state.request)
                continue
            if self.tokens == "prompt":
                prompt = state.request.prompt_token_ids
                token = prompt[state.produced % len(prompt)]
            else:
                token = synthetic_token(rid, state.produced, self.vocab_size)
            state.produced += 1
            finish, stop_id = None, None
            if state.produced >= state.max_output:
                finish = "length"
            elif token in state.stop_ids and state.produced >= p.min_tokens:
                finish, stop_id = "stop", token
            prompt_logprobs = None
            if state.first:
                state.first = False
                prompt_logprobs = self._prompt_logprobs(state.request)
            if finish is None and prompt_logprobs is None:
                where = outputs.token(rid, token)  # the usual output: a column entry
            else:
                where = RequestOutput(request_id=rid, token_ids=[token], finish_reason=finish,
                                      stop_token_id=stop_id, num_prompt_tokens=len(state.request.prompt_token_ids),
                                      num_output_tokens=state.produced, sampled_at_ns=now_ns,
                                      prompt_logprobs=prompt_logprobs)
                outputs.output(where)
            k = p.logprobs
            if k is not None:
                asking.append((where, token, self.vocab_size if k == -1 else max(k, 1)))
            if finish is not None:
                self._finish(state.request)
        if asking:
            wheres, tokens, ks = zip(*asking)
            for where, entry in zip(wheres, synthetic_entries(list(tokens), list(ks), self.vocab_size)):
                if type(where) is int:
                    outputs.set_entry(where, entry)
                else:
                    where.logprobs = [entry]
        return outputs.done()

    def _prompt_logprobs(self, request: GenerateRequest) -> list | None:
        k = request.sampling.prompt_logprobs
        if k is None:
            return None
        return [None] + [synthetic_row(t, max(k, 1), self.vocab_size).content() for t in request.prompt_token_ids[1:]]

    def _drain_inbox(self, outputs: StepCollector) -> None:
        for item in self._inbox.take():
            if item[0] == "add":
                request = item[1]
                room = self.max_model_len - len(request.prompt_token_ids)
                max_tokens = request.sampling.max_tokens
                queue_by_priority(self._waiting, _Running(
                    request, room if max_tokens is None else min(max_tokens, room),
                    stop_ids=frozenset(request.sampling.stop_token_ids), tier=item[2]))
                if request.deadline_ms is not None:
                    self._deadlines[request.request_id] = request.deadline_ms
            else:
                _, rid, reason = item
                self._deadlines.pop(rid, None)
                state = self._running.pop(rid, None) or self._take_waiting(rid)
                if state is not None:
                    outputs.output(self._final(state, reason if reason in ("abort", "error") else "abort"))

    def _expire(self, outputs: StepCollector) -> None:
        if not self._deadlines:
            return
        now_ms = time.time() * 1000
        for rid in [rid for rid, deadline in self._deadlines.items() if deadline <= now_ms]:
            state = self._running.pop(rid, None) or self._take_waiting(rid)
            self._deadlines.pop(rid, None)
            if state is not None:
                outputs.output(self._final(state, "abort"))
                self._finish(state.request)

    def _take_waiting(self, rid: str) -> _Running | None:
        for state in self._waiting:
            if state.request.request_id == rid:
                self._waiting.remove(state)
                return state
        return None

    def _final(self, state: _Running, reason: str) -> RequestOutput:
        return RequestOutput(request_id=state.request.request_id, token_ids=[], finish_reason=reason,
                             num_prompt_tokens=len(state.request.prompt_token_ids),
                             num_output_tokens=state.produced, sampled_at_ns=time.time_ns())

    def _finish(self, request: GenerateRequest) -> None:
        rid = request.request_id
        if (state := self._running.get(rid)) is not None and state.request is request:
            del self._running[rid]
        self._deadlines.pop(rid, None)
        self._inbox.finished(request)
