"""The engine on a GPU: decode step time against the roofline, CUDA graphs against eager
launches, and genpipe's continuous batching against HF transformers' own (`generate_batch`).

Llama-family shapes with random weights (no model hub here): `1b` (Llama 3.2 1B: 16
layers, hidden 2048, GQA 32/8, vocab 128256, tied embeddings) and `8b` (Llama 3.1 8B:
32 layers, hidden 4096, GQA 32/8), in bf16; `tiny` runs anywhere (a smoke test of this
script on the CPU). For each shape and batch B, in one process:

1. ceilings measured in this run: device-to-device copy (bytes read + written per s)
   and an 8192^3 bf16 matmul;
2. one pure-decode forward of B rows at L keys, eager vs replayed as a CUDA graph
   (decode_graphs.py), wall time per step over back-to-back steps (launch-bound code
   is timed as it runs), against the roofline max(bytes / copy rate, flops / matmul
   rate), bytes = the weights read once (not the embedding table: B rows of it) + the
   K/V of B x L positions; and the graph's logits against the eager ones;
3. the engine end to end, decode_graphs off and auto: 2B requests (random prompts of
   32..128 ids, max_tokens T, greedy, EOS ignored) queued at once; tokens/s and the
   median time of a full-batch pure-decode step (engine.step(): forward, sampling,
   the ids' copy to the host, stop rules);
4. `model.generate_batch` (HF continuous batching) on the same requests: tokens/s.

    python ops/bench/gpu_engine.py [--shapes 1b,8b] [--batches 64,256] [--max-tokens 128]
                                   [--device cuda] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from ops.bench.engine import sync  # noqa: E402
from schemas.records import GenerateRequest, SamplingParams  # noqa: E402
from workers.generate.engine import Engine  # noqa: E402
from workers.generate.model_runner import StepPlan  # noqa: E402

SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
               rope_theta=500000.0),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
               rope_theta=500000.0),
}


def free_memory(device: torch.device) -> None:
    gc.collect()  # an engine's runner and its PaddedDecode refer to each other
    if device.type == "cuda":
        torch.cuda.empty_cache()


def ceilings(device: torch.device) -> dict:
    """Copy rate (read + write bytes per s) and bf16 matmul rate, measured here."""
    if device.type != "cuda":
        return {"copy_gbs": float("nan"), "matmul_tflops": float("nan")}
    a = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync(device)
    copy = 2 * a.numel() * 10 / (time.perf_counter() - t0) / 1e9
    del a, b
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        x @ x
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        x @ x
    sync(device)
    tflops = 2 * 8192 ** 3 * 10 / (time.perf_counter() - t0) / 1e12
    del x
    torch.cuda.empty_cache()
    return {"copy_gbs": copy, "matmul_tflops": tflops}


def make_model(shape: str, device: torch.device, dtype: torch.dtype, max_len: int, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2,
                      **{**SHAPES[shape], **overrides})
    torch.manual_seed(0)
    with torch.device(device):
        try:
            model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
        except TypeError:  # transformers 4.x
            model = LlamaForCausalLM._from_config(cfg, torch_dtype=dtype)
    return model.to(device=device, dtype=dtype).eval()


def roofline(model, batch: int, keys: int, ceil: dict) -> dict:
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())  # a tied embedding counts once
    embed = model.get_input_embeddings().weight.numel()
    read_params = params if cfg.tie_word_embeddings else params - embed  # B rows of the table only
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elt = next(model.parameters()).element_size()
    kv_bytes = cfg.num_hidden_layers * batch * keys * cfg.num_key_value_heads * head_dim * 2 * elt
    weight_bytes = read_params * elt
    # every linear, lm_head included, multiplies B rows by its weights: the bytes read
    flops = 2 * read_params * batch + 4 * cfg.num_hidden_layers * batch * keys * cfg.num_attention_heads * head_dim
    # The copy rate counts bytes read + written: HBM's rate, which reads alone get too.
    t_mem = (weight_bytes + kv_bytes) / (ceil["copy_gbs"] * 1e9)
    t_flop = flops / (ceil["matmul_tflops"] * 1e12)
    return {"weight_gb": weight_bytes / 1e9, "kv_gb": kv_bytes / 1e9, "gflop": flops / 1e9,
            "t_mem_ms": 1e3 * t_mem, "t_flop_ms": 1e3 * t_flop, "roofline_ms": 1e3 * max(t_mem, t_flop)}


@torch.inference_mode()
def time_forward(runner, plan: StepPlan, fn, device: torch.device, iters: int = 20) -> float:
    for _ in range(3):
        fn(plan)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(plan)
    sync(device)
    return 1e3 * (time.perf_counter() - t0) / iters


def forward_checks(engine: Engine, batch: int, keys: int, device: torch.device) -> dict:
    """Eager vs padded/graph forward of one decode step of `batch` rows at `keys` keys."""
    runner = engine.runner
    rng = random.Random(1)
    plan = StepPlan(decode_tokens=[rng.randrange(3, engine.vocab_size) for _ in range(batch)],
                    decode_positions=[keys - 1] * batch)
    out = {"eager_ms": time_forward(runner, plan, runner._execute_eager, device)}
    if runner.padded is None:
        return out
    padded = lambda p: runner.padded.run(p.decode_tokens, p.decode_positions)  # noqa: E731
    try:
        out["graph_ms" if runner.padded.capture else "padded_ms"] = time_forward(runner, plan, padded, device)
        with torch.inference_mode():
            eager = runner._execute_eager(plan).float()
            graph = padded(plan).float()
    except Exception as exc:  # a capture that fails here fails in the engine too: say why, go on
        out["error"] = f"{type(exc).__name__}: {exc}"[:400]
        return out
    out["max_abs_diff"] = (eager - graph).abs().max().item()
    out["logit_scale"] = eager.abs().max().item()
    out["argmax_agree"] = (eager.argmax(-1) == graph.argmax(-1)).float().mean().item()
    return out


def profile_forward(engine: Engine, batch: int, keys: int, device: torch.device) -> str:
    """Where a decode step's GPU time goes: the eager forward's kernels, by total time."""
    from torch.profiler import ProfilerActivity, profile

    runner = engine.runner
    plan = StepPlan(decode_tokens=[5] * batch, decode_positions=[keys - 1] * batch)
    with torch.inference_mode():
        for _ in range(3):
            runner._execute_eager(plan)
        sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner._execute_eager(plan)
            sync(device)
    def self_device_us(e) -> float:
        for name in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
            if hasattr(e, name):
                return getattr(e, name)
        return 0.0

    events = sorted(prof.key_averages(), key=self_device_us, reverse=True)
    total = sum(self_device_us(e) for e in events) or 1.0
    lines = [f"  {self_device_us(e) / 5e3:8.3f} ms/step {100 * self_device_us(e) / total:5.1f}% "
             f"x{e.count // 5:<5} {e.key[:90]}" for e in events[:16]]
    return f"  {total / 5e3:.3f} ms of device time per step\n" + "\n".join(lines)


def workload(n: int, vocab: int, max_tokens: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[1] + [rng.randrange(3, vocab) for _ in range(rng.randint(31, 127))] for _ in range(n)]


def run_engine(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    kinds: list[bool] = []  # per forward: pure decode of a full batch?
    execute = engine.runner.execute

    def recording(plan):
        kinds.append(not plan.prefills and len(plan.decode_tokens) == engine.max_batch)
        return execute(plan)

    engine.runner.execute = recording
    try:
        for i, p in enumerate(prompts):
            engine.add(GenerateRequest(request_id=f"r{i}", prompt_token_ids=p, sampling=SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
        sync(engine.device)
        durations, tokens, ids = [], 0, {}
        t0 = time.perf_counter()
        while engine.has_work():
            s0 = time.perf_counter()
            outs = engine.step()
            durations.append(time.perf_counter() - s0)
            for o in outs:
                tokens += len(o.token_ids)
                ids.setdefault(o.request_id, []).extend(o.token_ids)
        sync(engine.device)
        wall = time.perf_counter() - t0
    finally:
        engine.runner.execute = execute
    full = [d for d, k in zip(durations, kinds) if k]
    return {"ids": ids, "tokens": tokens, "seconds": wall, "tok_s": tokens / wall, "steps": len(durations),
            "full_decode_steps": len(full), "full_decode_step_ms": 1e3 * statistics.median(full) if full else None}


def run_hf_batch(model, prompts: list[list[int]], max_tokens: int, batch: int) -> dict:
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    kwargs = {}
    try:
        from transformers.generation import ContinuousBatchingConfig

        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(max_requests_per_batch=batch)
    except ImportError:
        pass
    model.generate_batch(prompts[:4], generation_config=gen, **kwargs)  # warm-up (graphs, kernels)
    sync(model.device)
    t0 = time.perf_counter()
    try:  # its own warm-up was done above: not timed
        outs = model.generate_batch(prompts, generation_config=gen, warmup=False, **kwargs)
    except TypeError:  # a version without `warmup`
        outs = model.generate_batch(prompts, generation_config=gen, **kwargs)
    sync(model.device)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in outs.values())
    return {"tokens": tokens, "seconds": wall, "tok_s": tokens / wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1b,8b", help="comma list of: " + ", ".join(SHAPES))
    ap.add_argument("--batches", default="64,256", help="comma list of batch sizes (engine max_batch)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--graphs-only", action="store_true",
                    help="run the engine with CUDA graphs only (not also with decode_graphs off)")
    ap.add_argument("--json", help="append one JSON line per measurement here")
    ap.add_argument("--profile", action="store_true",
                    help="only profile the eager decode forward of each shape and batch (torch.profiler)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    graphs = "auto" if device.type == "cuda" else "padded"  # no capture off CUDA: the padded shapes only
    sink = open(args.json, "a") if args.json else None

    def emit(kind: str, **fields) -> None:
        print(f"{kind}: " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                     for k, v in fields.items()), flush=True)
        if sink:
            sink.write(json.dumps({"kind": kind, **fields}) + "\n")
            sink.flush()

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    import transformers

    emit("machine", device=name, torch=torch.__version__, transformers=transformers.__version__)
    ceil = ceilings(device)
    emit("ceilings", **ceil)
    for shape in args.shapes.split(","):
        t0 = time.perf_counter()
        model = make_model(shape, device, dtype, args.max_model_len)
        emit("model", shape=shape, params_b=sum(p.numel() for p in model.parameters()) / 1e9,
             build_s=time.perf_counter() - t0)
        for batch in map(int, args.batches.split(",")):
            prompts = workload(2 * batch, model.config.vocab_size, args.max_tokens)
            keys = 64 + 32 + args.max_tokens // 2  # a mid-run step's largest position, about
            if args.profile:
                engine = Engine(model=model, max_batch=batch, max_model_len=args.max_model_len, decode_graphs="off")
                print(f"profile: shape={shape} batch={batch} keys={keys} (5 eager forwards)\n"
                      + profile_forward(engine, batch, keys, device), flush=True)
                del engine
                free_memory(device)
                continue
            ids: dict[str, dict] = {}
            for mode in (graphs,) if args.graphs_only else ("off", graphs):
                engine = Engine(model=model, max_batch=batch, max_model_len=args.max_model_len,
                                prefill_chunk=2048, decode_graphs=mode)
                emit("forward", shape=shape, batch=batch, keys=keys, mode=mode,
                     **forward_checks(engine, batch, keys, device), **roofline(model, batch, keys, ceil))
                # Warm-up: kernels, and the graphs of every shape this workload meets (a
                # server captures each once, when it first meets it); the second run counts.
                run_engine(engine, prompts, args.max_tokens)
                res = run_engine(engine, prompts, args.max_tokens)
                if engine.runner.padded is not None:
                    res["graphs"] = len(engine.runner.padded.graphs)
                ids[mode] = res.pop("ids")
                emit("engine", shape=shape, batch=batch, mode=mode, **res)
                del engine
                free_memory(device)
            # Greedy ids with and without graphs: equal but for rounding (the padded shapes sum
            # in another order), which random weights' near-ties turn into other tokens.
            if "off" in ids:
                a, b = ids["off"], ids[graphs]
                same = [next((i for i, (x, y) in enumerate(zip(a[r], b[r])) if x != y), len(a[r])) / len(a[r])
                        for r in a]
                emit("greedy_agreement", shape=shape, batch=batch,
                     identical=sum(x == 1.0 for x in same) / len(same), mean_common_prefix=statistics.mean(same))
            if not args.skip_hf:
                try:
                    emit("hf_generate_batch", shape=shape, batch=batch,
                         **run_hf_batch(model, prompts, args.max_tokens, batch))
                except Exception as exc:  # an API that differs by transformers version
                    emit("hf_generate_batch", shape=shape, batch=batch, error=f"{type(exc).__name__}: {exc}"[:300])
                free_memory(device)
        del model
        free_memory(device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
