"""Model loading and the two model runners: native Llama-family forward, or HF fallback.

A runner executes one `StepPlan` (plain data from the scheduler: the decoding rows'
last tokens plus prefill chunks) and returns the logits the engine asked for. The KV
cache is organised in *rows*, one per running request; the scheduler keeps decoding
requests in rows `0..n_decode-1` and asks the runner to move rows when that changes
(`move_rows`), so decode attention reads a plain view of the cache.

- `LlamaRunner` (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, incl. sliding
  window layers): our batched forward (`llama.py`) over the HF weights with a
  preallocated cache `[layers, rows, kv_heads, max_len, head_dim]`; one forward per step
  for all decoding rows and all prefill chunks together. On a CUDA device a step with
  no prefill chunk replays a CUDA graph of that forward at padded shapes (decode_graphs.py).
- `HFRunner` (any other causal LM): the HF model's own forward, batch 1 per request, each
  request with its own `past_key_values`; still continuous scheduling (requests join and
  leave between steps), but one forward per request per step — much slower.
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workers.generate.decode_graphs import MODES, CaptureFailed, PaddedDecode
from workers.generate.llama import FlatBatch, LlamaWeights, PrefillSegment, forward

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class PrefillChunk:
    row: int
    token_ids: list[int]
    start: int  # position of token_ids[0]
    logits: str  # "none" | "last" | "all": which of this chunk's positions need logits


@dataclass
class StepPlan:
    decode_tokens: list[int] = field(default_factory=list)  # row i's last sampled token
    decode_positions: list[int] = field(default_factory=list)  # its position
    prefills: list[PrefillChunk] = field(default_factory=list)


@dataclass
class ModelInfo:
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]  # the first is the primary one
    architecture: str


def load_hf_model(model_dir: str | Path, device: str, dtype: str):
    from transformers import AutoModelForCausalLM

    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype)
    except TypeError:  # transformers 4.x before `dtype=`
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch_dtype)
    return model.to(device).eval()


def _context_length(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length",
                 "n_ctx", "max_seq_len"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _eos_ids(model) -> list[int]:
    ids: list[int] = []
    for src in (getattr(model, "generation_config", None), model.config):
        value = getattr(src, "eos_token_id", None) if src is not None else None
        for tid in ([value] if isinstance(value, int) else list(value or [])):
            if tid is not None and int(tid) not in ids:
                ids.append(int(tid))
    return ids


def model_info(model, max_model_len: int | None) -> ModelInfo:
    ctx = _context_length(model.config)
    if max_model_len is None:
        if ctx is None:
            raise ValueError("the model config has no context length; pass max_model_len")
        max_model_len = ctx
    elif ctx is not None and max_model_len > ctx:
        log.warning("max_model_len %d exceeds the model's context %d", max_model_len, ctx)
    vocab = model.get_output_embeddings().weight.shape[0]
    return ModelInfo(vocab_size=min(vocab, model.config.vocab_size), max_model_len=max_model_len,
                     eos_token_ids=_eos_ids(model), architecture=type(model).__name__)


class LlamaRunner:
    """Native batched forward with a preallocated per-row KV cache."""

    native = True

    def __init__(self, model, rows: int, max_len: int, decode_graphs: str = "auto"):
        if decode_graphs not in MODES:
            raise ValueError(f"decode_graphs must be one of {MODES}, not {decode_graphs!r}")
        self.device = model.lm_head.weight.device
        self.weights = LlamaWeights.from_hf(model, max_len)
        w = self.weights
        dtype = w.lm_head.dtype
        padded = decode_graphs == "padded" or (decode_graphs == "auto" and self.device.type == "cuda")
        # +1: the scratch row move_rows swaps through; +1 with padded steps: the row their
        # padding rows write to, which no request owns.
        shape = (w.n_layers, rows + 1 + padded, w.n_kv_heads, max_len, w.head_dim)
        need = 2 * math.prod(shape) * torch.finfo(dtype).bits // 8
        what = (f"the KV cache needs {need / 2**30:.2f} GiB ({rows} rows x {max_len} positions x "
                f"{w.n_layers} layers); lower max_model_len or max_batch")
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if need > 0.95 * free:
                raise ValueError(f"{what}: only {free / 2**30:.2f} GiB of GPU memory is free")
        try:
            self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        except (RuntimeError, MemoryError) as exc:
            raise ValueError(f"{what}: {exc}") from exc
        self.scratch = rows
        self._arange = torch.arange(max_len, device=self.device)
        self._kv_heads, self._max_len = w.n_kv_heads, max_len
        self._heads = torch.arange(w.n_kv_heads, device=self.device)
        self._windows = sorted(set(w.windows), key=lambda x: -1 if x is None else x)
        self.padded = (PaddedDecode(self._decode_forward, self.device, rows, max_len, pad_row=rows + 1,
                                    capture=decode_graphs == "auto", vocab=w.lm_head.shape[0], dtype=dtype)
                       if padded else None)

    def _kv_index(self, row_t: torch.Tensor, pos_t: torch.Tensor) -> torch.Tensor:
        """Flat index into cache[layer].view(-1, head_dim) of (row, kv head, position)."""
        return ((row_t[:, None] * self._kv_heads + self._heads[None]) * self._max_len + pos_t[:, None]).view(-1)

    def _decode_masks(self, dec_pos: torch.Tensor, decode_len: int) -> dict:
        """Additive float masks [nd, 1, 1, decode_len], built once per step for all layers
        (SDPA would convert a boolean one to exactly this in every layer); one per
        distinct sliding window. Row i sees keys 0..dec_pos[i] (within its window)."""
        nd = dec_pos.shape[0]
        kpos = self._arange[:decode_len][None, :]
        masks = {}
        for window in self._windows:
            hide = kpos > dec_pos[:, None]
            if window is not None:
                hide |= kpos <= dec_pos[:, None] - window
            mask = torch.zeros((nd, 1, 1, decode_len), dtype=self.k_cache.dtype, device=self.device)
            masks[window] = mask.masked_fill_(hide.view(nd, 1, 1, decode_len), float("-inf"))
        return masks

    def _decode_forward(self, tok_t: torch.Tensor, pos_t: torch.Tensor, row_t: torch.Tensor,
                        decode_len: int) -> torch.Tensor:
        """A decode-only forward at fixed shapes (PaddedDecode's body): all logits."""
        batch = FlatBatch(tokens=tok_t, positions=pos_t, kv_index=self._kv_index(row_t, pos_t),
                          n_decode=tok_t.shape[0], decode_len=decode_len,
                          decode_masks=self._decode_masks(pos_t, decode_len), prefills=[], logit_index=None)
        return forward(self.weights, self.k_cache, self.v_cache, batch)

    def execute(self, plan: StepPlan) -> torch.Tensor:
        if self.padded is not None and plan.decode_tokens and not plan.prefills:
            try:
                return self.padded.run(plan.decode_tokens, plan.decode_positions)
            except CaptureFailed as exc:
                log.warning("CUDA graphs off for this engine, decode steps run eagerly: %s", exc)
                self.padded = None
        return self._execute_eager(plan)

    def _execute_eager(self, plan: StepPlan) -> torch.Tensor:
        nd = len(plan.decode_tokens)
        tokens = list(plan.decode_tokens)
        positions = list(plan.decode_positions)
        rows = list(range(nd))
        logit_index = list(range(nd))
        segments = []
        for p in plan.prefills:
            offset, n = len(tokens), len(p.token_ids)
            tokens += p.token_ids
            positions += range(p.start, p.start + n)
            rows += [p.row] * n
            segments.append(PrefillSegment(row=p.row, offset=offset, start=p.start, length=n))
            if p.logits == "all":
                logit_index += range(offset, offset + n)
            elif p.logits == "last":
                logit_index.append(offset + n - 1)
        decode_len = max(plan.decode_positions) + 1 if nd else 0
        # One host->device copy for all index tensors.
        n = len(tokens)
        packed = torch.tensor(tokens + positions + rows + logit_index, dtype=torch.long)
        packed = packed.to(self.device, non_blocking=True)
        tok_t, pos_t, row_t, li = packed[:n], packed[n:2 * n], packed[2 * n:3 * n], packed[3 * n:]
        kv_index = self._kv_index(row_t, pos_t)
        masks = self._decode_masks(pos_t[:nd], decode_len) if nd else {}
        batch = FlatBatch(tokens=tok_t, positions=pos_t, kv_index=kv_index, n_decode=nd,
                          decode_len=decode_len, decode_masks=masks, prefills=segments, logit_index=li)
        return forward(self.weights, self.k_cache, self.v_cache, batch)

    def move_rows(self, moves: list[tuple[int, int, int]]) -> None:
        """(src, dst, length): copy the first `length` positions of row src into row dst."""
        for src, dst, length in moves:
            src = self.scratch if src < 0 else src
            dst = self.scratch if dst < 0 else dst
            if src == dst or length <= 0:
                continue
            self.k_cache[:, dst, :, :length] = self.k_cache[:, src, :, :length]
            self.v_cache[:, dst, :, :length] = self.v_cache[:, src, :, :length]

    def release_row(self, row: int) -> None:
        pass  # stale K/V is never read: every position is written before it is attended


class HFRunner:
    """Fallback: the HF model's own forward, batch 1 per request, a cache object per row."""

    native = False

    def __init__(self, model, rows: int, max_len: int):
        self.model = model
        self.device = next(model.parameters()).device
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" in params
        self.caches: list[object | None] = [None] * (rows + 1)
        self.scratch = rows

    def _run(self, row: int, ids: list[int], start: int, keep: str) -> torch.Tensor | None:
        from transformers import DynamicCache

        if start == 0 or self.caches[row] is None:
            try:
                self.caches[row] = DynamicCache(config=self.model.config)
            except TypeError:  # transformers 4.x
                self.caches[row] = DynamicCache()
        cache = self.caches[row]
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device)[None]
        kwargs = {self._cache_kw: cache}
        if self._keep_kw and keep != "all":
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=input_ids, position_ids=positions, use_cache=True, **kwargs)
        new_cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        if new_cache is not None:
            self.caches[row] = new_cache
        if keep == "none":
            return None
        return out.logits[0, -1:] if keep == "last" else out.logits[0]

    def execute(self, plan: StepPlan) -> torch.Tensor:
        parts = [self._run(row, [tok], pos, "last")
                 for row, (tok, pos) in enumerate(zip(plan.decode_tokens, plan.decode_positions))]
        for p in plan.prefills:
            parts.append(self._run(p.row, p.token_ids, p.start, p.logits))
        parts = [x for x in parts if x is not None]
        if not parts:
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        return torch.cat(parts)

    def move_rows(self, moves: list[tuple[int, int, int]]) -> None:
        for src, dst, _ in moves:
            src = self.scratch if src < 0 else src
            dst = self.scratch if dst < 0 else dst
            if src != dst:
                self.caches[dst] = self.caches[src]
                self.caches[src] = None

    def release_row(self, row: int) -> None:
        self.caches[row] = None


def make_runner(model, rows: int, max_len: int, force_fallback: bool = False, decode_graphs: str = "auto"):
    reason = "forced" if force_fallback else LlamaWeights.unsupported_reason(model, max_len)
    if reason is None:
        return LlamaRunner(model, rows, max_len, decode_graphs)
    log.warning("using the generic HF forward (batch 1 per request): %s", reason)
    return HFRunner(model, rows, max_len)
