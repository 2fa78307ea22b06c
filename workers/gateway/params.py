"""An OpenAI request body → the arguments of `make_request` (docs/design.md §9): pure.

Every field of the body is hostile until checked here: a wrong type or value, or a
parameter genpipe does not implement, is a `BadParameter` that names it (the gateway
answers 400 with OpenAI's error shape); unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schemas.records import INT64_MAX, INT64_MIN
from schemas.validation import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

# Parameters with a meaning genpipe does not implement: refused by name rather than
# silently ignored (a caller relying on them would get different output).
UNSUPPORTED = {
    "logit_bias": lambda v: bool(v),
    "presence_penalty": lambda v: bool(v),
    "frequency_penalty": lambda v: bool(v),
    "repetition_penalty": lambda v: v not in (None, 1, 1.0),
    "best_of": lambda v: v not in (None, 1),
    "response_format": lambda v: v is not None and v != {"type": "text"},
    "tools": lambda v: bool(v),
    "tool_choice": lambda v: v not in (None, "none"),
    "functions": lambda v: bool(v),
    "suffix": lambda v: bool(v),
    # vLLM's extensions that change what is generated or how the prompt is rendered:
    # ignored, a structured-output request got free text that looked valid (the module's
    # rule); sent at their defaults they pass
    **dict.fromkeys(("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                     "chat_template", "chat_template_kwargs", "bad_words", "allowed_token_ids", "logits_processors",
                     "truncate_prompt_tokens"), lambda v: bool(v)),
    "continue_final_message": lambda v: bool(v),
    "add_generation_prompt": lambda v: v is False,
    "use_beam_search": lambda v: bool(v),
    "length_penalty": lambda v: v not in (None, 1, 1.0),
    "return_tokens_as_token_ids": lambda v: bool(v),
}
# Not yet in this gateway (issue #12 lists them): refused by name too.
NOT_YET: dict = {}


class BadParameter(ValueError):
    def __init__(self, param: str, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


MAX_CHOICES = 128  # prompts × n in one HTTP request


@dataclass
class Parsed:
    kind: str  # "completion" | "chat"
    prompts: list[str | list[int]] = field(default_factory=list)  # completions: one or more
    n: int = 1
    messages: list[dict] | None = None  # chat
    stream: bool = False
    options: dict[str, Any] = field(default_factory=dict)  # make_request keyword arguments


def parse(body: Any, kind: str, model_name: str, max_logprobs: int = 20) -> Parsed:
    """The body of POST /v1/completions (kind "completion") or /v1/chat/completions ("chat")."""
    if not isinstance(body, dict):
        raise BadParameter("body", "the request body must be a JSON object")
    for name, used in {**UNSUPPORTED, **NOT_YET}.items():
        if name in body and used(body[name]):
            what = "is not supported by genpipe" if name in UNSUPPORTED else "is not supported by this gateway yet"
            raise BadParameter(name, f"{name} {what}")
    special = body.get("add_special_tokens")  # vLLM's: a completion's BOS; a chat's template has its own
    if special is not None and special != (kind == "completion"):
        raise BadParameter("add_special_tokens", f"add_special_tokens {special!r} is not supported by genpipe for "
                                                 f"{'completions' if kind == 'completion' else 'chat completions'}")
    check_model(body, model_name)
    parsed = Parsed(kind=kind, stream=_bool(body, "stream", False))
    opts = parsed.options
    opts["model"] = model_name
    if kind == "completion":
        parsed.prompts = _prompts(body.get("prompt"))
    else:
        parsed.messages = _messages(body.get("messages"))
    parsed.n = _int(body.get("n", 1) if body.get("n") is not None else 1, "n", 1, MAX_CHOICES)
    if parsed.n * max(1, len(parsed.prompts)) > MAX_CHOICES:
        raise BadParameter("n", f"prompts × n must be at most {MAX_CHOICES}, got "
                                f"{len(parsed.prompts)} × {parsed.n}")
    # (null is "not given", as OpenAI's and vLLM's request models read it: typed clients
    # send every field, null where unset)
    param = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = body.get(param)
    opts["max_tokens"] = _int(max_tokens, param, 0, None) if max_tokens is not None else (16 if kind == "completion" else None)
    opts["min_tokens"] = _int(_given(body, "min_tokens", 0), "min_tokens", 0, None)
    opts["temperature"] = _float(_given(body, "temperature", 1.0), "temperature", 0.0, 2.0)
    opts["top_p"] = _float(_given(body, "top_p", 1.0), "top_p", 0.0, 1.0, open_low=True)
    opts["top_k"] = _int(body.get("top_k", 0) or 0, "top_k", -1, None)
    opts["min_p"] = _float(_given(body, "min_p", 0.0), "min_p", 0.0, 1.0)
    seed = body.get("seed")
    opts["seed"] = None if seed is None else _int(seed, "seed", -(2 ** 63), 2 ** 63 - 1)
    opts["stop"] = _stop(body.get("stop"))
    opts["stop_token_ids"] = _ids(body.get("stop_token_ids") or [], "stop_token_ids")
    if len(opts["stop_token_ids"]) > MAX_STOP_TOKEN_IDS:
        raise BadParameter("stop_token_ids", f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got "
                                             f"{len(opts['stop_token_ids'])}")
    opts["ignore_eos"] = _bool(body, "ignore_eos", False)
    opts["include_stop_str_in_output"] = _bool(body, "include_stop_str_in_output", False)
    opts["skip_special_tokens"] = _bool(body, "skip_special_tokens", True)
    # 64 bits, as the request record takes it (and `submit --priority`): the gateway took 32
    opts["priority"] = _int(_given(body, "priority", 0), "priority", -(2 ** 63), 2 ** 63 - 1)
    k_cap = max_logprobs if max_logprobs >= 0 else None  # -1: no cap (as the workers read it)
    if kind == "completion":
        if body.get("logprobs") is not None:
            opts["logprobs"] = _int(body["logprobs"], "logprobs", 0, k_cap)
        opts["echo"] = _bool(body, "echo", False)
    else:
        if _bool(body, "echo", False):
            raise BadParameter("echo", "echo is not supported for chat completions by this gateway yet")
        top = body.get("top_logprobs")
        if top is not None and not _bool(body, "logprobs", False):
            raise BadParameter("top_logprobs", "top_logprobs needs logprobs: true")
        if _bool(body, "logprobs", False):
            opts["logprobs"] = True
            opts["top_logprobs"] = _int(top, "top_logprobs", 0, k_cap) if top is not None else 0
    if body.get("prompt_logprobs") is not None:  # vLLM's extension, both endpoints
        k = _int(body["prompt_logprobs"], "prompt_logprobs", 0, k_cap)
        if parsed.stream and k > 0:  # vLLM's rule: streamed chunks have no such field (0 is ignored)
            raise BadParameter("prompt_logprobs", "prompt_logprobs are not available with stream: true")
        if not parsed.stream:
            opts["prompt_logprobs"] = k
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not parsed.stream:
            raise BadParameter("stream_options", "stream_options needs stream: true")
        if not isinstance(stream_options, dict):
            raise BadParameter("stream_options", "stream_options must be an object")
        opts["include_usage"] = _bool(stream_options, "include_usage", False, "stream_options.include_usage")
        # vLLM's rule: the usage so far on every chunk, when usage is asked for at all
        opts["continuous_usage"] = opts["include_usage"] and _bool(
            stream_options, "continuous_usage_stats", False, "stream_options.continuous_usage_stats")
    opts["stream"] = parsed.stream
    return parsed


def _prompts(value: Any) -> list[str | list[int]]:
    """OpenAI's four prompt forms: a string, a list of strings, a list of token ids, a
    list of token id lists."""
    def ids(v) -> bool:
        return isinstance(v, list) and bool(v) and all(_is_int64(t) for t in v)
    if isinstance(value, str):
        return [value]
    if ids(value):
        return [list(value)]
    if isinstance(value, list) and value and all(isinstance(p, str) or ids(p) for p in value):
        if len(value) > MAX_CHOICES:
            raise BadParameter("prompt", f"at most {MAX_CHOICES} prompts in one request, got {len(value)}")
        return [p if isinstance(p, str) else list(p) for p in value]
    raise BadParameter("prompt", "prompt must be a string, a list of strings, a non-empty list of token ids "
                                 "or a list of such lists")


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadParameter("messages", "messages must be a non-empty list")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadParameter(f"messages[{i}]", f"messages[{i}] must be an object with a role")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadParameter(f"messages[{i}].content", "only text content parts are supported")
            content = "\n".join(p["text"] for p in content)  # as vLLM renders them ("" joined: another prompt)
        if not isinstance(content, str):
            raise BadParameter(f"messages[{i}].content", f"messages[{i}].content must be a string")
        out.append({"role": m["role"], "content": content})
    return out


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value) and len(value) <= MAX_STOP_STRINGS:
        for s in value:
            if not 1 <= len(s) <= MAX_STOP_CHARS:  # (else a 503 once the record was too large for Kafka)
                raise BadParameter("stop", f"stop strings must be 1..{MAX_STOP_CHARS} characters, got {len(s)}")
        return list(value)
    raise BadParameter("stop", f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings")


def check_model(body: dict, model_name: str) -> None:
    """A body that names another model than the gateway's is a 404 (OpenAI's, vLLM's)."""
    model = _given(body, "model", model_name)
    if model != model_name:
        raise BadParameter("model", f"the model {str(model)[:200]!r} does not exist; this gateway serves "
                                    f"{model_name!r}", status=404, kind="not_found_error")


