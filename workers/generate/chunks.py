"""When a request's tokens leave as a chunk (the policy, applied by the engine's token
holder: token_holder.py), a running request's chunk state in the worker, and turning its
pending tokens into chunk records that fit (docs/design.md §3-4). No Kafka I/O and no
engine here: the handler takes chunks and publishes them."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

import msgspec
from aiokafka import TopicPartition

from schemas import ChunkError, GenerateChunk, GenerateRequest
from workers.generate.logprob_entries import logprobs_raw
from workers.kafka.offsets import Release
from workers.kafka.records import Outgoing
from workers.metrics import CHUNKS, TOKENS, series

PROMPT_TAIL = 8  # prompt ids sent on chunk 0 to seed the detokenizer (docs/design.md §3)
W = "generate"  # metrics label


@dataclass
class ChunkPolicy:
    """When to publish a request's pending tokens (docs/design.md §4 coalescing). Applied
    on the engine's side of the pipe (token_holder.py), which hands the worker only the
    tokens that are due; the worker tells it whether its producer lags and how far to
    stretch (`tune`), and cuts chunks at `max_tokens`.

    Every chunk record costs the same downstream whatever it holds (a result record, a
    producer send, ~60 µs of derender CPU: BENCHMARKS.md "Throughput"), so at high rates
    tokens are coalesced: each request publishes at most every `interval(running)`
    seconds, which keeps a worker near `max_records_per_s` chunk records per second
    whatever its batch (a batch of 16 is below it and publishes every step; a batch of
    256 at 2 ms steps publishes every ~26 ms, capped by `max_delay_s`). Independently, a
    producer with more than `lag_threshold` unacknowledged records coalesces as much as
    `max_tokens` / `max_delay_s` allow.

    A worker that falls behind its engine (`Pressure`) is stretched (`stretched`): its
    chunks are spaced, held and sized up to `saturated_stretch` times more until it keeps
    up again: fewer records carry the same tokens, and every record costs the worker and
    its derender the same whatever it holds. Saturated, tokens wait in its queues
    anyway: measured at batch 256 on 2 cores, 2-3.5x fewer chunk records did not raise
    the newest token's age p99 (BENCHMARKS.md, "Coalescing under saturation")."""

    lag_threshold: int = 64  # unacknowledged records above which the producer "lags"
    max_tokens: int = 16  # at most this many tokens per chunk while coalescing
    max_delay_s: float = 0.02  # never hold a token longer than this
    max_records_per_s: float = 10_000.0  # the chunk rate a worker aims to stay under (0: no aim)
    saturated_stretch: float = 4.0  # at full pressure: chunks this many times rarer and bigger (1: never)

    def stretch(self, pressure: float) -> float:
        """How much to stretch at `pressure` (0: keeping up with the engine, 1: behind at
        every step): from 1 up to `saturated_stretch`, linearly, in quarters (so a worker
        holds a few stretched policies, not one per step)."""
        if pressure <= 0.0 or self.saturated_stretch <= 1.0:
            return 1.0
        return 1.0 + round(4 * (self.saturated_stretch - 1.0) * min(1.0, pressure)) / 4

    def stretched(self, stretch: float) -> ChunkPolicy:
        """This policy with `max_tokens` and `max_delay_s` times `stretch` and the rate aim
        divided by it (itself at 1)."""
        if stretch == 1.0:
            return self
        return replace(self, max_tokens=round(self.max_tokens * stretch), max_delay_s=self.max_delay_s * stretch,
                       max_records_per_s=self.max_records_per_s / stretch, saturated_stretch=1.0)

    def interval(self, running: int) -> float:
        """The shortest time between two chunks of one request with `running` requests.
        Not capped here: `due_at` caps how long a token waits (max_delay_s from the first
        pending one, which comes a step after the previous chunk), and a cap here too
        would space chunks a step closer than the aim at large batches (measured: 18%
        more chunks at batch 256, each paid for downstream)."""
        if self.max_records_per_s <= 0:
            return 0.0
        return running / self.max_records_per_s

    def due_at(self, pending: int, first_pending_at: float, last_chunk_at: float, lagging: bool,
               interval_s: float) -> float:
        """When a request's `pending` tokens (the first sampled at `first_pending_at`) are
        to leave, on the monotonic clock; at or before now means now. The rate aim spaces
        a request's chunks by `interval_s` counted from its previous chunk (`last_chunk_at`,
        -inf before the first), not from its first pending token: a token sampled long
        after the previous chunk leaves at once instead of waiting out a fresh interval
        (which held low-load tokens for the next loop turn, up to 20 ms). A lagging
        producer holds tokens up to `max_tokens` / `max_delay_s` whatever the rate."""
        if pending >= self.max_tokens:
            return first_pending_at
        latest = first_pending_at + self.max_delay_s
        if lagging:
            return latest
        return min(latest, max(first_pending_at, last_chunk_at + interval_s))

    def due(self, states: Iterable[InFlight], now: float, lagging: bool, interval_s: float) -> list[InFlight]:
        """The open requests among `states` with pending tokens that are due at `now`:
        `due_at(...) <= now` for each, without a call per request (the holder asks this for
        every running request at every step: the calls were ~5% of a loop at batch 256;
        tests/test_chunk_policy.py checks the two agree). A pending token was sampled at or
        before now, so `max(first_pending_at, last_chunk_at + interval_s) <= now` is
        `last_chunk_at + interval_s <= now`."""
        max_tokens, max_delay_s = self.max_tokens, self.max_delay_s
        due = []
        for state in states:
            pending = state.pending_ids
            if not pending or state.closed:
                continue
            if (len(pending) < max_tokens and state.pending_since + max_delay_s > now
                    and (lagging or state.last_chunk_at + interval_s > now)):
                continue  # held: it leaves at a later step (or the holder's tick)
            due.append(state)
        return due


