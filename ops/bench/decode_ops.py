"""Where a decode step's GPU time goes, op by op, and what other formulations would take.

After CUDA graphs (decode_graphs.py) a decode step is bound by the GPU's own time, which
on an H200 was still ~3x the memory roofline (BENCHMARKS.md, "The engine on a GPU").
This times each op of one layer of `llama.forward` at Llama 1B / 8B decode shapes, each
captured in a CUDA graph (20 back-to-back calls per replay, so launches cost nothing),
next to the alternatives worth trying, and prints achieved bytes/s against the copy rate
measured in the same run (gpu_engine.py's `ceilings`):

- attention over the cache's rows (keys of a row are strided by max_len, as the engine
  reads them): SDPA with GQA packing and an additive mask as today, under each SDPA
  backend, and plain matmul / float32 softmax / matmul;
- RMSNorm: HF's composed float32 ops (today's bf16 path) vs one `F.rms_norm` in float32;
- the layer's matmuls and the lm_head.

    python ops/bench/decode_ops.py [--shapes 1b,8b] [--batches 64,256] [--keys 192]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ops.bench.gpu_engine import ceilings  # noqa: E402
from workers.generate.llama import rms_norm, rotate_half  # noqa: E402

SHAPES = {  # hidden, intermediate, heads, kv heads, head_dim, vocab
    "tiny": (64, 128, 4, 2, 16, 512),
    "1b": (2048, 8192, 32, 8, 64, 128256),
    "8b": (4096, 14336, 32, 8, 128, 128256),
}


def graphed_ms(fn, reps: int = 20, replays: int = 5) -> float:
    """ms per call of fn, from a CUDA graph of `reps` calls replayed `replays` times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / (reps * replays)


def eager_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1e3 * (time.perf_counter() - t0) / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--keys", type=int, default=192)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    timed = graphed_ms if on_gpu else eager_ms
    dt = torch.bfloat16 if on_gpu else torch.float32
    gbs = ceilings(device)["copy_gbs"]  # nan off the GPU
    print(f"{torch.cuda.get_device_name() if on_gpu else 'cpu'}, torch {torch.__version__}, copy {gbs:.0f} GB/s")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for shape in args.shapes.split(","):
        hidden, inter, H, KVH, D, vocab = SHAPES[shape]
        G = H // KVH
        for B in map(int, args.batches.split(",")):
            L = args.keys
            torch.manual_seed(0)
            x = torch.randn(B, hidden, device=device, dtype=dt)
            norm_w = torch.ones(hidden, device=device, dtype=dt)
            kc = torch.randn(B + 2, KVH, args.max_len, D, device=device, dtype=dt)
            vc = torch.randn_like(kc)
            q = torch.randn(B, H, D, device=device, dtype=dt)
            pos = torch.randint(L // 2, L, (B,), device=device)
            kpos = torch.arange(L, device=device)[None]
            mask = torch.zeros(B, 1, 1, L, device=device, dtype=dt).masked_fill_(
                (kpos > pos[:, None]).view(B, 1, 1, L), float("-inf"))
            scale = D ** -0.5
            k, v = kc[:B, :, :L], vc[:B, :, :L]
            qd = q.view(B, KVH, G, D)
            kv_bytes = 2 * B * KVH * L * D * kc.element_size()

            def sdpa():
                return F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)

            def by_matmul():
                s = torch.matmul(qd, k.transpose(-1, -2)).float() * scale + mask
                return torch.matmul(torch.softmax(s, -1).to(dt), v)

            ref = by_matmul().float()
            rows = []

            def row(name, ms, nbytes=None, out=None):
                rate = f"{nbytes / (ms / 1e3) / 1e9:7.0f} GB/s ({100 * nbytes / (ms / 1e3) / 1e9 / gbs:3.0f}%)" \
                    if nbytes else " " * 20
                err = f" max|diff| {(out.float() - ref).abs().max().item():.3g}" if out is not None else ""
                rows.append(f"  {name:<44} {ms * 1e3:8.1f} us {rate}{err}")

            row("attention: SDPA, default backend (today)", timed(sdpa), kv_bytes, sdpa())
            for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
                try:
                    with sdpa_kernel(backend):
                        ms, out = timed(sdpa), sdpa()
                    row(f"attention: SDPA {backend.name}", ms, kv_bytes, out)
                except Exception as exc:  # a backend that refuses these shapes
                    rows.append(f"  attention: SDPA {backend.name}: {type(exc).__name__}: {str(exc)[:80]}")
            q1 = q.view(B, H, 1, D)

            def gqa():
                return F.scaled_dot_product_attention(q1, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

            try:
                row("attention: SDPA one query per head, enable_gqa", timed(gqa), kv_bytes,
                    gqa().view(B, KVH, G, D))
            except Exception as exc:
                rows.append(f"  attention: SDPA enable_gqa: {type(exc).__name__}: {str(exc)[:80]}")
            row("attention: matmul, fp32 softmax, matmul", timed(by_matmul), kv_bytes)
            # Contiguous keys (a cache laid out [rows, len, kv, D] or compacted) for comparison.
            kcont, vcont = k.contiguous(), v.contiguous()
            row("attention: SDPA on contiguous K/V", timed(
                lambda: F.scaled_dot_product_attention(qd, kcont, vcont, attn_mask=mask, scale=scale)), kv_bytes)

            def fused_norm():
                return norm_w * F.rms_norm(x.float(), (hidden,), None, 1e-5).to(dt)

            row("rms_norm: composed fp32 ops (today)", timed(lambda: rms_norm(x, norm_w, 1e-5)), 2 * x.nbytes)
            row("rms_norm: F.rms_norm in fp32", timed(fused_norm), 2 * x.nbytes)
            qk = torch.randn(B, H + KVH, D, device=device, dtype=dt)
            cos = torch.randn(B, 1, D, device=device, dtype=dt)
            row("rope: q*cos + rotate_half(q)*sin (today)", timed(lambda: qk * cos + rotate_half(qk) * cos),
                2 * qk.nbytes)
            gu = torch.randn(B, 2 * inter, device=device, dtype=dt)
            row("mlp act: silu(gate) * up", timed(lambda: F.silu(gu[:, :inter]) * gu[:, inter:]), gu.nbytes * 3 // 2)
            for name, n_out, n_in in (("wqkv", (H + 2 * KVH) * D, hidden), ("wo", hidden, H * D),
                                      ("w_gate_up", 2 * inter, hidden), ("w_down", hidden, inter)):
                w = torch.randn(n_out, n_in, device=device, dtype=dt) * 0.02
                a = torch.randn(B, n_in, device=device, dtype=dt)
                row(f"linear {name} [{n_out}x{n_in}]", timed(lambda: F.linear(a, w)), w.nbytes)
            head = torch.randn(vocab, hidden, device=device, dtype=dt) * 0.02
            row(f"lm_head [{vocab}x{hidden}]", timed(lambda: F.linear(x, head)), head.nbytes)
            print(f"{shape} batch {B}, {L} keys (one layer's ops; lm_head once per step):")
            print("\n".join(rows), flush=True)
            kc = vc = head = None  # free the cache before the next shape
            if on_gpu:
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
