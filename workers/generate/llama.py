"""Our own batched forward for Llama-family models over the Hugging Face weights.

gpt-fast spirit: plain tensors and functions. `LlamaWeights.from_hf(model)` takes the
weights out of a loaded `LlamaForCausalLM` (also Mistral and Qwen2, which share the
layout: Qwen2 adds q/k/v biases), fusing q/k/v and gate/up into one matmul each.
`forward()` runs one flat batch of tokens from many sequences against a per-row KV
cache of shape `[layers, rows, kv_heads, max_len, head_dim]`:

- the first `n_decode` tokens are one token each of the cache rows `0..n_decode-1`
  (the decoding requests, kept dense at the bottom of the cache by the model runner),
  so their attention reads a *view* of the cache — no gather, no prefix recompute;
- after them come prefill chunks, each a run of consecutive positions of one row.

The math follows transformers' modeling_llama op for op (RMSNorm in float32, rotate-half
RoPE with HF's own cos/sin table, SDPA sharing K/V heads) so greedy decoding
matches `model.generate(do_sample=False)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# These RoPE variants change the frequencies with the sequence length: no fixed table.
_DYNAMIC_ROPE = ("dynamic", "longrope")


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor  # [(H + 2 * KVH) * D, hidden]
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor  # [2 * I, hidden]
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor
    b_down: torch.Tensor | None


@dataclass
class LlamaWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor
    cos: torch.Tensor  # [max_len, head_dim], model dtype, HF's attention scaling included
    sin: torch.Tensor
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    act: object  # callable, silu for every supported model
    windows: list[int | None]  # per layer: sliding window size, None = full attention

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @staticmethod
    def unsupported_reason(model, max_len: int) -> str | None:
        """None if `forward()` can run `model` exactly; else why the fallback is needed."""
        cfg = model.config
        name = type(model).__name__
        if name not in SUPPORTED_ARCHITECTURES:
            return f"architecture {name} has no native forward"
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type in _DYNAMIC_ROPE:
            return f"rope_type {rope_type!r} depends on the sequence length"
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types and set(layer_types) - {"full_attention", "sliding_attention"}:
            return f"layer types {sorted(set(layer_types))}"
        if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
            return "pretraining_tp > 1"
        attn = model.model.layers[0].self_attn
        if any(hasattr(attn, n) for n in ("q_norm", "k_norm")):
            return "q/k norms are not implemented"
        return None

    @classmethod
    @torch.inference_mode()
    def from_hf(cls, model, max_len: int) -> "LlamaWeights":
        cfg = model.config
        inner = model.model
        attn0 = inner.layers[0].self_attn
        head_dim = attn0.head_dim
        n_heads = cfg.num_attention_heads
        n_kv = cfg.num_key_value_heads
        dev = model.lm_head.weight.device
        dtype = model.lm_head.weight.dtype

        def cat_bias(*mods):
            if all(m.bias is None for m in mods):
                return None
            return torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features, device=dev, dtype=dtype)
                              for m in mods])

        layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            layers.append(LayerWeights(
                attn_norm=layer.input_layernorm.weight,
                wqkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                bqkv=cat_bias(a.q_proj, a.k_proj, a.v_proj),
                wo=a.o_proj.weight,
                bo=a.o_proj.bias,
                mlp_norm=layer.post_attention_layernorm.weight,
                w_gate_up=torch.cat([m.gate_proj.weight, m.up_proj.weight]),
                b_gate_up=cat_bias(m.gate_proj, m.up_proj),
                w_down=m.down_proj.weight,
                b_down=m.down_proj.bias,
            ))
        # HF's own rotary module computes cos/sin (incl. rope_scaling defaults such as
        # llama3 / linear / yarn and their attention scaling), in float32 like HF does.
        positions = torch.arange(max_len, device=dev)[None]
        probe = torch.zeros(1, dtype=dtype, device=dev)
        cos, sin = inner.rotary_emb(probe, position_ids=positions)
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types:  # Qwen2 style: some layers slide
            windows = [window if t == "sliding_attention" else None for t in layer_types]
        else:  # Mistral: every layer slides when sliding_window is set
            windows = [window if type(model).__name__ == "MistralForCausalLM" else None] * len(layers)
        windows = [None if w is None or w >= max_len else int(w) for w in windows]
        eps = inner.norm.variance_epsilon if hasattr(inner.norm, "variance_epsilon") else cfg.rms_norm_eps
        return cls(
            embed=inner.embed_tokens.weight,
            layers=layers,
            norm=inner.norm.weight,
            lm_head=model.lm_head.weight,
            cos=cos[0].to(dtype),
            sin=sin[0].to(dtype),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            eps=eps,
            act=F.silu if getattr(cfg, "hidden_act", "silu") == "silu" else inner.layers[0].mlp.act_fn,
            windows=windows,
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one kernel, same values as below
    # HF: normalise in float32, cast back, then scale. One fused kernel for the first
    # part: HF's pow/mean/rsqrt/mul took 2x as long on an H200 (ops/bench/decode_ops.py).
    return weight * F.rms_norm(x.to(torch.float32), weight.shape, None, eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class PrefillSegment:
    """Tokens `offset .. offset+length` of the flat batch fill positions `start ..` of `row`."""

    row: int
    offset: int
    start: int
    length: int


@dataclass
class FlatBatch:
    tokens: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    kv_index: torch.Tensor  # [N * kv_heads] long: flat cache index of each token's K/V per head
    n_decode: int  # tokens 0..n_decode-1 are one token of rows 0..n_decode-1
    decode_len: int  # keys to read for decode: max(position) + 1 over the decode tokens
    decode_masks: dict  # window (None = full) -> [n_decode, 1, 1, decode_len] additive mask (0 / -inf)
    prefills: list[PrefillSegment]
    logit_index: torch.Tensor | None  # [M] long: which flat tokens need logits; None: all


def prefill_mask(start: int, end: int, window: int | None, device) -> torch.Tensor:
    """[end - start, end] bool: query at position p sees keys p - window < j <= p."""
    qpos = torch.arange(start, end, device=device)[:, None]
    kpos = torch.arange(end, device=device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return mask


def forward(w: LlamaWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, b: FlatBatch) -> torch.Tensor:
    """Run the flat batch, write its K/V into the cache, return logits `[M, vocab]`."""
    H, KVH, D = w.n_heads, w.n_kv_heads, w.head_dim
    G = H // KVH
    N = b.tokens.shape[0]
    x = F.embedding(b.tokens, w.embed)  # [N, hidden]
    cos = w.cos[b.positions][:, None, :]  # [N, 1, D]
    sin = w.sin[b.positions][:, None, :]
    scale = D ** -0.5
    nd = b.n_decode
    seg_masks: dict = {}  # (segment, window) -> mask, shared by the layers
    for li, lw in enumerate(w.layers):
        h = rms_norm(x, lw.attn_norm, w.eps)
        qkv = F.linear(h, lw.wqkv, lw.bqkv)
        qk = qkv[:, : (H + KVH) * D].view(N, H + KVH, D)
        qk = qk * cos + rotate_half(qk) * sin  # RoPE on q and k heads at once
        q, k = qk[:, :H], qk[:, H:]
        v = qkv[:, (H + KVH) * D:]
        kc, vc = k_cache[li], v_cache[li]  # [rows, KVH, max_len, D]
        kc.view(-1, D).index_copy_(0, b.kv_index, k.reshape(N * KVH, D))
        vc.view(-1, D).index_copy_(0, b.kv_index, v.reshape(N * KVH, D))

        outs = []
        if nd:
            # One query per head [nd, H, 1, D] against a view of the dense decode rows of
            # the cache, K/V heads shared by SDPA's enable_gqa. Packing a K/V head's G
            # queries as [nd, KVH, G, D] (HF's way) gives the same sums but took 1.7-2.2x
            # as long on an H200 at Llama 1B/8B decode shapes (ops/bench/decode_ops.py).
            od = F.scaled_dot_product_attention(
                q[:nd, :, None], kc[:nd, :, : b.decode_len], vc[:nd, :, : b.decode_len],
                attn_mask=b.decode_masks[w.windows[li]], scale=scale, enable_gqa=G > 1)
            outs.append(od.reshape(nd, H * D))
        for si, seg in enumerate(b.prefills):
            T, end = seg.length, seg.start + seg.length
            qp = q[seg.offset: seg.offset + T].transpose(0, 1)[None]  # [1, H, T, D]
            kp = kc[seg.row, :, :end][None]
            vp = vc[seg.row, :, :end][None]
            window = w.windows[li]
            if seg.start == 0 and window is None:
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=G > 1)
            else:
                mask = seg_masks.get((si, window))
                if mask is None:
                    mask = seg_masks[si, window] = prefill_mask(seg.start, end, window, x.device)
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=G > 1)
            outs.append(op[0].transpose(0, 1).reshape(T, H * D))
        attn = outs[0] if len(outs) == 1 else torch.cat(outs)
        x = x + F.linear(attn, lw.wo, lw.bo)

        h = rms_norm(x, lw.mlp_norm, w.eps)
        gu = F.linear(h, lw.w_gate_up, lw.b_gate_up)
        inter = gu.shape[-1] // 2
        x = x + F.linear(w.act(gu[:, :inter]) * gu[:, inter:], lw.w_down, lw.b_down)

    if b.logit_index is not None:
        x = x[b.logit_index]
    x = rms_norm(x, w.norm, w.eps)
    return F.linear(x, w.lm_head)