def _given(body: dict, name: str, default: Any) -> Any:
    value = body.get(name)
    return default if value is None else value


def _is_int64(v: Any) -> bool:
    # (the records carry 64-bit integers: a larger one could not be encoded, and came
    # back as a 503 "genpipe is unavailable")
    return isinstance(v, int) and not isinstance(v, bool) and INT64_MIN <= v <= INT64_MAX


def _ids(value: Any, param: str) -> list[int]:
    if isinstance(value, list) and all(_is_int64(t) for t in value):
        return list(value)
    raise BadParameter(param, f"{param} must be a list of 64-bit integers")


def _bool(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadParameter(param or name, f"{param or name} must be true or false")
    return value


def _int(value: Any, param: str, low: int | None, high: int | None) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # `256.0`: vLLM's request models take it (a script that computed it got 400)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadParameter(param, f"{param} must be an integer")
    high = INT64_MAX if high is None else min(high, INT64_MAX)
    if (low is not None and value < low) or value > high or value < INT64_MIN:
        bounds = f"between {INT64_MIN if low is None else low} and {high}"
        # (str() of an integer of 4,300+ digits raises: Python's own limit)
        got = value if INT64_MIN <= value <= INT64_MAX else f"an integer of {value.bit_length()} bits"
        raise BadParameter(param, f"{param} must be {bounds}, got {got}")
    return value


def _float(value: Any, param: str, low: float, high: float, open_low: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadParameter(param, f"{param} must be a number")
    try:
        value = float(value)
    except OverflowError:  # an integer literal of 309+ digits
        raise BadParameter(param, f"{param} must be >= {low:g} and <= {high:g}") from None
    if value != value or value > high or value < low or (open_low and value <= low):
        raise BadParameter(param, f"{param} must be {'>' if open_low else '>='} {low:g} and <= {high:g}, got {value:g}")
    return value


def check_context(prompts: list[list[int]], max_model_len: int | None, param: str) -> None:
    """A prompt with no room left in the model's context is refused here, before it is
    copied into a record per choice (n of them) that the worker would refuse anyway: a
    body of 250,000 ids with n = 128 cost the gateway ~330 MB and 2.6 s of CPU."""
    if max_model_len is None:
        return
    for i, ids in enumerate(prompts):
        if len(ids) >= max_model_len:
            where = param if len(prompts) == 1 else f"{param}[{i}]"
            raise BadParameter(param, f"{where} has {len(ids)} tokens but the model's context is {max_model_len}, "
                                      f"leaving no room to generate")


def nth_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed: seed + index, wrapped into 64 bits (a seed near the top
    would otherwise pass it, and its record could not be encoded)."""
    return (seed + index + 2**63) % 2**64 - 2**63


def request_timeout(header: str | None, field) -> float | None:
    """The request's own timeout in seconds: header `X-Request-Timeout` or body `timeout`."""
    value = header if header is not None else field
    if value is None:
        return None
    try:
        seconds = float("nan") if isinstance(value, bool) else float(value)
    except (TypeError, ValueError, OverflowError):  # (OverflowError: an integer of 309+ digits)
        seconds = float("nan")
    if not 0 < seconds <= 86_400:
        got = value[:50] if isinstance(value, str) else value if isinstance(value, float) else type(value).__name__
        raise BadParameter("timeout", f"timeout must be seconds in (0, 86400], got {got!r}")
    return seconds
