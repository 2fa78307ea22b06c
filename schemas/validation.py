"""The rules a decoded request must follow, as pure functions.

Each rule raises `ValidationError` with one sentence that names the field, e.g.
"prompt_token_ids must be non-empty" — the text that goes back to the requester.
Limits that depend on the deployment (vocabulary, context, max_logprobs) are arguments.
"""

from __future__ import annotations

import re

import msgspec

from schemas.errors import ValidationError
from schemas.records import INT64_MAX, INT64_MIN, GenerateRequest, OutputOptions, SamplingParams

DEFAULT_MAX_LOGPROBS = 20
MAX_REQUEST_ID_LENGTH = 256
# A request whose id breaks the rules (1..MAX_REQUEST_ID_LENGTH characters) is answered
# with an error keyed by that id, up to this length; a longer one goes to the DLQ: the
# answer carries the id twice (key and value), and at ~0.5M characters no longer fits a
# record (its offset was held for good; the client keys its reads by the id it sent).
# (Not more: the derender remembers 100,000 finished ids; at 1,024 characters, ~100 MB.)
# A chunk with a longer id (no generate worker writes one) goes to the DLQ too.
ANSWERABLE_ID_CHARS = 4 * MAX_REQUEST_ID_LENGTH
# Stop strings are matched against every token's text in the derender's one event loop:
# 100,000 of them cost it ~18 ms a token. 16 (the gateway's cap too) of the longest take
# ~30 µs a token (the matcher holds back len(longest) - 1 characters of the stream).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
# Stop ids are kept per request while it waits and looked at on every step: 340,000 of
# them took 13 MB a queued request (the queue counts prompt tokens only) and, with
# min_tokens, ~180 ms a step of the whole batch.
MAX_STOP_TOKEN_IDS = 1024
# The sampler divides float32 logits by the temperature: past float32's largest finite
# value it is inf, and -inf / inf (a suppressed token) is NaN, which wins every draw.
MAX_TEMPERATURE = 3.4028234663852886e38
_TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")


def _fail(field: str, message: str) -> None:
    raise ValidationError(f"{field} {message}", field=field)


def check_logprobs_count(field: str, value: int | None, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                         vocab_size: int | None = None) -> None:
    """None, -1 (the whole vocabulary) or 0..max_logprobs; max_logprobs -1 means no cap.

    `-1` counts as the vocabulary size against the cap when the vocabulary is known.
    """
    if value is None:
        return
    cap = "any" if max_logprobs < 0 else f"0..{max_logprobs}"
    if value < -1:
        _fail(field, f"must be -1 or {cap}, got {value}")
    if max_logprobs >= 0:
        if value > max_logprobs:
            _fail(field, f"must be -1 or {cap}, got {value}")
        if value == -1 and vocab_size is not None and vocab_size > max_logprobs:
            _fail(field, f"-1 asks for the whole vocabulary ({vocab_size} entries) but this "
                         f"deployment's max_logprobs is {max_logprobs}")


def candidate_cap(kind: str, max_logprobs: int) -> int:
    """How many candidates per position generate may be asked for, for a deployment whose
    clients may ask for up to `max_logprobs` (-1: no cap).

    A deployment's `max_logprobs` caps what the client asks for, as in vLLM: chat's
    `top_logprobs` and a completion's `logprobs` alike. A completion's k needs k+1
    candidates from generate (the sampled token besides the top k, docs/design.md §5.4),
    so its requests may carry one more; chat's carry k.
    """
    if max_logprobs < 0 or kind != "completion":
        return max_logprobs
    return max_logprobs + 1


def validate_sampling(p: SamplingParams, *, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                      vocab_size: int | None = None) -> None:
    """`max_logprobs` here caps the candidates asked of generate (`candidate_cap`)."""
    if p.max_tokens is not None and p.max_tokens < 0:
        _fail("sampling.max_tokens", f"must be >= 0 (0: the prompt only, with echo / prompt_logprobs), "
                                     f"got {p.max_tokens}")
    if p.min_tokens < 0:
        _fail("sampling.min_tokens", f"must be >= 0, got {p.min_tokens}")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        _fail("sampling.min_tokens", f"({p.min_tokens}) must not exceed max_tokens ({p.max_tokens})")
    if not 0.0 <= p.temperature <= MAX_TEMPERATURE:  # also rejects NaN
        _fail("sampling.temperature", f"must be a finite number >= 0, got {p.temperature}")
    if not 0.0 < p.top_p <= 1.0:
        _fail("sampling.top_p", f"must be in (0, 1], got {p.top_p}")
    if p.top_k < -1:
        _fail("sampling.top_k", f"must be -1 or 0 (disabled) or a positive count, got {p.top_k}")
    if not 0.0 <= p.min_p <= 1.0:
        _fail("sampling.min_p", f"must be in [0, 1], got {p.min_p}")
    if p.seed is not None and not INT64_MIN <= p.seed <= INT64_MAX:
        _fail("sampling.seed", "must fit in 64 bits")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        _fail("sampling.stop_token_ids", f"may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(p.stop_token_ids)}")
    _check_ids("sampling.stop_token_ids", p.stop_token_ids, vocab_size)
    check_logprobs_count("sampling.logprobs", p.logprobs, max_logprobs, vocab_size)
    check_logprobs_count("sampling.prompt_logprobs", p.prompt_logprobs, max_logprobs, vocab_size)


