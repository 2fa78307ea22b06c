"""Pure-decode steps at padded, bucketed shapes (what a CUDA graph replays; design §4).

Capture and replay need a GPU; the padding they rest on is plain tensor code, pinned
here on the CPU with `decode_graphs="padded"`: the same shapes, run without capture."""

from __future__ import annotations

import logging

import pytest
import torch

from test_engine import _tiny_random, req, run
from workers.generate.decode_graphs import batch_bucket, batch_buckets, length_bucket
from workers.generate.engine import Engine
from workers.generate.model_runner import StepPlan


def test_buckets_cover_every_size_with_bounded_padding():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    for n in range(1, 257):
        b = batch_bucket(n, batch_buckets(256))
        assert n <= b < 2 * n
    max_len = 131072
    seen = set()
    for n in range(1, max_len + 1):
        length = length_bucket(n, max_len)
        seen.add(length)
        assert n <= length <= max_len
        assert length - n < max(64, n / 4), n  # at most a quarter more keys read, or under 64
    assert len(seen) < 64  # few graphs for a long context
    assert length_bucket(1000, 512) == 512  # never past the cache


@pytest.mark.parametrize("arch", ["mistral-sliding-window", "qwen2-bias-some-sliding-layers", "llama3-rope"])
def test_padded_decode_steps_give_the_eager_engines_tokens(arch):
    """Requests join while others decode, long prompts prefill in chunks beside decode
    steps, so padded steps run with rows past the decoding ones that belong to requests
    still prefilling: the padding rows must write nowhere those requests read."""
    model = _tiny_random(arch)
    prompts = [[1] + [(7 * i + 3) % 290 + 5 for i in range(n)] for n in (3, 12, 20, 30, 70)]
    tokens = {}
    for mode in ("off", "padded"):
        engine = Engine(model=model, max_batch=5, prefill_chunk=5, decode_graphs=mode)
        reqs = [req(f"r{i}", p, max_tokens=40, ignore_eos=True) for i, p in enumerate(prompts)]
        results = run(engine, reqs[:2], arrivals={3: reqs[2:4], 9: reqs[4:]})
        tokens[mode] = {rid: r.tokens for rid, r in results.items()}
        if mode == "padded":
            assert engine.runner.padded.steps > 20  # most steps went through the padded path
    assert all(len(t) == 40 for t in tokens["off"].values())
    assert tokens["padded"] == tokens["off"]


def _decode_plan(engine: Engine) -> StepPlan:
    """The plan the engine's next step runs when every running request is decoding."""
    sched = engine.scheduler
    return StepPlan(decode_tokens=[s.output[-1] for s in sched.decoding],
                    decode_positions=[s.num_computed for s in sched.decoding])


def test_padded_decode_logits_equal_the_eager_forwards(tiny_model_dir):
    """On the trained tiny model (float32): three rows at different positions, padded to
    4 rows and to a longer key range, give the eager step's logits."""
    engine = Engine(tiny_model_dir, max_batch=6, decode_graphs="padded")
    for i, n in enumerate((5, 17, 40)):
        engine.add(req(f"p{i}", [1] + [(31 * j + 7) % 1900 + 3 for j in range(n)], max_tokens=50, ignore_eos=True))
    engine.step()
    while engine.num_waiting() or engine.scheduler.prefilling:
        engine.step()
    plan = _decode_plan(engine)
    assert len(plan.decode_tokens) == 3
    runner = engine.runner
    with torch.inference_mode():
        eager = runner._execute_eager(plan).clone()  # writes this step's K/V ...
        before = runner.k_cache.clone(), runner.v_cache.clone()
        padded = runner.padded.run(plan.decode_tokens, plan.decode_positions)  # ... and the same again
    assert runner.padded.shape(plan.decode_positions) == (4, 64)
    assert padded.shape == eager.shape == (3, engine.vocab_size)
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    # The padding row wrote its K/V to the row no request owns, not to row 3, which a
    # request may hold while it waits for its next prefill chunk.
    pad_row = runner.padded.pad_row
    assert pad_row == engine.max_batch + 1 == runner.k_cache.shape[1] - 1
    for cache, old in zip((runner.k_cache, runner.v_cache), before):
        torch.testing.assert_close(cache[:, :pad_row], old[:, :pad_row], rtol=1e-5, atol=1e-5)
        assert not torch.equal(cache[:, pad_row], old[:, pad_row])


def test_a_failed_capture_turns_graphs_off_and_the_step_still_runs(tiny_model_dir, caplog):
    """A torch or driver version whose ops cannot be captured costs speed, not answers:
    the engine logs why and runs its decode steps eagerly. (On the CPU every capture fails.)"""
    engine = Engine(tiny_model_dir, max_batch=2, decode_graphs="padded")
    reference = Engine(tiny_model_dir, max_batch=2, decode_graphs="off")
    engine.runner.padded.capture = True
    prompt = [1] + [(13 * j + 5) % 1900 + 3 for j in range(9)]
    with caplog.at_level(logging.WARNING, logger="workers.generate.model_runner"):
        got = run(engine, [req("c", prompt, max_tokens=12, ignore_eos=True)])["c"].tokens
    assert engine.runner.padded is None
    assert any("CUDA graphs off" in r.getMessage() and "capturing a decode step of 1 rows" in r.getMessage()
               for r in caplog.records)
    assert got == run(reference, [req("c", prompt, max_tokens=12, ignore_eos=True)])["c"].tokens


def test_the_workers_flag_reaches_the_engine_and_a_bad_mode_is_refused(tiny_model_dir):
    from workers.generate.service import GenerateWorkerConfig, engine_options

    options = engine_options(GenerateWorkerConfig(model=str(tiny_model_dir), cuda_graphs="off"))
    assert options["decode_graphs"] == "off"
    assert Engine(**options).runner.padded is None
    assert Engine(tiny_model_dir).runner.padded is None  # "auto" on the CPU: no padded steps
    with pytest.raises(ValueError, match=r"decode_graphs must be one of \('auto', 'off', 'padded'\), not 'on'"):
        Engine(tiny_model_dir, decode_graphs="on")


def test_the_gpu_benches_run_on_the_cpu_at_a_tiny_shape(tmp_path):
    """ops/bench/gpu_engine.py and decode_ops.py are run on a lent GPU, rarely and in a
    hurry: their CPU mode keeps them from rotting between leases."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "gpu_engine.jsonl"
    subprocess.run([sys.executable, str(root / "ops/bench/gpu_engine.py"), "--shapes", "tiny", "--batches", "4",
                    "--max-tokens", "8", "--device", "cpu", "--dtype", "float32", "--skip-hf", "--json", str(out)],
                   check=True, capture_output=True, timeout=300)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    engines = {r["mode"]: r for r in rows if r["kind"] == "engine"}
    assert engines["off"]["tokens"] == engines["padded"]["tokens"] == 8 * 8
    assert [r["identical"] for r in rows if r["kind"] == "greedy_agreement"] == [1.0]
    padded = next(r for r in rows if r["kind"] == "forward" and r["mode"] == "padded")
    assert padded["max_abs_diff"] < 1e-5 and padded["argmax_agree"] == 1.0
    ops = subprocess.run([sys.executable, str(root / "ops/bench/decode_ops.py"), "--shapes", "tiny", "--batches", "4",
                          "--device", "cpu"], check=True, capture_output=True, text=True, timeout=300).stdout
    assert "attention: SDPA one query per head, enable_gqa" in ops and "rms_norm: F.rms_norm in fp32" in ops
