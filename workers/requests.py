"""Building `GenerateRequest`s: prompt ids from text or chat messages (the model's own
tokenizer and chat template) and OpenAI-style options mapped onto the record."""

from __future__ import annotations

import functools
import time
import uuid
from pathlib import Path
from typing import Sequence

import msgspec

from schemas import GenerateRequest, OutputOptions, SamplingParams

try:
    from jinja2 import TemplateError  # what a chat template raises to refuse messages
except ImportError:  # (no jinja2: no chat templates either)
    TemplateError = ValueError


@functools.lru_cache(maxsize=8)
def load_tokenizer(tokenizer_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def ids_of(result) -> list[int]:
    """A tokenizer's ids as a list of ints, whatever form its version returns."""
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True);
    # 4.x returns the list itself.
    if hasattr(result, "keys") and "input_ids" in result:
        result = result["input_ids"]
    if hasattr(result, "tolist"):
        result = result.tolist()
    if result and isinstance(result[0], list):
        result = result[0]
    return [int(t) for t in result]


def render_chat(tokenizer_dir: str | Path, messages: Sequence[dict]) -> list[int]:
    """Prompt ids of a chat: the model's chat template with the generation prompt."""
    tokenizer = load_tokenizer(str(tokenizer_dir))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer in {tokenizer_dir} has no chat template; "
                         f"send a plain prompt (render_prompt) instead")
    return ids_of(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True))


def render_prompt(tokenizer_dir: str | Path, text: str) -> list[int]:
    """Prompt ids of a completion prompt (with the tokenizer's special tokens, e.g. BOS)."""
    tokenizer = load_tokenizer(str(tokenizer_dir))
    return ids_of(tokenizer(text)["input_ids"])


def make_request(prompt_token_ids: Sequence[int], *, kind: str = "completion", request_id: str | None = None,
                 max_tokens: int | None = 16, min_tokens: int = 0, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
                 stop: str | Sequence[str] = (), stop_token_ids: int | Sequence[int] = (), ignore_eos: bool = False,
                 logprobs: bool | int | None = None, top_logprobs: int | None = None,
                 prompt_logprobs: int | None = None, stream: bool = False, include_usage: bool = False,
                 continuous_usage: bool = False,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 model: str | None = None, reply_topic: str | None = None, deadline_s: float | None = None,
                 priority: int = 0, created: int | None = None, echo: bool = False) -> GenerateRequest:
    """A `GenerateRequest` with OpenAI-style logprob options mapped as derender expects.

    `kind="completion"`: `logprobs=k` is OpenAI's completions `logprobs` (the sampled
    token plus the top k per position; generate is asked for k+1 candidates).
    `kind="chat"`: `logprobs=True` turns logprobs on, `top_logprobs=k` lists k candidates
    per position (generate is asked for k). Counts must be >= 0 (build a
    `GenerateRequest` yourself for `sampling.logprobs=-1`, the whole vocabulary).

    Fills `request_id` (a uuid4 hex) and `output.created` (now) when not given;
    `deadline_s` is relative (seconds from now). `echo` (completions): the prompt's text,
    and with `logprobs` its logprobs, in front of the output (`max_tokens=0`: the prompt
    only, what evaluation harnesses score). `prompt_logprobs=k` (vLLM's extension): the
    non-streamed result carries `prompt_logprobs`, per prompt token None (the first) or
    {token id: {logprob, rank, decoded_token}} with the token itself and the top k (on the
    choice for completions, on the response for chat, as vLLM does).
    """
    if kind not in ("chat", "completion"):
        raise ValueError(f"kind must be 'chat' or 'completion', got {kind!r}")
    gen_logprobs: int | None = None
    k = 0
    enabled = (logprobs is not None and logprobs is not False) or top_logprobs is not None
    if enabled:
        as_int = None if isinstance(logprobs, bool) or logprobs is None else int(logprobs)
        if kind == "chat":
            k = top_logprobs if top_logprobs is not None else (as_int or 0)
            gen_logprobs = k
        else:
            k = as_int if as_int is not None else (top_logprobs or 0)
            gen_logprobs = k + 1
        if k < 0:
            raise ValueError(f"logprobs/top_logprobs must be >= 0, got {k}")
    if echo and kind != "completion":
        raise ValueError("echo is for completions")
    if prompt_logprobs is not None and prompt_logprobs < 0:
        raise ValueError(f"prompt_logprobs must be >= 0, got {prompt_logprobs}")
    if deadline_s is not None and not 0 <= deadline_s < 1e9:  # (inf overflowed; NaN is no time)
        raise ValueError(f"deadline_s must be a number of seconds from 0 to 1e9, got {deadline_s}")
    # One stop string, or one id, as OpenAI's `stop` takes it: "END" was three stop
    # strings, E, N and D
    stop = [stop] if isinstance(stop, str) else list(stop)
    stop_token_ids = [stop_token_ids] if isinstance(stop_token_ids, int) else list(stop_token_ids)
    # The prompt's candidates: for vLLM's field (top prompt_logprobs) and for echo (the
    # same candidates as the output's); generate computes them once for both.
    wanted = [c for c in (prompt_logprobs, gen_logprobs if echo else None) if c is not None]
    sampling = SamplingParams(
        max_tokens=max_tokens, min_tokens=min_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=min_p, seed=seed, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
        logprobs=gen_logprobs, prompt_logprobs=max(wanted) if wanted else None)
    output = OutputOptions(
        kind=kind, model=model, stream=stream, include_usage=include_usage, continuous_usage=continuous_usage,
        top_logprobs=max(k, 0),
        stop=stop, include_stop_str_in_output=include_stop_str_in_output,
        skip_special_tokens=skip_special_tokens,
        created=int(time.time()) if created is None else created, echo=echo,
        prompt_logprobs=msgspec.UNSET if prompt_logprobs is None else prompt_logprobs)
    return GenerateRequest(
        request_id=request_id or uuid.uuid4().hex, prompt_token_ids=[int(t) for t in prompt_token_ids],
        sampling=sampling, output=output, reply_topic=reply_topic,
        deadline_ms=None if deadline_s is None else int((time.time() + deadline_s) * 1000),
        priority=priority)