def validate_output(o: OutputOptions, *, max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> None:
    if o.top_logprobs < 0 or (max_logprobs >= 0 and o.top_logprobs > max_logprobs):
        cap = "any count >= 0" if max_logprobs < 0 else f"0..{max_logprobs}"
        _fail("output.top_logprobs", f"must be {cap}, got {o.top_logprobs}")
    k = o.prompt_logprobs
    if k is not msgspec.UNSET and (k < 0 or (max_logprobs >= 0 and k > max_logprobs)):
        cap = "any count >= 0" if max_logprobs < 0 else f"0..{max_logprobs}"
        _fail("output.prompt_logprobs", f"must be {cap}, got {k}")
    if len(o.stop) > MAX_STOP_STRINGS:
        _fail("output.stop", f"may hold at most {MAX_STOP_STRINGS} strings, got {len(o.stop)}")
    for i, s in enumerate(o.stop):
        if not 1 <= len(s) <= MAX_STOP_CHARS:
            _fail(f"output.stop[{i}]", f"must be a string of 1..{MAX_STOP_CHARS} characters, got {len(s)}")


def _check_ids(field: str, ids: list[int], vocab_size: int | None) -> None:
    """Every id in 0..vocab_size-1: min and max first (C speed; a Python loop over a long
    prompt was ~40 µs per 1,000 ids), the offending index only when one breaks the rule."""
    if not ids or (min(ids) >= 0 and (vocab_size is None or max(ids) < vocab_size)):
        return
    for i, tid in enumerate(ids):
        if tid < 0 or (vocab_size is not None and tid >= vocab_size):
            _fail(f"{field}[{i}]", _out_of_vocab(tid, vocab_size))


def _out_of_vocab(tid: int, vocab_size: int | None) -> str:
    if tid < 0:
        return f"must be a non-negative token id, got {tid}"
    return f"= {tid} is out of range for a vocabulary of {vocab_size} tokens"


def validate_request(req: GenerateRequest, *, max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                     vocab_size: int | None = None, max_model_len: int | None = None) -> None:
    """Raise ValidationError for the first rule `req` breaks; return None if it is valid."""
    if not 1 <= len(req.request_id) <= MAX_REQUEST_ID_LENGTH:
        _fail("request_id", f"must be 1..{MAX_REQUEST_ID_LENGTH} characters, got {len(req.request_id)}")
    if not req.prompt_token_ids:
        _fail("prompt_token_ids", "must be non-empty")
    _check_ids("prompt_token_ids", req.prompt_token_ids, vocab_size)
    if max_model_len is not None and len(req.prompt_token_ids) >= max_model_len:
        _fail("prompt_token_ids", f"has {len(req.prompt_token_ids)} tokens but the model's context "
                                  f"is {max_model_len}, leaving no room to generate")
    cap = candidate_cap(req.output.kind, max_logprobs)
    try:
        validate_sampling(req.sampling, max_logprobs=cap, vocab_size=vocab_size)
    except ValidationError as e:
        if cap == max_logprobs or e.field not in ("sampling.logprobs", "sampling.prompt_logprobs"):
            raise
        # the client asked for k; name its k, not only the k+1 it became
        raise ValidationError(f"{e.message} (a completion's logprobs=k asks generate for k+1 candidates, "
                              f"so k may be 0..{max_logprobs})", field=e.field) from None
    validate_output(req.output, max_logprobs=max_logprobs)
    if req.reply_topic is not None and not _TOPIC_NAME.match(req.reply_topic):
        _fail("reply_topic", f"is not a valid Kafka topic name: {req.reply_topic!r}")
    if req.deadline_ms is not None and req.deadline_ms < 0:
        _fail("deadline_ms", f"must be epoch milliseconds >= 0, got {req.deadline_ms}")
