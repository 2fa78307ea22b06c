"""Holding each running request's new tokens on the engine's side until its chunk is due
(docs/design.md §4, "Kafka behaviour").

The chunk policy (workers/generate/chunks.py `ChunkPolicy`) decides when a request's
pending tokens leave as a chunk. It used to be applied in the worker's process, which
then received every token of every step through the engine pipe and walked them one by
one, on the one core that also runs the Kafka loop. Applied here, on the engine's side
of the pipe (the engine process's outbox thread, workers/generate/engine_child.py
`Outbox`, or an engine thread in the worker's process: engine_thread.py), a step's tokens
are added to per-request lists and only the requests whose chunk is due cross over, each
as one `RequestOutput` with all its held tokens: at batch 256 the worker handles one
output per ~9 tokens (BENCHMARKS.md, "Tokens held on the engine's side").

What only the worker knows (whether its producer lags, how far behind its engine it is)
comes back as `tune(lagging, stretch)`. The worker publishes
every token it receives at once; its chunk builder still cuts a chunk at the stretched
policy's `max_tokens`.

A request's first token is due at once (time to first token) unless the producer lags,
as the policy says; every output that is more than one new token (an end, prompt
logprobs) leaves at once with the tokens held before it. The holder is used by one
thread at a time; `tune` may come from any.
"""

from __future__ import annotations

from itertools import repeat

import msgspec

from workers.generate.chunks import ChunkPolicy
from workers.generate.outputs import RequestOutput, StepCollector, StepOutputs


class Held:
    """One running request's tokens not yet handed on (the fields ChunkPolicy.due reads)."""

    __slots__ = ("request_id", "pending_ids", "pending_logprobs", "pending_since", "last_chunk_at", "last_token_at",
                 "sampled_at_ns", "closed")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.pending_ids: list[int] = []
        self.pending_logprobs: list = []  # aligned with pending_ids if the request asked for logprobs
        self.pending_since = 0.0  # when the first pending token reached the holder (monotonic)
        self.last_chunk_at = float("-inf")  # when tokens of it were last handed on
        self.last_token_at = float("-inf")  # when its previous token reached the holder
        self.sampled_at_ns = 0  # when its newest pending token was sampled (wall clock)
        self.closed = False  # (never: an ended request is forgotten; ChunkPolicy.due reads it)


class TokenHolder:
    def __init__(self, policy: ChunkPolicy):
        self.policy = policy
        self._stretched: dict[float, ChunkPolicy] = {1.0: policy}
        self._tuning = (False, policy)  # (lagging, the policy stretched): one tuple, swapped whole by tune()
        self.held: dict[str, Held] = {}  # by request id: every request that produced a token and has not ended
        self.holding = 0  # how many of them hold tokens now

    def tune(self, lagging: bool, stretch: float) -> None:
        """What the worker says of itself: its producer lags; how far to stretch chunks."""
        policy = self._stretched.get(stretch)
        if policy is None:
            policy = self._stretched[stretch] = self.policy.stretched(stretch)
        self._tuning = (lagging, policy)

    def step(self, outputs: StepOutputs, now: float) -> StepOutputs:
        """One engine step's outputs in; what leaves now out: the requests whose chunk is
        due, each with all its held tokens, and every other output of the step with the
        tokens held before it. `batch` is the engine step's size, `gap_s` the longest time
        between a request's previous token and this step's (for the worker's metrics)."""
        held, earliest, sampled_at, holding = self.held, now, outputs.sampled_at_ns, self.holding
        entries = outputs.logprobs if outputs.logprobs is not None else repeat(None)
        for request_id, token, entry in zip(outputs.request_ids, outputs.token_ids, entries):
            state = held.get(request_id)
            if state is None:
                state = held[request_id] = Held(request_id)
            elif state.last_token_at < earliest:
                earliest = state.last_token_at
            state.last_token_at = now
            pending = state.pending_ids
            if not pending:
                state.pending_since = now
                holding += 1
            pending.append(token)
            if entry is not None:
                state.pending_logprobs.append(entry)
            state.sampled_at_ns = sampled_at
        self.holding = holding
        leaving = StepCollector()
        leaving.sampled_at_ns = sampled_at
        for out in outputs.others:
            leaving.output(self._with_held(out, now))
        self._due(leaving, now, sampled_at)
        step = leaving.done()
        step.batch = len(outputs)
        step.gap_s = now - earliest
        return step

    def release(self, now: float) -> StepOutputs | None:
        """Between steps: the requests whose chunk has fallen due since (None: none)."""
        leaving = StepCollector()
        self._due(leaving, now, -1)
        return leaving.done() if leaving.others else None

    def wait_s(self, now: float) -> float:
        """Seconds until a held chunk falls due (inf: nothing held)."""
        lagging, policy = self._tuning
        interval = policy.interval(len(self.held))
        due = min((policy.due_at(len(s.pending_ids), s.pending_since, s.last_chunk_at, lagging, interval)
                   for s in self.held.values() if s.pending_ids), default=float("inf"))
        return max(0.0, due - now)

    def _due(self, leaving: StepCollector, now: float, sampled_at: int) -> None:
        """Hand on every request whose chunk is due at `now`. One that holds just this
        step's token (every request, at low load) goes in the step's columns, the cheap
        form to decode; one with more, as a RequestOutput of its own."""
        lagging, policy = self._tuning
        for state in policy.due(self.held.values(), now, lagging, policy.interval(len(self.held))):
            ids, entries = state.pending_ids, state.pending_logprobs
            if len(ids) == 1 and state.sampled_at_ns == sampled_at:
                leaving.token(state.request_id, ids[0], entries[0] if entries else None)
            else:
                leaving.output(RequestOutput(request_id=state.request_id, token_ids=tuple(ids),
                                             logprobs=tuple(entries) if entries else None,
                                             sampled_at_ns=state.sampled_at_ns, held_since=state.pending_since))
            state.pending_ids, state.pending_logprobs = [], []
            state.last_chunk_at = now
            self.holding -= 1

    def _with_held(self, out: RequestOutput, now: float) -> RequestOutput:
        """An output that leaves at once, after the tokens held for its request; an ended
        request is forgotten."""
        state = self.held.pop(out.request_id, None) if out.finish_reason is not None else self.held.get(out.request_id)
        if state is None:
            if out.token_ids and out.finish_reason is None:  # (a first token with prompt logprobs)
                state = self.held[out.request_id] = Held(out.request_id)
                state.last_chunk_at = state.last_token_at = now
            return out
        if out.finish_reason is None:
            state.last_chunk_at = state.last_token_at = now
        if not state.pending_ids:
            return out
        ids = state.pending_ids + list(out.token_ids)
        entries = state.pending_logprobs + list(out.logprobs or ())
        merged = msgspec.structs.replace(out, token_ids=tuple(ids), logprobs=tuple(entries) if entries else None,
                                         held_since=state.pending_since)
        state.pending_ids, state.pending_logprobs = [], []
        self.holding -= 1
        return merged
