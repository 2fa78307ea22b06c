"""Per-request state machine of the derender worker (docs/design.md §5.5).

`Derenderer.process(chunk)` is pure and synchronous: one decoded `GenerateChunk` in,
a list of outputs (`Result` records to publish, `CancelRequest`s for the cancel topic)
out, in the order they must be published. The Kafka layer wraps it; it never needs to
look inside a request's state except through `is_active()` / `is_finished()` (and
`active_requests()`, the ids whose first offsets pin commits).

Rules, in the order they are applied to a chunk:
1. A request in the recently-finished set ignores every later chunk (any attempt), but
   for seq 0 of a *different request record* (`request_offset`): a re-used
   `request_id` gets an `invalid_request_error` (and a cancel), never silence.
2. Attempts: a chunk of a superseded attempt is dropped; seq 0 of a new attempt for an
   unfinished request resets the state and its first result carries
   `genpipe-restart: 1`; any other chunk of an unknown attempt is a seq gap.
3. Duplicates: a seq already processed in the current attempt is dropped.
4. A chunk that breaks the rules (seq gap, token id out of vocab, logprobs not aligned
   with token_ids, more top entries than max_logprobs, token_offset not where the output
   is) ends the request with an OpenAI error result (and a cancel, so generate stops).
5. Otherwise: text (with stop strings) and logprobs; one result per chunk when
   streaming, one final result otherwise. A stop-string match cuts the text, finishes
   with `stop`, and asks generate to cancel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Union

import msgspec

from schemas.headers import HEADER_ATTEMPT, HEADER_ERROR, HEADER_FINAL, HEADER_RESTART, HEADER_SEQ
from schemas.openai import CompletionLogProbs, ResultRecord
from schemas.records import GenerateChunk, OutputOptions
from schemas.validation import DEFAULT_MAX_LOGPROBS
from workers.derender import shaping
from workers.derender.chunk_rules import check_chunk, output_problem, prompt_problem
from workers.derender.correction import Corrector
from workers.derender.detokenizer import Detokenizer, StopMatcher
from workers.derender.logprobs_step import BadChunk, chunk_logprobs
from workers.derender.vocab import VocabTables, load_tables
from workers.log_digest import LogDigest

log = logging.getLogger(__name__)

# `model` in results when the request names none; the same in the worker, file mode and
# replay, so a replay or a file-mode run reproduces the worker's records byte for byte.
DEFAULT_MODEL_NAME = "genpipe-tiny"



class Result(msgspec.Struct):
    """One record for the results topic (or the request's reply_topic when set)."""

    request_id: str
    reply_topic: str | None
    value: ResultRecord
    headers: dict[str, str]  # genpipe-attempt, genpipe-seq, [genpipe-final], [genpipe-restart]
    final: bool


class CancelRequest(msgspec.Struct):
    """Ask generate to stop a request (publish a `Cancel` on the cancel topic)."""

    request_id: str
    reason: str


Output = Union[Result, CancelRequest]


@dataclass(slots=True)
class Stats:
    chunks: int = 0
    results: int = 0
    dropped_finished: int = 0
    dropped_superseded: int = 0
    dropped_duplicate: int = 0
    dropped_unknown: int = 0
    restarts: int = 0
    rule_errors: int = 0
    render_failures: int = 0  # chunks whose rendering raised (the request ended with an error)
    stop_matches: int = 0
    stalled: int = 0  # requests ended because their chunks stopped coming (stalls.py)


# The fewest bytes a position's logprobs take in a result's JSON: a completion's `"",` for
# its token, `0.0,` for its logprob, `{},` for its top entries, `0,` for its text offset;
# a chat's `{"token":"","logprob":0.0,"bytes":[]},` for itself and each top entry (an
# empty token's bytes are `[]`). The size a request not streamed has reached is counted
# low with them, so it never ends one that would fit.
MIN_COMPLETION_POSITION_BYTES = 12
MIN_CHAT_ENTRY_BYTES = 38


@dataclass(slots=True, eq=False)
class RequestState:
    """One request being derendered: what its seq-0 chunk said, and where its text and
    logprobs have got to. The steps of `Derenderer._render` (text, logprobs, shaping)
    each read and advance their part of it, as vLLM's RequestState composes its
    detokenizer and logprobs processor."""

    attempt: str
    superseded: set[str]  # attempts a later one replaced: their chunks are dropped
    restart: bool  # the next result carries genpipe-restart
    opts: OutputOptions
    reply_topic: str | None
    request_offset: int | None  # of the request record (a re-used id has another)
    created: int
    model: str
    prompt_tokens: int
    detok: Detokenizer
    stop: StopMatcher | None
    chat: bool
    stream: bool
    k: int  # user-facing top_logprobs
    next_seq: int = 0
    generated: int = 0  # output ids so far (usage)
    hist: list[int] = field(default_factory=list)  # recent sampled ids: the correction context
    offset: int = 0  # completion logprobs: text_offset so far
    first: bool = True  # nothing published yet (a chat stream's role goes on the first)
    has_lp: bool = False  # logprobs were asked for (seen on a chunk)
    parts: list[str] = field(default_factory=list)  # not streamed: the text so far
    chat_lp: list = field(default_factory=list)  # not streamed, chat: the logprob entries so far
    comp_lp: CompletionLogProbs = field(default_factory=CompletionLogProbs)  # not streamed, completion
    held_bytes: int = 0  # not streamed: fewer than the bytes its result will take (`_shape`)
    echo_text: str = ""  # echo: the prompt's text, in front of the first result's text
    echo_lp: CompletionLogProbs | None = None  # echo, streamed: the prompt's logprobs, in the first result
    prompt_lp: list | msgspec.UnsetType = msgspec.UNSET  # not streamed: vLLM's prompt_logprobs field
    prompt_problem: str | None = None  # seq 0's `prompt_problem`, found once (for check_chunk too)


class Derenderer:
    """Chunks in, OpenAI-shaped results out. Not thread-safe; one per consumer (or per
    partition: pass the same `VocabTables`/`Corrector` to share tables and cache)."""

    def __init__(self, tokenizer_dir_or_tables, *, model_name: str = DEFAULT_MODEL_NAME,
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                 finished_memory: int = 100_000, corrector: Corrector | None = None,
                 max_result_bytes: int | None = None):
        if isinstance(tokenizer_dir_or_tables, VocabTables):
            tables = tokenizer_dir_or_tables
        elif hasattr(tokenizer_dir_or_tables, "decode_batch"):  # a tokenizers.Tokenizer
            tables = VocabTables(tokenizer_dir_or_tables)
        else:
            tables = load_tables(tokenizer_dir_or_tables)
        self.tables = tables
        self.corrector = corrector if corrector is not None else Corrector(tables)
        self.model_name = model_name
        # -1 (or any negative) means "the whole vocabulary", as for generate's setting.
        self.max_logprobs = max_logprobs if max_logprobs >= 0 else tables.size
        self.finished_memory = finished_memory
        # A request not streamed that will not fit a record of this size ends as soon as
        # that is certain (`_shape`); None: at its end, by the Kafka layer's rule.
        self.max_result_bytes = max_result_bytes
        self._active: dict[str, RequestState] = {}
        # request id -> its request record's offset; insertion-ordered: oldest evicted first
        self._finished: dict[str, int | None] = {}
        self.stats = Stats()
        self.render_failures = LogDigest(log, logging.ERROR, "chunks that could not be rendered")
        # Requests ended with an error their client can mend (a reply topic refused, a
        # result too large): a client's requests can come in a flood, one line each
        self.answered_with_errors = LogDigest(log, logging.WARNING, "requests answered with an error")

    def flush_logs(self) -> None:
        """Say how many lines the digests held back (a worker's shutdown, a replay's end)."""
        self.render_failures.flush()
        self.answered_with_errors.flush()

    # --- what the Kafka layer needs --------------------------------------------------
    def active_requests(self) -> list[str]:
        """Ids of requests started but not finished (their first offsets pin commits)."""
        return list(self._active)

    def is_active(self, request_id: str) -> bool:
        return request_id in self._active

    def is_finished(self, request_id: str) -> bool:
        return request_id in self._finished

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop all state of these requests (e.g. their partition was revoked)."""
        for rid in request_ids:
            self._active.pop(rid, None)
            self._finished.pop(rid, None)

    def reset(self) -> None:
        """Drop all state (all partitions revoked); tables and cache stay."""
        self._active.clear()
        self._finished.clear()

    def fail(self, result: Result, message: str, kind: str = "server_error", code: int = 500) -> list[Output]:
        """`result` cannot be delivered (the Kafka layer found it over the record size
        limit): an error result in its place ends the request (same attempt and seq
        headers, final), and generate is asked to stop if the request was still running."""
        rid = result.request_id
        self.stats.rule_errors += 1
        value = shaping.error_response(f"derender: {message}", kind, code)
        out: list[Output] = [Result(rid, result.reply_topic, value, {**result.headers, HEADER_FINAL: "1"}, True)]
        if not result.final:
            req = self._active.get(rid)
            self._mark_finished(rid, req.request_offset if req is not None else None)
            out.append(CancelRequest(rid, f"derender error: {message}"))
        return out

    def end_stalled(self, rid: str, timeout_s: float) -> list[Output]:
        """No chunk of `rid` came for `timeout_s` of its partition's log time while other
        requests' went on (workers/derender/stalls.py): an error result ends it (the next
        seq of its attempt, final) and generate is asked to stop it, if it still runs it.
        A later chunk of it is a finished request's: dropped. None for a request not open."""
        req = self._active.get(rid)
        if req is None:
            return []
        self.stats.stalled += 1
        message = (f"derender: no output for request {rid!r} for {timeout_s:g} s of its partition's log "
                   f"while other requests' went on (generation stalled, or its chunks were lost); "
                   f"it ends here: send it again")
        headers = {HEADER_ATTEMPT: req.attempt, HEADER_SEQ: str(req.next_seq), HEADER_FINAL: "1"}
        if req.restart:
            headers[HEADER_RESTART] = "1"
        self.stats.results += 1
        self._mark_finished(rid, req.request_offset)
        return [Result(rid, req.reply_topic, shaping.error_response(message), headers, True),
                CancelRequest(rid, f"derender: no chunk for {timeout_s:g} s")]

    # --- the state machine -----------------------------------------------------------
    def process(self, chunk: GenerateChunk) -> list[Output]:
        """The outputs of one chunk. A chunk the rules below let through and rendering
        still fails on (a rule missing: a prompt candidate past the vocabulary once
        raised IndexError here, and stopped every derender that read it, over and over)
        ends its request with an error result, logged with its traceback: one request
        lost, not the partition."""
        try:
            return self._process(chunk)
        except Exception as exc:
            rid = chunk.request_id
            self.stats.render_failures += 1
            self.render_failures.log("request %r: chunk seq %s of attempt %r could not be rendered; the request "
                                     "ends with an error", rid, chunk.seq, chunk.attempt, exc_info=True)
            return self._fail(rid, self._active.get(rid), chunk, f"could not be rendered ({exc!r})")

    def _process(self, chunk: GenerateChunk) -> list[Output]:
        self.stats.chunks += 1
        rid = chunk.request_id
        if rid in self._finished:
            if chunk.seq == 0 and _other_record(self._finished[rid], chunk.request_offset):
                return self._reused(rid, chunk)
            self.stats.dropped_finished += 1
            return []
        req = self._active.get(rid)
        if req is None:
            if chunk.seq != 0:
                # The worker commits at the first offset of every unfinished request, so it
                # never starts reading in the middle of one: a request first seen past seq 0
                # finished before the replay point (a straggler of a superseded attempt).
                # Answering it again would publish a second final for a finished request.
                self.stats.dropped_unknown += 1
                return []
            problem = output_problem(chunk, self.max_logprobs)
            if problem is not None:
                return self._fail(rid, None, chunk, problem)
            req = self._start(chunk, restart=False, superseded=set())
        elif chunk.attempt != req.attempt:
            if chunk.attempt in req.superseded:
                self.stats.dropped_superseded += 1
                return []
            if chunk.seq != 0:
                return self._fail(rid, req, chunk, f"seq gap: first chunk seen of attempt "
                                  f"{chunk.attempt!r} has seq {chunk.seq}, expected 0")
            problem = output_problem(chunk, self.max_logprobs)
            if problem is not None:
                return self._fail(rid, req, chunk, problem)
            req.superseded.add(req.attempt)
            self.stats.restarts += 1
            req = self._start(chunk, restart=True, superseded=req.superseded)
        elif chunk.seq != req.next_seq:
            if chunk.seq < req.next_seq:
                self.stats.dropped_duplicate += 1
                return []
            return self._fail(rid, req, chunk, f"seq gap in attempt {chunk.attempt!r}: "
                              f"got seq {chunk.seq}, expected {req.next_seq}")
        problem = check_chunk(chunk, self.tables.size, self.max_logprobs, req.generated,
                              req.k if req.chat else 0, "chat" if req.chat else "completion",
                              prompt=req.prompt_problem if chunk.seq == 0 else None)
        if problem is not None:
            return self._fail(rid, req, chunk, problem)
        req.next_seq = chunk.seq + 1
        if chunk.finish_reason == "error":
            err = chunk.error
            kind = err.type if err is not None else "server_error"
            value = shaping.error_response(
                err.message if err is not None else "generation failed",
                kind, 400 if kind == "invalid_request_error" else 500)
            return [self._finish(req, rid, chunk, value)]
        try:
            return self._render(req, rid, chunk)
        except BadChunk as exc:
            return self._fail(rid, req, chunk, str(exc))

    def _start(self, chunk: GenerateChunk, *, restart: bool, superseded: set) -> RequestState:
        opts = chunk.output or OutputOptions()
        tail = chunk.prompt_tail_ids or ()
        if any(not 0 <= t < self.tables.size for t in tail):
            tail = ()  # reported by check_chunk; do not crash seeding on it
        stops = [s for s in opts.stop if s]
        req = RequestState(
            attempt=chunk.attempt, superseded=superseded, restart=restart, opts=opts,
            reply_topic=chunk.reply_topic, request_offset=chunk.request_offset,
            created=opts.created if opts.created is not None else (chunk.sampled_at_ns or 0) // 10**9,
            model=opts.model or self.model_name, prompt_tokens=chunk.prompt_token_count or 0,
            detok=Detokenizer(self.tables, skip_special_tokens=opts.skip_special_tokens, prompt_tail=tail),
            stop=StopMatcher(stops, opts.include_stop_str_in_output) if stops else None,
            chat=opts.kind == "chat", stream=opts.stream, k=max(0, opts.top_logprobs))
        echo = chunk.prompt_token_ids
        req.prompt_problem = prompt_problem(chunk, self.tables.size)  # (a loop over every candidate: once)
        aligned = echo is not None and all(0 <= t < self.tables.size for t in echo) and req.prompt_problem is None
        if (opts.prompt_logprobs is not msgspec.UNSET and not req.stream and aligned
                and chunk.prompt_logprobs is not None):
            req.prompt_lp = shaping.prompt_logprobs(echo, chunk.prompt_logprobs, max(0, opts.prompt_logprobs),
                                                    self.corrector)
        if opts.echo and not req.chat and aligned:
            # (bad ids or a misaligned list are reported by check_chunk; no crash here)
            req.echo_text, prompt_lp, req.offset = shaping.echo_prompt(
                self.tables, self.corrector, chunk.prompt_token_ids, chunk.prompt_logprobs, req.k,
                opts.skip_special_tokens)
            if prompt_lp is not None:
                req.has_lp = True
                if req.stream:
                    req.echo_lp = prompt_lp
                else:
                    req.comp_lp = prompt_lp
        self._active[chunk.request_id] = req
        return req

    def _render(self, req: RequestState, rid: str, chunk: GenerateChunk) -> list[Output]:
        """A chunk of a running request: its text, its logprobs, then the result(s)."""
        text, n_keep, matched = self._text(req, chunk)
        if req.echo_text:  # echo: the prompt goes in front of the first result's text
            text, req.echo_text = req.echo_text + text, ""
        final = chunk.finish_reason is not None or matched
        finish_reason = "stop" if matched else chunk.finish_reason
        if matched:
            self.stats.stop_matches += 1
        logprobs = chunk_logprobs(req, chunk, n_keep, self.corrector)
        out = self._shape(req, rid, chunk, text, logprobs, finish_reason if final else None)
        if matched and chunk.finish_reason is None:
            out.append(CancelRequest(rid, "stop string matched"))
        return out

    def _text(self, req: RequestState, chunk: GenerateChunk) -> tuple[str, int, bool]:
        """(new text, how many of the chunk's ids it keeps, whether a stop string matched).
        A stop *token* (eos or stop_token_ids) is not part of the text unless
        include_stop_str_in_output (vLLM's rule); its logprobs are still reported."""
        ids = chunk.token_ids
        fr = chunk.finish_reason
        text_ids = ids
        if (fr == "stop" and chunk.stop_token_id is not None and ids and ids[-1] == chunk.stop_token_id
                and not req.opts.include_stop_str_in_output):
            text_ids = ids[:-1]
        detok, stop = req.detok, req.stop
        if stop is None:
            text = detok.feed(text_ids)
            if fr is not None:
                text += detok.flush()
            return text, len(ids), False
        pieces = []
        for i, tid in enumerate(text_ids):
            piece, matched = stop.feed(detok.step(tid))
            pieces.append(piece)
            if matched:
                return "".join(pieces), i + 1, True
        matched = False
        if fr is not None:
            piece, matched = stop.feed(detok.flush())
            pieces.append(piece)
            if not matched:
                pieces.append(stop.flush())
        return "".join(pieces), len(ids), matched

    def _shape(self, req: RequestState, rid: str, chunk: GenerateChunk, text: str, logprobs,
               finish_reason: str | None) -> list[Output]:
        """The OpenAI result(s) for this chunk: one per chunk when streaming, else one at
        the end (`finish_reason` set: the request is over)."""
        final = finish_reason is not None
        if req.stream:
            opts = req.opts
            usage = (shaping.usage(req.prompt_tokens, req.generated)
                     if opts.include_usage and (final or opts.continuous_usage) else None)
            if req.chat:
                value = shaping.chat_chunk(rid, req.created, req.model, text, req.first, logprobs,
                                           finish_reason, usage)
            else:
                value = shaping.completion(rid, req.created, req.model, text, logprobs, finish_reason, usage)
            req.first = False
            return [self._finish(req, rid, chunk, value) if final else self._result(req, rid, chunk, value, False)]
        req.parts.append(text)
        if req.chat and logprobs:
            req.chat_lp.extend(logprobs)
        if not final:
            limit = self.max_result_bytes
            if limit is not None:
                req.held_bytes += len(text)
                if req.chat:
                    if logprobs:
                        req.held_bytes += MIN_CHAT_ENTRY_BYTES * sum(1 + len(e.top_logprobs) for e in logprobs)
                    held = req.held_bytes
                else:  # (its logprobs are the request's so far: `req.comp_lp`)
                    held = req.held_bytes + MIN_COMPLETION_POSITION_BYTES * len(req.comp_lp.tokens)
                if held > limit:
                    return self._too_large(req, rid, chunk, limit)
            return []
        usage = shaping.usage(req.prompt_tokens, req.generated)
        full = "".join(req.parts)
        if req.chat:
            value = shaping.chat_final(rid, req.created, req.model, full, req.chat_lp if req.has_lp else None,
                                       finish_reason, usage, req.prompt_lp)
        else:
            value = shaping.completion(rid, req.created, req.model, full, req.comp_lp if req.has_lp else None,
                                       finish_reason, usage, req.prompt_lp)
        return [self._finish(req, rid, chunk, value)]

    def _too_large(self, req: RequestState, rid: str, chunk: GenerateChunk, limit: int) -> list[Output]:
        """A request not streamed whose result cannot fit a record any more: it ends now,
        with the error the record-size rule gives at its end (undeliverable.py), and a
        cancel. Held to its end, its text and logprobs took memory without bound (a
        long-context answer with top_logprobs 20: hundreds of MB, its first chunk's offset
        pinned all along) and generate ran on for an answer bound to fail."""
        self.stats.rule_errors += 1
        message = (f"derender: result too large: over the record size limit of {limit} bytes after "
                   f"{req.generated} tokens; ask for fewer logprobs or tokens, or stream (a non-streamed "
                   f"answer holds every token's logprobs in one result, a streamed one those of one chunk)")
        value = shaping.error_response(message, "invalid_request_error", 400)
        return [self._finish(req, rid, chunk, value), CancelRequest(rid, "derender: result too large")]

    # --- records and bookkeeping -----------------------------------------------------
    def _result(self, req: RequestState, rid: str, chunk: GenerateChunk, value, final: bool) -> Result:
        headers = {HEADER_ATTEMPT: chunk.attempt, HEADER_SEQ: str(chunk.seq)}
        if req is not None and req.restart:
            headers[HEADER_RESTART] = "1"
            req.restart = False
        if final:
            headers[HEADER_FINAL] = "1"
            if chunk.error is not None and chunk.finish_reason != "error":
                headers[HEADER_ERROR] = chunk.error.message[:1000]  # why it was aborted (docs/design.md §4)
        self.stats.results += 1
        topic = req.reply_topic if req is not None else chunk.reply_topic
        return Result(rid, topic, value, headers, final)

    def _finish(self, req: RequestState | None, rid: str, chunk: GenerateChunk, value) -> Result:
        result = self._result(req, rid, chunk, value, True)
        self._mark_finished(rid, req.request_offset if req is not None else chunk.request_offset)
        return result

    def _reused(self, rid: str, chunk: GenerateChunk) -> list[Output]:
        """Seq 0 of another request record with a finished request's id: a client re-sent
        the id (kcat's `-k kcat-1` twice). Answered with an error, and generate is told to
        stop the run; the first request's result stands."""
        self.stats.rule_errors += 1
        value = shaping.error_response(
            f"request_id {rid!r} was already used by an earlier request, which has been answered; "
            f"give every request a new request_id", "invalid_request_error", 400)
        out: list[Output] = [self._finish(None, rid, chunk, value)]
        if chunk.finish_reason is None:
            out.append(CancelRequest(rid, "request_id re-used"))
        return out

    def _mark_finished(self, rid: str, request_offset: int | None = None) -> None:
        self._active.pop(rid, None)
        finished = self._finished
        finished.pop(rid, None)  # re-inserted: the newest
        finished[rid] = request_offset
        if len(finished) > self.finished_memory:
            del finished[next(iter(finished))]

    def _fail(self, rid: str, req: RequestState | None, chunk: GenerateChunk, message: str) -> list[Output]:
        self.stats.rule_errors += 1
        value = shaping.error_response(f"derender: bad chunk for request {rid!r}: {message}")
        out: list[Output] = [self._finish(req, rid, chunk, value)]
        if chunk.finish_reason is None:
            out.append(CancelRequest(rid, f"derender error: {message}"))
        return out


def _other_record(finished_offset: int | None, offset: int | None) -> bool:
    """A seq-0 chunk comes from another request record than the finished request's."""
    return finished_offset is not None and offset is not None and offset != finished_offset
