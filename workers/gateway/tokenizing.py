"""vLLM's `/tokenize` and `/detokenize` on the gateway: text and the deployment's token ids
(docs/design.md §9).

genpipe is token-in/token-out: a client that builds its prompts as token ids (for
`/v1/completions`, or straight onto `<prefix>.requests`) needs the model's tokenizer and
chat template to make them, and reads ids back (a chunk's `token_ids`). The gateway has
both; these endpoints lend them, with vLLM's bodies:

    POST /tokenize    {"prompt": "...", "add_special_tokens": true, "return_token_strs": false}
                   or {"messages": [...], "add_generation_prompt": true, ...}
                   -> {"count": n, "max_model_len": m, "tokens": [...], "token_strs": [...]}
    POST /detokenize  {"tokens": [...]} -> {"prompt": "..."}

Parsing is pure (every field hostile: a `BadParameter` that names it); the tokenizer's
work runs in a thread, off the event loop (the gateway).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.gateway.params import UNSUPPORTED, BadParameter, _bool, _ids, _messages, check_model
from workers.requests import TemplateError, ids_of, load_tokenizer

# vLLM's fields that change the ids: refused by name (as the generation endpoints refuse
# them), a client would get other ids than it asked for; add_generation_prompt is taken
REFUSED = ("chat_template", "chat_template_kwargs", "continue_final_message", "tools")


@dataclass
class Tokenize:
    text: str | None  # a completion's prompt, or
    messages: list[dict] | None  # a chat's, through the chat template
    add_special_tokens: bool  # a prompt's (BOS); never a chat's: its template writes its own
    add_generation_prompt: bool
    return_token_strs: bool


def parse_tokenize(body: Any, model_name: str) -> Tokenize:
    """The body of POST /tokenize."""
    if not isinstance(body, dict):
        raise BadParameter("body", "the request body must be a JSON object")
    check_model(body, model_name)
    for name in REFUSED:
        if name in body and UNSUPPORTED[name](body[name]):
            raise BadParameter(name, f"{name} is not supported by genpipe")
    token_strs = _bool(body, "return_token_strs", False)
    if body.get("messages") is not None:
        if _bool(body, "add_special_tokens", False):  # (refused for a chat's generation too: params.py)
            raise BadParameter("add_special_tokens", "add_special_tokens true is not supported by genpipe for "
                                                     "chat messages (the chat template writes its own)")
        return Tokenize(None, _messages(body["messages"]), False, _bool(body, "add_generation_prompt", True),
                        token_strs)
    text = body.get("prompt")
    if not isinstance(text, str):
        raise BadParameter("prompt", "prompt must be a string (or send messages)")
    return Tokenize(text, None, _bool(body, "add_special_tokens", True), False, token_strs)


def parse_detokenize(body: Any, model_name: str) -> list[int]:
    """The body of POST /detokenize: its token ids."""
    if not isinstance(body, dict):
        raise BadParameter("body", "the request body must be a JSON object")
    check_model(body, model_name)
    return _ids(body.get("tokens"), "tokens")


def tokenize(tokenizer_dir: str, ask: Tokenize) -> tuple[list[int], list[str] | None]:
    """The ids (and, when asked, each one's token string) of `ask`; in a thread."""
    tokenizer = load_tokenizer(tokenizer_dir)
    try:
        if ask.messages is not None:
            if not getattr(tokenizer, "chat_template", None):
                raise BadParameter("messages", "this model's tokenizer has no chat template: send a prompt")
            ids = ids_of(tokenizer.apply_chat_template(
                ask.messages, add_generation_prompt=ask.add_generation_prompt, tokenize=True))
        else:
            ids = ids_of(tokenizer(ask.text, add_special_tokens=ask.add_special_tokens)["input_ids"])
    except (ValueError, TemplateError) as exc:  # a template that refuses the messages (raise_exception)
        raise BadParameter("messages" if ask.messages is not None else "prompt", str(exc)[:500]) from None
    return ids, (tokenizer.convert_ids_to_tokens(ids) if ask.return_token_strs else None)


def detokenize(tokenizer_dir: str, ids: list[int]) -> str:
    """The text of `ids`, special tokens included (as vLLM's); in a thread."""
    tokenizer = load_tokenizer(tokenizer_dir)
    size = len(tokenizer)
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < size), None)
    if bad is not None:
        raise BadParameter("tokens", f"tokens[{bad}] = {ids[bad]} is not a token id of this model (0..{size - 1})")
    return tokenizer.decode(ids)
