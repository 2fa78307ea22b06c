"""The generate engine: continuous batching over a local Hugging Face causal LM.

No Kafka, no asyncio. The worker drives it from one dedicated thread:

    engine = Engine(model_dir, device="cuda", dtype="bfloat16")
    engine.add(request)                  # any thread; raises ValidationError on bad input
    engine.abort(request_id)             # any thread; ends it with finish_reason="abort"
    while engine.has_work():
        for out in engine.step():        # StepOutputs (outputs.py): per request, a RequestOutput
                                         # with 0 or 1 new token
            ...

Every accepted request gets exactly one output with a finish_reason (its last); the
first output of a request carries prompt_logprobs when asked. Stop rules (vLLM's order):
"length" when max_tokens is reached or the context is full; then, once min_tokens ids
exist, "stop" on the primary EOS (stop_token_id None; unless ignore_eos) or on a
stop_token_ids entry / secondary generation_config EOS id (stop_token_id = that id).
Below min_tokens, EOS and stop ids are masked out before sampling (logprobs stay raw).
A request past its deadline_ms is aborted at the start of the next step.

One `step()`: drain the inbox (adds, aborts), abort requests past `deadline_ms`, let
the scheduler pick this step's prefill chunks (bounded by `prefill_chunk` tokens) and
decoding requests, run ONE model forward for all of them, sample, compute logprobs
(one device→host copy for ids and logprobs together), apply the stop rules and free
finished requests' cache rows at once. Modules, talking through plain data:
`scheduler.py` (who runs, which cache row), `model_runner.py` + `llama.py` (the
forward), `sampler.py` (sampling), `logprobs.py` (integer logprobs).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from schemas.records import GenerateRequest, SamplingParams
from schemas.validation import DEFAULT_MAX_LOGPROBS
from workers.generate.inbox import Inbox
from workers.generate.logprobs import prompt_positions, step_to_entries
from workers.generate.model_runner import (ModelInfo, PrefillChunk, StepPlan, load_hf_model, make_runner,
                                           model_info)
from workers.generate.outputs import RequestOutput, StepCollector, StepOutputs
from workers.generate.sampler import make_generator, sample, sampling_row, sampling_tensors, suppress
from workers.generate.scheduler import DECODE, Scheduler, Sequence

log = logging.getLogger(__name__)

_FINISH_REASONS = ("stop", "length", "abort", "error")


class Engine:
    def __init__(self, model_dir: str | Path | None = None, device: str = "cpu", dtype: str = "float32",
                 max_batch: int = 32, max_model_len: int | None = None, prefill_chunk: int = 512,
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS, *, model=None, force_fallback: bool = False,
                 decode_graphs: str = "auto"):
        """Load `model_dir` (or use an already loaded HF `model`) and preallocate the cache.

        max_batch: requests holding a cache row at once (decoding or prefilling).
        max_model_len: context length (prompt + output); default from the model config.
        prefill_chunk: prompt tokens prefilled per step, over all requests.
        force_fallback: use the generic HF forward even for Llama-family models.
        decode_graphs: "auto" replays pure-decode steps of the native forward as CUDA
        graphs on a CUDA device (decode_graphs.py); "off" never; "padded" runs their
        padded shapes without capture (any device: what the tests pin).
        """
        if model is None:
            if model_dir is None:
                raise ValueError("pass model_dir or model")
            model = load_hf_model(model_dir, device, dtype)
        self.model = model
        self.device = next(model.parameters()).device  # a passed-in model keeps its device/dtype
        self.info: ModelInfo = model_info(model, max_model_len)
        self.max_model_len = self.info.max_model_len
        self.vocab_size = self.info.vocab_size
        self.max_logprobs = max_logprobs
        self.max_batch = max_batch
        self.runner = make_runner(model, max_batch, self.max_model_len, force_fallback, decode_graphs)
        self.native = self.runner.native
        self.scheduler = Scheduler(max_batch, prefill_chunk)
        eos = self.info.eos_token_ids
        self._eos_primary = eos[0] if eos else None
        self._eos_extra = frozenset(eos[1:])
        self._eos_all = frozenset(eos)
        self._inbox = Inbox()
        self._seqs: dict[str, Sequence] = {}  # owned by the stepping thread
        self._deadlines: set[Sequence] = set()
        self._sampling_key: tuple = ()
        self._sampling_state: tuple = ()
        self._next_uid = 0
        self.steps = 0

    # --- any thread ----------------------------------------------------------------

    def add(self, request: GenerateRequest, *, validated: bool = False, tier: int = 0) -> None:
        """Validate (unless the caller did: `validated`) and queue, by priority and `tier`
        (0 interactive, 1 bulk); the next step() admits it. Raises ValidationError (an id
        already running: always)."""
        self._inbox.add(request, validated=validated, tier=tier, max_logprobs=self.max_logprobs,
                        vocab_size=self.vocab_size, max_model_len=self.max_model_len)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End the request at the next step with a final output (finish_reason "abort",
        or `reason` when it is another finish reason such as "error"). Unknown ids are ignored."""
        self._inbox.abort(request_id, reason)

    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work()

    # --- the stepping thread -------------------------------------------------------------

    def num_running(self) -> int:
        return self.scheduler.num_running()

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @torch.inference_mode()
    def step(self) -> StepOutputs:
        outputs = StepCollector()
        self._drain_inbox(outputs)
        if self._deadlines:
            self._expire(outputs)
        sched = self.scheduler.schedule()
        if not sched:
            return outputs.done()
        self.steps += 1
        plan = StepPlan(
            decode_tokens=[s.output[-1] for s in sched.decode],
            decode_positions=[s.num_computed for s in sched.decode],
            prefills=[PrefillChunk(p.seq.row, p.seq.prompt[p.start:p.start + p.length], p.start,
                                   "all" if p.seq.params.prompt_logprobs is not None
                                   else ("last" if p.final else "none"))
                      for p in sched.prefills],
        )
        logits = self.runner.execute(plan)

        # Which logits rows are sampled: every decode row, the last row of each final chunk.
        seqs = list(sched.decode)
        for s in seqs:
            s.num_computed += 1
        rows = list(range(len(seqs)))
        offset = len(seqs)
        for p in sched.prefills:
            seq = p.seq
            seq.num_computed += p.length
            if seq.params.prompt_logprobs is not None:
                self._prompt_logprobs(seq, logits[offset:offset + p.length], p.start)
                offset += p.length
                if p.final and seq.max_output > 0:
                    rows.append(offset - 1)
                    seqs.append(seq)
            elif p.final:
                if seq.max_output > 0:
                    rows.append(offset)
                    seqs.append(seq)
                offset += 1
            if p.final and seq.max_output == 0:  # max_tokens 0: the prompt only (echo, prompt logprobs)
                outputs.output(self._final_output(seq, "length"))
                self._release(seq)
        if seqs:
            if len(rows) != logits.shape[0]:
                logits = logits[torch.tensor(rows, device=logits.device)]
            self._sample_and_finish(seqs, logits, outputs)
        return outputs.done()

    # --- internals ---------------------------------------------------------------------

    def _drain_inbox(self, outputs: StepCollector) -> None:
        for item in self._inbox.take():
            if item[0] == "add":
                seq = self._new_sequence(item[1])
                seq.tier = item[2]
                self._seqs[seq.request_id] = seq
                self.scheduler.add(seq)
                if seq.request.deadline_ms is not None:
                    self._deadlines.add(seq)
            else:
                seq = self._seqs.get(item[1])
                if seq is not None:
                    reason = item[2] if item[2] in _FINISH_REASONS else "abort"
                    outputs.output(self._final_output(seq, reason))
                    self._release(seq, forget=False)

    def _expire(self, outputs: StepCollector) -> None:
        now_ms = time.time() * 1000
        for seq in [s for s in self._deadlines if s.request.deadline_ms <= now_ms]:
            outputs.output(self._final_output(seq, "abort"))
            self._release(seq)

    def _new_sequence(self, req: GenerateRequest) -> Sequence:
        p = req.sampling
        room = self.max_model_len - len(req.prompt_token_ids)
        max_output = room if p.max_tokens is None else min(p.max_tokens, room)
        stop_ids = set(p.stop_token_ids)
        eos = None
        if not p.ignore_eos:
            eos = self._eos_primary
            stop_ids |= self._eos_extra - {eos}
        seq = Sequence(
            request=req,
            max_output=max_output,
            eos=eos,
            stop_ids=frozenset(stop_ids),
            ends=frozenset(stop_ids if eos is None else stop_ids | {eos}),
            suppress_ids=tuple(sorted(self._eos_all | set(p.stop_token_ids))) if p.min_tokens > 0 else (),
            generator=(make_generator(p.seed, self.device)
                       if p.seed is not None and p.temperature >= 1e-5 else None),
            sampling_row=sampling_row(p),
        )
        self._next_uid += 1
        seq.uid = self._next_uid
        if p.prompt_logprobs is not None:
            seq.prompt_logprobs = []
        return seq

    def _release(self, seq: Sequence, forget: bool = True) -> None:
        moves, freed = self.scheduler.finish(seq)
        if moves:
            self.runner.move_rows(moves)
        if freed is not None:
            self.runner.release_row(freed)
        self._seqs.pop(seq.request_id, None)
        self._deadlines.discard(seq)
        if forget:
            self._inbox.finished(seq.request)

    def _final_output(self, seq: Sequence, reason: str) -> RequestOutput:
        out = RequestOutput(request_id=seq.request_id, token_ids=[], finish_reason=reason,
                            num_prompt_tokens=len(seq.prompt), num_output_tokens=len(seq.output),
                            sampled_at_ns=time.time_ns())
        if not seq.sent_first:
            # Whole or not at all: ended before its prefill did (a cancel, a deadline), a
            # request's list covered part of its prompt, and the derender answered its
            # abort as a bad chunk (an error, "17 entries for 40 prompt ids").
            done = seq.prompt_logprobs is not None and len(seq.prompt_logprobs) == len(seq.prompt)
            out.prompt_logprobs = seq.prompt_logprobs if done else None
            seq.sent_first = True
        return out

    def _prompt_logprobs(self, seq: Sequence, chunk_logits: torch.Tensor, start: int) -> None:
        seq.prompt_logprobs += prompt_positions(chunk_logits, seq.prompt, seq.params.prompt_logprobs, start)

    def _sampling(self, seqs: list[Sequence]):
        key = tuple(s.uid for s in seqs)
        if key != self._sampling_key:
            st = sampling_tensors([s.sampling_row for s in seqs], self.device)
            gens = [s.generator for s in seqs]
            ks = [s.params.logprobs for s in seqs]
            self._sampling_key, self._sampling_state = key, (st, gens, ks)
        return self._sampling_state

    def _sample_and_finish(self, seqs: list[Sequence], logits: torch.Tensor,
                           outputs: StepCollector) -> None:
        st, gens, ks = self._sampling(seqs)
        processed = logits
        if any(s.suppress_ids and len(s.output) < s.params.min_tokens for s in seqs):
            processed = suppress(logits, [s.suppress_ids if len(s.output) < s.params.min_tokens else ()
                                          for s in seqs])
        sampled = sample(processed, st, gens)
        ids, lps = step_to_entries(logits, sampled, ks)  # the one device→host copy of the step
        outputs.sampled_at_ns = time.time_ns()
        max_len = self.max_model_len
        rids, tids, entries = [], [], []  # the step's columns, in row order
        for seq, tok, lp in zip(seqs, ids, lps):
            output = seq.output
            output.append(tok)
            # Most rows: room left (max_output is within the context), an id no rule ends
            # on, not the first token. On a GPU this loop is time the device waits for.
            if len(output) < seq.max_output and tok not in seq.ends and seq.sent_first:
                rids.append(seq.request_id)
                tids.append(tok)
                entries.append(lp)
                continue
            n = len(output)
            reason = stop_id = None
            if n >= seq.max_output or len(seq.prompt) + n >= max_len:
                reason = "length"
            elif n >= seq.params.min_tokens:
                if tok == seq.eos:
                    reason = "stop"
                elif tok in seq.stop_ids:
                    reason, stop_id = "stop", tok
            first = not seq.sent_first
            seq.sent_first = True
            if reason is None and (not first or seq.prompt_logprobs is None):
                rids.append(seq.request_id)  # a column entry, as above
                tids.append(tok)
                entries.append(lp)
            else:
                outputs.output(RequestOutput(
                    request_id=seq.request_id, token_ids=[tok], logprobs=None if lp is None else [lp],
                    finish_reason=reason, stop_token_id=stop_id, num_prompt_tokens=len(seq.prompt),
                    num_output_tokens=n, sampled_at_ns=outputs.sampled_at_ns,
                    prompt_logprobs=seq.prompt_logprobs if first else None))
            if reason is not None:
                self._release(seq)
            elif seq.status != DECODE:
                moves = self.scheduler.promote(seq)
                if moves:
                    self.runner.move_rows(moves)
        outputs.tokens(rids, tids, entries)


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """Smoke run: `python -m workers.generate.engine --model DIR --prompt 1,2,3`."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--model", help="HF model dir (default: the built-in tiny model)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--prompt", default="1", help="comma-separated token ids")
    ap.add_argument("--n", type=int, default=4, help="copies of the request")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--logprobs", type=int, default=None)
    ap.add_argument("--fallback", action="store_true", help="force the generic HF forward")
    args = ap.parse_args(argv)
    model_dir = args.model
    if model_dir is None:
        from workers.models.tinymodel import default_model_dir
        model_dir = default_model_dir()
    engine = Engine(model_dir, device=args.device, dtype=args.dtype, force_fallback=args.fallback)
    prompt = [int(x) for x in args.prompt.split(",") if x.strip()]
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                        logprobs=args.logprobs)
    for i in range(args.n):
        engine.add(GenerateRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling=sp))
    tokens: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finish_reason:
                print(out.request_id, out.finish_reason, tokens[out.request_id])
    dt = time.perf_counter() - t0
    total = sum(map(len, tokens.values()))
    print(f"{total} tokens in {dt:.3f}s ({total / dt:.0f} tok/s, {engine.steps} steps, "
          f"{'native' if engine.native else 'fallback'} forward)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
