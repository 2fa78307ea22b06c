"""Generate-engine throughput on one model, side by side in one process.

(a) continuous batching vs Hugging Face `generate()` in fixed batches of the same size.
    N requests (prompts of 6..60 tokens from the tiny model's corpus, max_tokens spread
    evenly over 8..256, shuffled), all greedy with EOS ignored so every request produces
    exactly max_tokens ids on both sides. HF: batches of `--batch` requests in arrival
    order, left-padded, each batch runs to its longest max_tokens; only the useful
    tokens (sum of max_tokens) are counted. genpipe: `Engine(max_batch=--batch)`, all
    requests queued at once, each leaves the moment it is done and the next one joins.
(b) the same engine workload with `logprobs=20` (top-20 + rank, computed on the device,
    [B, 2+2k] values copied to the host per step) vs without logprobs.

Prints tokens/s for each and the ratios (goals: (a) >= 2x, (b) <= 10% slower), by wall
time and by process CPU time. Configurations run interleaved `--repeat` times, in
alternating order; the best run of each counts. For (b) the drift between runs of a
shared machine is larger than the effect, so it also times the logprob work inside the
steps of one run: the same steps with and without it, which is the figure to read there.
On CPU the default is one
torch thread: the tiny model's matmuls are too small to split, and on a busy 2-core
machine two threads spin-wait and ran 2-4x slower for both sides (measured).

    python ops/bench/engine.py [--quick] [--model DIR] [--device cpu|cuda]
                               [--dtype float32|bfloat16|float16] [--threads N] [--repeat N]
"""

from __future__ import annotations

import argparse
import copy
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from schemas.records import GenerateRequest, SamplingParams  # noqa: E402
from workers.generate.engine import Engine  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "workers" / "models" / "corpus"


