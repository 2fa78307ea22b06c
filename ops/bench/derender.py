"""Derender throughput: genpipe's table-driven derender vs a vLLM-style reference.

Both sides turn the same decoded `GenerateChunk`s (streamed chat, `top_logprobs = k`)
into the same OpenAI result records and encode them as JSON, in this one process, on one
core. Only the derendering strategy differs:

* genpipe (`workers.derender.Derenderer`): per-id string/bytes tables built at start-up,
  byte-fallback corrections cached by (context, id), incremental text with a table fast
  path (tokenizer calls only for split characters).
* reference: what vLLM's derender does per position: one `tokenizer.decode([id])` call
  per candidate, correction of a U+FFFD string by re-decoding it with the preceding
  sampled ids (docs/design.md §5.2 rule, no cache), a `{id: Logprob}` dict per position, text with
  `tokenizers.decoders.DecodeStream` (primed with the prompt tail, restarted on the
  "Invalid prefix" error). It builds the same msgspec result Structs, so the comparison
  isolates the derendering itself (vLLM would add pydantic models on top).

Workloads: (a) ASCII-heavy (English, code, dialogue from the tiny model's corpus) and
(b) CJK/emoji-heavy (the CJK/emoji corpus plus random CJK characters and emoji, which the
tiny spm tokenizer spells with byte pieces). Candidates are other ids of the same
workload, so CJK positions carry many byte pieces that need correction. Both sides'
records are checked to be identical before timing.

    python ops/bench/derender.py [--quick] [--tokenizer DIR] [--chunk-tokens N]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # tokenizers: one core, as the worker gets
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgspec  # noqa: E402

from schemas.openai import ChatCompletionLogProb, ChatCompletionLogProbsContent  # noqa: E402
from schemas.records import (GenerateChunk, GenerateLogProb, GenerateLogProbs,  # noqa: E402
                             GenerateLogProbsContent, OutputOptions)
from workers.derender import shaping  # noqa: E402
from workers.derender.state import DEFAULT_MODEL_NAME, Derenderer, Result  # noqa: E402
from workers.derender.vocab import REPLACEMENT, VocabTables, load_tokenizer  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "workers" / "models" / "corpus"


# --- workloads -------------------------------------------------------------------------

def workload_text(kind: str, rng: random.Random, chars: int) -> str:
    if kind == "ascii":
        lines = [line for name in ("english", "code", "dialogue", "numbers")
                 for line in (CORPUS / f"{name}.txt").read_text("utf-8").splitlines() if line.strip()]
    else:
        lines = [line for name in ("cjk", "emoji") for line in (CORPUS / f"{name}.txt").read_text("utf-8").splitlines()
                 if line.strip()]
    parts, n = [], 0
    while n < chars:
        if kind == "ascii" or rng.random() < 0.5:
            s = rng.choice(lines)
        else:  # random CJK characters and emoji: byte pieces for the tiny spm tokenizer
            s = "".join(chr(rng.randrange(0x4E00, 0x9FA5)) if rng.random() < 0.8 else chr(rng.randrange(0x1F300, 0x1F64F))
                        for _ in range(rng.randrange(4, 16)))
        parts.append(s)
        n += len(s)
    return "\n".join(parts)


def position(sampled: int, pool: list[int], k: int, rng: random.Random) -> GenerateLogProbsContent:
    """A candidate list as generate writes it: sampled first, then rank order, once each."""
    n = max(k, 1)
    top = rng.sample(pool, n + 1)
    if rng.random() < 0.6:  # the sampled token is usually among the top ones
        top.insert(rng.randrange(min(n, 3)), sampled)
    ranks = {t: r + 1 for r, t in enumerate(dict.fromkeys(top))}
    s_rank = ranks.get(sampled, n + 5)
    entries = [GenerateLogProb(token_id=sampled, logprob=-0.1 * s_rank, rank=s_rank)]
    entries += [GenerateLogProb(token_id=t, logprob=-0.1 * r, rank=r) for t, r in ranks.items() if t != sampled]
    return GenerateLogProbsContent(token_id=sampled, logprob=-0.1 * s_rank, rank=s_rank,
                                   top_logprobs=entries[:n])


def workload_ids(tables: VocabTables, kind: str, rng: random.Random, tokens: int) -> list[int]:
    """About `tokens` ids of a `workload_text`, ending on a whole character (so both sides
    of a comparison decode them alike, and a text repeated does not split a character)."""
    ids = tables.tokenizer.encode(workload_text(kind, rng, tokens * 3), add_special_tokens=False).ids[:tokens]
    while len(ids) > 1 and tables.dirty[ids[-1]]:
        ids.pop()
    return ids


def make_chunks(tables: VocabTables, kind: str, k: int, requests: int, tokens: int, chunk_tokens: int,
                seed: int = 0) -> list[GenerateChunk]:
    """`requests` streamed chat requests of `tokens` tokens, interleaved round-robin."""
    rng = random.Random(seed)
    tok = tables.tokenizer
    per_request = []
    for r in range(requests):
        ids = workload_ids(tables, kind, rng, tokens)
        pool = sorted(set(ids))
        tail = tok.encode("[user]: hi\n[assistant]:", add_special_tokens=False).ids[-8:]
        chunks = []
        for seq, start in enumerate(range(0, len(ids), chunk_tokens)):
            part = ids[start:start + chunk_tokens]
            last = start + chunk_tokens >= len(ids)
            chunk = GenerateChunk(
                request_id=f"{kind}-{r}", attempt="a", seq=seq, token_offset=start, token_ids=part,
                logprobs=GenerateLogProbs(content=[position(t, pool, k, rng) for t in part]),
                finish_reason="length" if last else None, sampled_at_ns=1_700_000_000_000_000_000)
            if seq == 0:
                chunk.prompt_token_count = 12
                chunk.prompt_tail_ids = tail
                chunk.output = OutputOptions(kind="chat", stream=True, top_logprobs=k)
            chunks.append(chunk)
        per_request.append(chunks)
    interleaved = []
    for i in range(max(len(c) for c in per_request)):
        interleaved += [c[i] for c in per_request if i < len(c)]
    return interleaved


# --- the reference -----------------------------------------------------------------------

@dataclass
class Logprob:  # vLLM's per-candidate record
    logprob: float
    rank: int | None
    decoded_token: str | None


class ReferenceDerender:
    """vLLM-style: a decode call per candidate, corrections by re-decoding, DecodeStream."""

    def __init__(self, tokenizer, model_name: str = DEFAULT_MODEL_NAME):
        self.tok = tokenizer
        self.model_name = model_name
        self.requests: dict[str, dict] = {}

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def _token(self, token_id: int, context: list[int]) -> str:
        text = self._decode([token_id])
        if not text.endswith(REPLACEMENT):
            # docs/design.md §5.1: a Metaspace piece keeps the space its lone decode strips.
            if self.tok.id_to_token(token_id).startswith("\u2581") and not text.startswith(" "):
                text = " " + text
            return text
        for n in range(1, min(4, len(context)) + 1):  # docs/design.md §5.2, re-decoding every time
            ctx = context[-n:]
            full = self._decode(ctx + [token_id])
            if full.endswith(REPLACEMENT):
                continue
            run = 0
            while run < n and self._decode([ctx[n - 1 - run]]).endswith(REPLACEMENT):
                run += 1
            prefix = self._decode(ctx[: n - run]) if n - run else ""
            return full[len(prefix):] if full.startswith(prefix) else ""
        return ""

    def _step(self, req: dict, token_id: int) -> str:
        from tokenizers.decoders import DecodeStream

        try:
            piece = req["stream"].step(self.tok, token_id)
        except Exception as exc:  # vLLM resets the stream on "Invalid prefix"
            if not str(exc).startswith("Invalid prefix"):
                raise
            req["stream"] = DecodeStream(skip_special_tokens=True)
            piece = req["stream"].step(self.tok, token_id)
        return piece or ""

    def process(self, chunk: GenerateChunk) -> list[Result]:
        from tokenizers.decoders import DecodeStream

        rid = chunk.request_id
        if chunk.seq == 0:
            stream = DecodeStream(skip_special_tokens=True)
            req = {"stream": stream, "hist": [], "first": True, "opts": chunk.output, "generated": 0,
                   "created": (chunk.sampled_at_ns or 0) // 10**9, "prompt": chunk.prompt_token_count or 0}
            for t in chunk.prompt_tail_ids or ():
                self._step(req, t)
            self.requests[rid] = req
        req = self.requests[rid]
        k = req["opts"].top_logprobs
        text = "".join(self._step(req, t) for t in chunk.token_ids)
        content = []
        for pos in chunk.logprobs.content:
            # {id: Logprob} as vLLM's engine builds it, decoding every candidate
            step = {e.token_id: Logprob(e.logprob, e.rank, self._token(e.token_id, req["hist"]))
                    for e in pos.top_logprobs}
            sampled = step.get(pos.token_id) or Logprob(pos.logprob, pos.rank, self._token(pos.token_id, req["hist"]))
            s = sampled.decoded_token
            tops = [ChatCompletionLogProb(token=p.decoded_token, logprob=p.logprob,
                                          bytes=list(p.decoded_token.encode("utf-8")))
                    for i, p in enumerate(step.values()) if i < k]
            content.append(ChatCompletionLogProbsContent(token=s, logprob=pos.logprob, bytes=list(s.encode("utf-8")),
                                                         top_logprobs=tops))
            req["hist"].append(pos.token_id)
        req["generated"] += len(chunk.token_ids)
        final = chunk.finish_reason is not None
        value = shaping.chat_chunk(rid, req["created"], self.model_name, text, req["first"], content,
                                   chunk.finish_reason, None)
        req["first"] = False
        headers = {"genpipe-attempt": chunk.attempt, "genpipe-seq": str(chunk.seq)}
        if final:
            headers["genpipe-final"] = "1"
            del self.requests[rid]
        return [Result(rid, None, value, headers, final)]


class RecordsOnly:
    """The floor both sides share: build and encode the same records, from table strings,
    with no text or correction work at all (its output is not the right answer)."""

    def __init__(self, tables: VocabTables):
        self.strs, self.byts = tables.token_str, tables.token_bytes
        self.k: dict[str, int] = {}

    def process(self, chunk: GenerateChunk) -> list[Result]:
        strs, byts = self.strs, self.byts
        if chunk.seq == 0:
            self.k[chunk.request_id] = chunk.output.top_logprobs
        k = self.k[chunk.request_id]
        content = [ChatCompletionLogProbsContent(
            token=strs[pos.token_id], logprob=pos.logprob, bytes=byts[pos.token_id],
            top_logprobs=[ChatCompletionLogProb(token=strs[e.token_id], logprob=e.logprob, bytes=byts[e.token_id])
                          for e in pos.top_logprobs[:k]]) for pos in chunk.logprobs.content]
        text = "".join(strs[t] for t in chunk.token_ids)
        value = shaping.chat_chunk(chunk.request_id, 0, DEFAULT_MODEL_NAME, text, chunk.seq == 0, content,
                                   chunk.finish_reason, None)
        headers = {"genpipe-attempt": chunk.attempt, "genpipe-seq": str(chunk.seq)}
        return [Result(chunk.request_id, None, value, headers, chunk.finish_reason is not None)]


# --- timing ------------------------------------------------------------------------------

def run_once(make, chunks) -> tuple[float, list[bytes]]:
    encode = msgspec.json.Encoder().encode
    derender = make()
    out = []
    start = time.process_time()
    for chunk in chunks:
        for r in derender.process(chunk):
            out.append(encode(r.value))
    return time.process_time() - start, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer tokens and rounds (a smoke run)")
    parser.add_argument("--tokenizer", default=None, help="model/tokenizer dir (default: the tiny spm tokenizer)")
    parser.add_argument("--chunk-tokens", type=int, default=1, help="tokens per chunk (1 = one step per chunk)")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    requests = args.requests or (8 if args.quick else 32)
    tokens = args.tokens or (128 if args.quick else 512)
    rounds = args.rounds or (2 if args.quick else 7)

    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
        name = args.tokenizer
    else:
        from workers.models.tinymodel import build_tokenizer

        tokenizer, name = build_tokenizer("spm"), "tiny spm (built in memory)"
    started = time.process_time()
    tables = VocabTables(tokenizer, name=name)
    table_ms = (time.process_time() - started) * 1e3

    print(f"python {platform.python_version()} on {platform.machine()}, one thread, CPU time; tokenizer: {name} "
          f"(vocab {tables.size}, tables built in {table_ms:.0f} ms)")
    print(f"streamed chat, {requests} requests x {tokens} tokens, {args.chunk_tokens} token(s)/chunk, "
          f"best of {rounds}; tokens/s include JSON encoding of every result")
    print("derender ratio: the same, less the records-only floor both sides pay (building and encoding "
          "the result Structs)")
    print(f"{'workload':<9} {'k':>3} {'genpipe tok/s':>14} {'reference tok/s':>16} {'ratio':>6} "
          f"{'records-only tok/s':>19} {'derender ratio':>15} {'cache hits':>11}")
    for kind in ("ascii", "cjk"):
        for k in (0, 5, 20):
            chunks = make_chunks(tables, kind, k, requests, tokens, args.chunk_tokens)
            n_tokens = sum(len(c.token_ids) for c in chunks)
            holder = {}

            def ours():
                holder["d"] = Derenderer(tables)  # a cold correction cache every round
                return holder["d"]

            # Alternate the two sides round by round, keeping each side's best round: the
            # least disturbed by whatever else the machine is doing.
            t_ours = t_ref = t_floor = float("inf")
            for _ in range(rounds):
                t, out_ours = run_once(ours, chunks)
                t_ours = min(t_ours, t)
                t, out_ref = run_once(lambda: ReferenceDerender(tokenizer), chunks)
                t_ref = min(t_ref, t)
                t_floor = min(t_floor, run_once(lambda: RecordsOnly(tables), chunks)[0])
            if out_ours != out_ref:
                diff = next(i for i, (a, b) in enumerate(zip(out_ours, out_ref)) if a != b)
                print(f"  !! outputs differ at record {diff}:\n  ours {out_ours[diff][:300]!r}\n"
                      f"  ref  {out_ref[diff][:300]!r}")
            c = holder["d"].corrector
            hits = c.hits / (c.hits + c.misses) if c.hits + c.misses else 0.0
            own, theirs = t_ours - t_floor, t_ref - t_floor
            derender = f"{theirs / own:>14.1f}x" if own > 0.02 * t_floor else f"{'>' + format(theirs / (0.02 * t_floor), '.0f'):>14}x"
            print(f"{kind:<9} {k:>3} {n_tokens / t_ours:>14,.0f} {n_tokens / t_ref:>16,.0f} "
                  f"{t_ref / t_ours:>5.1f}x {n_tokens / t_floor:>19,.0f} {derender} {hits:>10.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