class Pressure:
    """How far a worker is behind its engine, 0..1: a moving average, over recent engine
    steps, of whether a step arrived while `busy_at` or more earlier steps were still
    being published. A worker keeping up finishes a step's publishing before the next
    step comes (0 or 1 under way); one that falls behind has several waiting (the engine
    is held at 4: workers/generate/service.py). `weight` per step: 0.05 forgets in ~20
    steps (~60 ms at batch-256 speed), so a burst stretches chunks briefly, not for good."""

    def __init__(self, busy_at: int = 2, weight: float = 0.05):
        self.busy_at = busy_at
        self.weight = weight
        self.value = 0.0

    def step(self, publishing: int) -> float:
        """One engine step arrived with `publishing` earlier publish steps not done."""
        self.value += self.weight * ((1.0 if publishing >= self.busy_at else 0.0) - self.value)
        return self.value


@dataclass
class InFlight:
    """One request between its record and its final chunk."""

    request: GenerateRequest
    tp: TopicPartition
    offset: int  # of the request record (chunk seq 0 carries it as request_offset)
    release: Release  # lets the loop commit past the request record (once its final chunk is acked)
    attempt: str = field(default_factory=lambda: os.urandom(8).hex())  # 16 hex digits, as before
    seq: int = 0
    token_offset: int = 0  # output index of the first pending token
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list = field(default_factory=list)
    pending_since: float = 0.0  # when the first pending token reached the engine's holder, or else the worker (monotonic)
    prompt_logprobs: list | None = None
    sampled_at_ns: int | None = None
    closed: bool = False  # the final chunk is taken: nothing may follow it
    received_at: float = field(default_factory=time.monotonic)


@dataclass
class Final:
    """How a request ends: what its last chunk carries."""

    finish_reason: str
    error: ChunkError | None = None
    stop_token_id: int | None = None


# The fewest bytes a prompt position's logprobs take in a chunk (msgpack maps): the prompt
# token's entry (`GenerateLogProbsContent`), and each of its top entries (`GenerateLogProb`).
MIN_PROMPT_ENTRY_BYTES = 48
MIN_TOP_ENTRY_BYTES = 34