def make_prompts(model_dir: Path, n: int, rng: random.Random, vocab: int) -> list[list[int]]:
    lines = [line for p in sorted(CORPUS.glob("*.txt")) for line in p.read_text("utf-8").splitlines()
             if line.strip()]
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        encode = lambda text: tok.encode(text).ids  # noqa: E731
    except Exception:  # a model dir without tokenizer.json: arbitrary ids
        encode = lambda text: [rng.randrange(vocab) for _ in range(len(text) // 4 + 1)]  # noqa: E731
    prompts = []
    while len(prompts) < n:
        text = " ".join(rng.choice(lines) for _ in range(rng.randint(1, 4)))
        ids = [i for i in encode(text) if i < vocab][: rng.randint(6, 60)]
        if len(ids) >= 2:
            prompts.append(ids)
    return prompts


def workload(prompts: list[list[int]], lo: int, hi: int, rng: random.Random) -> list[tuple[list[int], int]]:
    n = len(prompts)
    max_tokens = [round(lo + (hi - lo) * i / max(1, n - 1)) for i in range(n)]
    rng.shuffle(max_tokens)
    return list(zip(prompts, max_tokens))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_engine(engine: Engine, work, logprobs: int | None) -> tuple[int, float, int]:
    reqs = [GenerateRequest(request_id=f"r{i}", prompt_token_ids=p,
                            sampling=SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True,
                                                    logprobs=logprobs))
            for i, (p, m) in enumerate(work)]
    steps0 = engine.steps
    sync(engine.device)
    t0 = time.perf_counter()
    for r in reqs:
        engine.add(r)
    tokens = 0
    while engine.has_work():
        for out in engine.step():
            tokens += len(out.token_ids)
    sync(engine.device)
    return tokens, time.perf_counter() - t0, engine.steps - steps0


def logprob_time(engine: Engine, work, logprobs: int | None) -> tuple[float, float, int]:
    """(seconds in the engine's per-step logprob/host function, seconds of the run, steps).

    Run-to-run drift on a shared machine is larger than the effect (b) looks for, so this
    also times the logprob work inside the steps that do it: the same steps, no drift.
    `step_to_entries` is the one function whose work depends on logprobs (without them it
    only reads the sampled ids); off the CPU the queue is drained before each call so
    that its time is its own, not the forward's. The entries' msgpack encoding is not
    in it: a worker's engine process encodes them where the step is sent, in its outbox
    thread beside the next step (ops/bench/logprob_wire.py measures that).
    """
    import workers.generate.engine as engine_module

    inner = engine_module.step_to_entries
    spent = 0.0

    def timed(*args, **kwargs):
        nonlocal spent
        sync(engine.device)
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent += time.perf_counter() - t0

    engine_module.step_to_entries = timed
    try:
        _, secs, steps = run_engine(engine, work, logprobs)
    finally:
        engine_module.step_to_entries = inner
    return spent, secs, steps


@torch.inference_mode()
def run_hf(model, work, batch: int, device: torch.device) -> tuple[int, float, int]:
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = 0
    gen_cfg = copy.deepcopy(model.generation_config)
    gen_cfg.eos_token_id = None  # like ignore_eos: every row runs its full length
    gen_cfg.pad_token_id = pad
    gen_cfg.do_sample = False
    useful = steps = 0
    sync(device)
    t0 = time.perf_counter()
    for b in range(0, len(work), batch):
        group = work[b:b + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.full((len(group), width), pad, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for i, (p, _) in enumerate(group):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        longest = max(m for _, m in group)
        gen_cfg.max_new_tokens = longest
        out = model.generate(ids.to(device), attention_mask=mask.to(device), generation_config=gen_cfg)
        assert out.shape[1] - width == longest
        useful += sum(m for _, m in group)  # tokens past a row's own max_tokens are waste
        steps += longest
    sync(device)
    return useful, time.perf_counter() - t0, steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model dir (default: the built-in tiny spm model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads; default 1 on cpu (see above), 0 = torch's default")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved runs per configuration; the best counts")
    ap.add_argument("--quick", action="store_true", help="16 requests, batch 8, max_tokens 8..64")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.batch, args.max_tokens, args.repeat = 16, 8, 64, 1
    if args.threads is None:
        args.threads = 1 if args.device == "cpu" else 0
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model
    if model_dir is None:
        from workers.models.tinymodel import default_model_dir
        model_dir = default_model_dir("spm")
    model_dir = Path(model_dir)

    from workers.generate.model_runner import load_hf_model

    device = torch.device(args.device)
    model = load_hf_model(model_dir, args.device, args.dtype)
    engine = Engine(model=model, device=args.device, max_batch=args.batch)
    rng = random.Random(0)
    prompts = make_prompts(model_dir, args.requests, rng, engine.vocab_size)
    work = workload(prompts, args.min_tokens, args.max_tokens, rng)
    useful_total = sum(m for _, m in work)

    print(f"model {model_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"{'native' if engine.native else 'fallback'} forward), {args.device} {args.dtype}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(f"workload: {len(work)} requests, prompts {min(map(len, prompts))}..{max(map(len, prompts))} tokens, "
          f"max_tokens {args.min_tokens}..{args.max_tokens} ({useful_total} output tokens), batch {args.batch}")

    # Warm-up (allocator, kernels, lazy imports) on both sides.
    warm = work[: min(4, len(work))]
    warm = [(p, 4) for p, _ in warm]
    run_engine(engine, warm, None)
    run_engine(engine, warm, 20)
    if not args.skip_hf:
        run_hf(model, warm, args.batch, device)

    configs = {"engine": lambda: run_engine(engine, work, None),
               "engine+logprobs": lambda: run_engine(engine, work, 20)}
    if not args.skip_hf:
        configs["hf"] = lambda: run_hf(model, work, args.batch, device)
    # Interleaved repeats (the machine may be shared): the best run of each counts.
    runs: dict[str, list] = {name: [] for name in configs}
    for repeat in range(args.repeat):
        order = list(configs.items())
        for name, fn in order if repeat % 2 == 0 else order[::-1]:  # alternate: no order bias
            c0 = time.process_time()
            tokens, secs, steps = fn()
            runs[name].append((tokens, secs, steps, time.process_time() - c0))
    res = {name: max(rs, key=lambda r: r[0] / r[1]) for name, rs in runs.items()}
    assert res["engine"][0] == useful_total, (res["engine"][0], useful_total)

    def show(label, name):
        tokens, secs, steps, cpu = res[name]
        print(f"  {label:<44} {tokens:>6} tokens {secs:>7.2f} s {tokens / secs:>8.1f} tok/s "
              f"{steps:>5} steps {1000 * secs / max(1, steps):>6.2f} ms/step  (cpu {cpu:.2f} s)")
        return tokens / secs, tokens / cpu

    print("(a) continuous batching vs HF generate() in fixed batches")
    cb, cb_cpu = show("genpipe engine, continuous batching", "engine")
    if not args.skip_hf:
        hf, hf_cpu = show(f"HF generate(), batches of {args.batch} (useful tokens)", "hf")
        print(f"  ratio engine / HF: {cb / hf:.2f}x (goal >= 2x; by process CPU time {cb_cpu / hf_cpu:.2f}x)")
    print("(b) top-20 logprobs + rank vs no logprobs (same engine workload)")
    no, no_cpu = show("no logprobs", "engine")
    lp, lp_cpu = show("logprobs=20", "engine+logprobs")
    print(f"  logprobs slowdown: {100 * (no / lp - 1):.1f}% (goal <= 10%; by process CPU time "
          f"{100 * (no_cpu / lp_cpu - 1):.1f}%)")
    # Best-of-N can pair a lucky run with an unlucky one; the repeats ran back to back, so
    # each repeat's own ratio shows the spread the best-of figure hides.
    paired = [100 * ((a[0] / a[1]) / (b[0] / b[1]) - 1) for a, b in zip(runs["engine"], runs["engine+logprobs"])]
    print(f"  per repeat: {' '.join(f'{x:.1f}%' for x in paired)} (median {statistics.median(paired):.1f}%)")
    base, _, _ = logprob_time(engine, work, None)  # the same steps; its share: reading the ids
    spent, secs, steps = logprob_time(engine, work, 20)
    extra = spent - base
    print(f"  inside the steps: logprob work {1000 * extra / steps:.3f} ms of {1000 * secs / steps:.2f} ms "
          f"per step, i.e. {100 * extra / (secs - extra):.1f}% slower than the same steps without it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
