"""The genpipe wire records: requests, chunks with integer logprobs, cancels.

The Structs *are* the schema (docs/design.md §2–3): field names here are the wire contract read by
other tools, so change them only with a new schema version. Unknown fields are ignored
on decode (forward compatible); required fields have no default.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

SCHEMA_VERSION = 1

# Every integer a client writes fits in 64 bits: JSON has no bound of its own, and a
# 2**70 that passed the rules would fail later, where the worker re-encodes the request
# as msgpack (whose integers stop at 64 bits), with the record's offset held.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
# A logprob on the wire is a number: generate writes NaN and -inf as -9999.0 (§5.4). A
# NaN or an infinity in a chunk (no worker writes one) became `null` in the JSON
# results, which OpenAI's clients read as a float.
FiniteFloat = Annotated[float, msgspec.Meta(ge=-1.7976931348623157e308, le=1.7976931348623157e308)]

FinishReason = Literal["stop", "length", "abort", "error"]
OutputKind = Literal["chat", "completion"]


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to sample; defaults follow vLLM's SamplingParams."""

    max_tokens: Int64 | None = 16  # None: until the model's context is full
    min_tokens: Int64 = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: Int64 = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: Int64 | None = None
    stop_token_ids: list[Int64] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Int64 | None = None  # None, -1 (whole vocabulary) or 0..max_logprobs
    prompt_logprobs: Int64 | None = None


class OutputOptions(msgspec.Struct, kw_only=True):
    """How derender shapes the result; generate passes it through untouched (chunk seq 0)."""

    kind: OutputKind = "completion"
    model: str | None = None
    stream: bool = False
    include_usage: bool = False  # streaming only; non-streamed results always carry usage
    # streaming with include_usage (vLLM's continuous_usage_stats): every result carries the
    # usage so far, not only the last
    continuous_usage: bool = False
    top_logprobs: Int64 = 0  # user-facing k (docs/design.md §5.4)
    stop: list[str] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    created: Int64 | None = None  # unix seconds; derender fills it in when absent
    echo: bool = False  # completions: the prompt's text (and logprobs) in front of the output
    # vLLM's `prompt_logprobs` field in non-streamed results, with this many top candidates
    # per prompt position (sampling.prompt_logprobs must ask for at least as many). UNSET:
    # no field (and nothing in the record: requests written before it read the same).
    prompt_logprobs: Int64 | msgspec.UnsetType = msgspec.UNSET


class GenerateRequest(msgspec.Struct, kw_only=True):
    """Topic `<prefix>.requests`, key = request_id."""

    request_id: str
    prompt_token_ids: list[Int64]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    output: OutputOptions = msgspec.field(default_factory=OutputOptions)
    reply_topic: str | None = None
    deadline_ms: Int64 | None = None  # epoch milliseconds
    priority: Int64 = 0


# --- integer logprobs, exactly the shape of vLLM PR #58181 -------------------------


class GenerateLogProb(msgspec.Struct, gc=False):
    # Positional construction allowed (token_id, logprob, rank): the engine builds ~20 of
    # these per token, and map(GenerateLogProb, ids, values, ranks) halves that cost.
    token_id: Int64
    logprob: FiniteFloat
    rank: Int64 | None = None  # None only when the logprob was NaN


class GenerateLogProbsContent(GenerateLogProb, kw_only=True, gc=False):
    # The sampled token first, then the top tokens in rank order, the sampled id once.
    top_logprobs: list[GenerateLogProb] = msgspec.field(default_factory=list)


class GenerateLogProbs(msgspec.Struct, kw_only=True, gc=False):
    content: list[GenerateLogProbsContent] | None = None


class ChunkError(msgspec.Struct, kw_only=True):
    message: str
    type: str = "invalid_request_error"


class GenerateChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Topic `<prefix>.chunks`, key = request_id. One or more sampled tokens.

    omit_defaults: fields at their default (the seq-0-only ones on later chunks, an
    absent error) are left out of the record (docs/design.md §3: seq-0-only fields are absent later), ~25% fewer bytes.
    """

    request_id: str
    attempt: str  # unique per attempt; a re-run after a crash gets a new one
    seq: Int64  # 0, 1, 2 ... within an attempt
    token_offset: Int64 = 0  # index of token_ids[0] in the request's output
    token_ids: list[Int64] = msgspec.field(default_factory=list)  # may be empty on the last chunk
    logprobs: GenerateLogProbs | None = None  # aligned with token_ids
    finish_reason: FinishReason | None = None
    stop_token_id: Int64 | None = None
    error: ChunkError | None = None  # with finish_reason="error"
    sampled_at_ns: Int64 | None = None
    # Only on seq 0:
    prompt_token_count: Int64 | None = None
    prompt_tail_ids: list[Int64] | None = None  # last <= 8 prompt ids, seeds the detokenizer
    prompt_logprobs: list[GenerateLogProbsContent | None] | None = None  # first entry None
    output: OutputOptions | None = None
    reply_topic: str | None = None  # the request's reply_topic, so derender knows where to answer
    # The request record's offset on its partition (the chunk's partition number): a re-run
    # of the same record (after a crash) has the same one, a re-used request_id another.
    request_offset: Int64 | None = None
    # seq 0, only with output.echo or output.prompt_logprobs: the whole prompt
    prompt_token_ids: list[Int64] | None = None


class Cancel(msgspec.Struct, kw_only=True):
    """Topic `<prefix>.cancel`, key = request_id: end the request with finish_reason=abort."""

    request_id: str
    reason: str = "cancelled"