class ChunkBuilder:
    def __init__(self, topic: str, fits: Callable[[Outgoing], bool], max_record_bytes: int):
        self.topic = topic
        self.fits = fits
        self.max_record_bytes = max_record_bytes
        # Counted here, added to the metrics once per publish step (count_taken): two
        # counter increments per chunk were ~3% of the worker's loop at high rates.
        self.chunks_taken = self.tokens_taken = 0

    def count_taken(self) -> None:
        if self.chunks_taken:
            series(CHUNKS, W).inc(self.chunks_taken)
            series(TOKENS, W).inc(self.tokens_taken)
            self.chunks_taken = self.tokens_taken = 0

    def take(self, state: InFlight, final: Final | None, max_tokens: int) -> tuple[list[Outgoing], str | None]:
        """All of the request's pending tokens as chunk records; the last one carries
        `final`. A chunk holds at most `max_tokens` (the policy's in use, stretched or
        not) tokens: they pile up past that
        while a publish is under way (steps keep coming), and are cut here. A chunk over
        the record size limit (many logprobs) is cut smaller; one that cannot be (a single
        token's, or the prompt's, logprobs) ends the request with an error chunk, which
        the broker would otherwise refuse after the work was done. Returns the records and,
        in that case, the error's message."""
        size = max(1, max_tokens)
        records = []
        while True:
            count = min(size, len(state.pending_ids))
            while True:
                last = count == len(state.pending_ids)
                record = self._outgoing(state, self._chunk(state, count, final if last else None))
                fits = self.fits(record)
                if fits or count <= 1:
                    break
                count //= 2
            if not fits:
                message, record = self._too_large(state, record.size())
                records.append(record)
                return records, message
            self._advance(state, count)
            records.append(record)
            if last:
                return records, None

    def _chunk(self, state: InFlight, count: int, final: Final | None) -> GenerateChunk:
        """The first `count` pending tokens as the request's next chunk (state unchanged).
        Built with the fields every chunk has; the final and seq-0 ones are set only on
        the chunks that carry them (17 keyword arguments cost ~2.3 µs a chunk, 6 ~0.5)."""
        request = state.request
        token_ids = state.pending_ids[:count]
        chunk = GenerateChunk(
            request_id=request.request_id, attempt=state.attempt, seq=state.seq,
            token_offset=state.token_offset, token_ids=token_ids,
            sampled_at_ns=state.sampled_at_ns or time.time_ns())
        if request.sampling.logprobs is not None and token_ids:
            chunk.logprobs = logprobs_raw(state.pending_logprobs[:count])  # encoded by the engine
        if final is not None:
            chunk.finish_reason, chunk.stop_token_id, chunk.error = final.finish_reason, final.stop_token_id, final.error
        if state.seq == 0:  # the prompt's facts and the options derender needs
            chunk.prompt_token_count = len(request.prompt_token_ids)
            chunk.prompt_tail_ids = request.prompt_token_ids[-PROMPT_TAIL:]
            chunk.prompt_logprobs = state.prompt_logprobs
            chunk.output = request.output
            chunk.reply_topic = request.reply_topic
            chunk.request_offset = state.offset
            if request.output.echo or request.output.prompt_logprobs is not msgspec.UNSET:
                chunk.prompt_token_ids = request.prompt_token_ids
        return chunk

    def _advance(self, state: InFlight, count: int) -> None:
        """The chunk of the first `count` pending tokens is taken: number the next one."""
        self.chunks_taken += 1
        self.tokens_taken += count
        state.seq += 1
        state.token_offset += count
        del state.pending_ids[:count], state.pending_logprobs[:count]

    def prompt_logprobs_problem(self, request: GenerateRequest) -> str | None:
        """Why a request's prompt logprobs cannot fit its first chunk, known before its
        prefill, or None. Found after it (`_too_large`), a long prompt's took the whole
        prefill, and ~25 MB of them for 32,000 tokens at k = 21 were decoded on the
        worker's event loop (0.1 s, every request's tokens waiting), only to be refused.
        Counted low (msgpack: the prompt token's entry takes 48 bytes or more, each of at
        least k - 1 top entries 34), so a request that fits is never refused here."""
        k = request.sampling.prompt_logprobs
        if k is None:
            return None
        least = (len(request.prompt_token_ids) - 1) * (MIN_PROMPT_ENTRY_BYTES + MIN_TOP_ENTRY_BYTES * max(k - 1, 0))
        if least <= self.max_record_bytes:
            return None
        return (f"sampling.prompt_logprobs: a prompt of {len(request.prompt_token_ids)} tokens with {k} candidates "
                f"a position takes at least {least} bytes in a chunk, over the record size limit of "
                f"{self.max_record_bytes} bytes; ask for fewer prompt logprobs, or send a shorter prompt")

    def _too_large(self, state: InFlight, size: int) -> tuple[str, Outgoing]:
        """The error chunk that ends a request whose next chunk cannot be published. A
        first chunk too large without any token (its prompt's ids, echoed, near the
        limit) is too without them: its error goes without them too (the error needs
        none of the prompt), and says so."""
        first, fix = state.seq == 0, "ask for fewer logprobs"
        if first and state.prompt_logprobs:
            what = "the prompt's logprobs"
        elif first and not self.fits(self._outgoing(state, self._chunk(state, 0, None))):
            what, fix = "the prompt's token ids (sent back for echo or prompt logprobs)", "send a shorter prompt"
        else:
            what = "one token's logprobs"
        message = (f"chunk too large: {what} encode to {size} bytes, over the record size limit of "
                   f"{self.max_record_bytes} bytes; {fix} (or raise the "
                   f"workers' --max-record-bytes together with the broker's message.max.bytes)")
        state.pending_ids, state.pending_logprobs, state.prompt_logprobs = [], [], None
        chunk = self._chunk(state, 0, Final("error", ChunkError(message=message)))
        if first and not self.fits(self._outgoing(state, chunk)):
            chunk.prompt_token_ids = None
        self._advance(state, 0)
        return message, self._outgoing(state, chunk)

    def _outgoing(self, state: InFlight, chunk: GenerateChunk) -> Outgoing:
        # Same partition number as the request: one request's records stay on one
        # partition number end to end (docs/design.md §2), whatever partitioner the client used.
        return Outgoing(self.topic, state.request.request_id, chunk, partition=state.tp.partition)
