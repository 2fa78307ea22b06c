"""The generate engine on the built-in tiny model: greedy parity with HF generate(),
continuous batching, chunked prefill, seeded sampling, stop rules, logprobs."""

from __future__ import annotations

import contextlib
import copy
import math
import threading
import time

import pytest
import torch

from schemas.errors import ValidationError
from schemas.records import GenerateRequest, SamplingParams
from workers.generate.engine import Engine, RequestOutput
from workers.generate.logprob_entries import decode_entry

EOS = 2
HELLO = "[user]: Hello!\n[assistant]:"  # a chat turn; whether the model ends it with EOS depends on the CPU
TEXTS = [
    "The quick brown fox",
    "[user]: What is the capital of France?\n[assistant]:",
    "Once upon a time, in a small village there lived an old clockmaker who",
    "def add(a, b):",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's matmuls are too small to split; two threads on a busy 2-core
    machine spin-wait and run ~3x slower (measured), so these tests use one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir  # conftest: the built-in tiny spm model, built once into the cache


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def prompts(tok):
    out = [tok.encode(t).ids for t in TEXTS]
    out.append([1] + [(37 * i + 11) % 1990 + 3 for i in range(45)])  # arbitrary ids
    return out


@pytest.fixture(scope="module")
def make_engine(hf_model):
    def make(**kw) -> Engine:
        return Engine(model=hf_model, **kw)

    return make


_HF_CACHE: dict = {}


@pytest.fixture(scope="module")
def hf_greedy(hf_model):
    """Token ids of model.generate(do_sample=False), batch 1, stopping at EOS like it does
    (`eos=None`: not stopping)."""

    def run(prompt: list[int], n: int, min_new: int = 0, eos: int | None = EOS) -> list[int]:
        key = (tuple(prompt), n, min_new, eos)
        if key not in _HF_CACHE:
            with torch.inference_mode():
                kw = {"min_new_tokens": min_new} if min_new else {}
                kw["eos_token_id"] = eos
                out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                                        attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kw)
            _HF_CACHE[key] = out[0, len(prompt):].tolist()
        return _HF_CACHE[key]

    return run


class Result:
    def __init__(self):
        self.tokens: list[int] = []
        self.logprobs: list = []
        self.outputs: list[RequestOutput] = []
        self.finish_reason = None
        self.stop_token_id = None
        self.prompt_logprobs = None


def req(rid: str, prompt: list[int], **sampling) -> GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    return GenerateRequest(request_id=rid, prompt_token_ids=list(prompt), sampling=SamplingParams(**sampling))


def run(engine: Engine, requests: list[GenerateRequest], arrivals: dict[int, list[GenerateRequest]] | None = None,
        check_rows: bool = True, max_steps: int = 5000) -> dict[str, Result]:
    """Step to completion. `arrivals[step]` are added right before that step."""
    results: dict[str, Result] = {}
    for r in requests:
        engine.add(r)
    arrivals = dict(arrivals or {})
    step = 0
    while engine.has_work() or arrivals:
        for r in arrivals.pop(step, []):
            engine.add(r)
        for out in engine.step():
            res = results.setdefault(out.request_id, Result())
            assert res.finish_reason is None, f"output after the final one for {out.request_id}"
            res.outputs.append(out)
            assert len(out.token_ids) <= 1
            res.tokens += out.token_ids
            if out.logprobs is not None:
                assert len(out.logprobs) == len(out.token_ids)
                res.logprobs += [decode_entry(row) for row in out.logprobs]
            if out.prompt_logprobs is not None:
                assert res.prompt_logprobs is None
                res.prompt_logprobs = out.prompt_logprobs
            res.finish_reason, res.stop_token_id = out.finish_reason, out.stop_token_id
        if check_rows:  # decoding requests hold rows 0..n-1, every row has one owner
            sched = engine.scheduler
            assert all(s.row == i for i, s in enumerate(sched.decoding))
            owned = [s.row for s in sched.decoding + sched.prefilling]
            assert len(set(owned)) == len(owned)
        step += 1
        assert step < max_steps
    assert not engine.has_work() and engine.num_running() == 0
    return results


# --------------------------------------------------------------------------- greedy parity


def test_greedy_alone_matches_hf_generate(make_engine, prompts, hf_greedy):
    engine = make_engine()
    assert engine.native
    for i, p in enumerate(prompts):
        res = run(engine, [req(f"a{i}", p, max_tokens=24)])[f"a{i}"]
        ref = hf_greedy(p, 24)
        assert res.tokens == ref, f"prompt {i}"
        assert res.finish_reason == ("stop" if ref[-1] == EOS and len(ref) < 24 else "length")


def test_greedy_in_a_crowd_matches_hf_generate(make_engine, prompts, hf_greedy, tok):
    """Requests join between steps and leave at different times; rows move; some wait
    for a free row; long prompts are prefilled in chunks next to decoding requests."""
    hello = tok.encode(HELLO).ids
    engine = make_engine(max_batch=4, prefill_chunk=16)
    max_tokens = [24, 7, 30, 12, 18, 5, 26]
    all_prompts = prompts + [hello, prompts[2][:9]]
    reqs = [req(f"c{i}", all_prompts[i % len(all_prompts)], max_tokens=m) for i, m in enumerate(max_tokens)]
    arrivals = {3: [reqs[3]], 5: [reqs[4], reqs[5]], 11: [reqs[6]]}
    results = run(engine, reqs[:3], arrivals)
    assert set(results) == {r.request_id for r in reqs}
    for r in reqs:
        ref = hf_greedy(r.prompt_token_ids, 30)[: r.sampling.max_tokens]
        if EOS in ref:
            ref = ref[: ref.index(EOS) + 1]
        assert results[r.request_id].tokens == ref, r.request_id


def test_chunked_prefill_long_prompt(make_engine, prompts, hf_greedy):
    long_prompt = (prompts[2] + prompts[0] + prompts[4] + prompts[1])[:150]
    ref = hf_greedy(long_prompt, 16)
    for chunk in (7, 64, 512):
        engine = make_engine(prefill_chunk=chunk)
        res = run(engine, [req("long", long_prompt, max_tokens=16), req("short", prompts[0], max_tokens=16)])
        assert res["long"].tokens == ref, f"prefill_chunk={chunk}"
        assert res["short"].tokens == hf_greedy(prompts[0], 16)
    # With a small chunk the short request keeps decoding while the long one prefills.
    engine = make_engine(prefill_chunk=7)
    engine.add(req("short", prompts[0], max_tokens=16, ignore_eos=True))
    engine.step()  # prefill of "short" (5 tokens) and its first token
    engine.add(req("long", long_prompt, max_tokens=2))
    steps_with_short_token = 0
    for _ in range(6):
        outs = {o.request_id: o for o in engine.step()}
        steps_with_short_token += bool(outs.get("short") and outs["short"].token_ids)
        assert "long" not in outs  # still prefilling: 150 tokens at 7 per step
    assert steps_with_short_token == 6


def test_prefill_completing_onto_a_prefilling_row(make_engine, prompts, hf_greedy):
    """max_batch=3, three prompts prefilling at once (rows 2, 1, 0): the first to finish
    must take row 0 (n_decode) from the one still prefilling there — a swap of rows."""
    engine = make_engine(max_batch=3, prefill_chunk=4)
    a, b, c = prompts[0][:5], prompts[1][:2], prompts[2][:10]
    # (no EOS: one that ended early on another CPU would not be decoding after two steps)
    reqs = [req(rid, p, max_tokens=6, ignore_eos=True) for rid, p in (("a", a), ("b", b), ("c", c))]
    for r in reqs:
        engine.add(r)
    tokens: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    for _ in range(2):  # a: 4 of 5; then a: last 1, b: 2 (both final), c: first 1 of 10
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    assert [s.request_id for s in engine.scheduler.decoding] == ["a", "b"]
    assert [s.row for s in engine.scheduler.prefilling] == [2]  # c was swapped up
    for rid, res in run(engine, []).items():
        tokens[rid] += res.tokens
    for r, p in zip(reqs, (a, b, c)):
        assert tokens[r.request_id] == hf_greedy(p, 6, eos=None), r.request_id


# --------------------------------------------------------------------------- sampling


def test_seeded_sampling_same_alone_and_in_a_crowd(make_engine, prompts):
    params = dict(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = run(make_engine(), [req("s", prompts[1], **params)])["s"].tokens
    crowd = [req("s", prompts[1], **params)]
    crowd += [req(f"o{i}", prompts[i % 5], max_tokens=5 + 3 * i, temperature=1.0) for i in range(5)]
    crowd += [req("g", prompts[3], max_tokens=15), req("s2", prompts[0], **{**params, "seed": 7})]
    results = run(make_engine(), crowd[2:], arrivals={2: crowd[:2]})
    assert results["s"].tokens == alone
    assert len(alone) == 20
    # A different seed gives a different stream (overwhelmingly likely at T=0.9).
    other = run(make_engine(), [req("s", prompts[1], **{**params, "seed": 99})])["s"].tokens
    assert other != alone


# --------------------------------------------------------------------------- stop rules


def test_max_tokens_and_stop_token_ids(make_engine, prompts, hf_greedy):
    engine = make_engine()
    # (past EOS: the model may say it within a few tokens on another CPU)
    ref = hf_greedy(prompts[2], 24, eos=None)
    res = run(engine, [req("m", prompts[2], max_tokens=5, ignore_eos=True)])["m"]
    assert res.tokens == ref[:5] and res.finish_reason == "length" and res.stop_token_id is None
    stop = ref[3]
    cut = ref.index(stop)
    unused = next(t for t in range(3, 2000) if t not in ref)
    res = run(engine, [req("s", prompts[2], max_tokens=24, stop_token_ids=[unused, stop], ignore_eos=True)])["s"]
    assert res.tokens == ref[: cut + 1]
    assert res.finish_reason == "stop" and res.stop_token_id == stop


@contextlib.contextmanager
def eos_is(hf_model, token_id: int):
    """The model's EOS set to `token_id` while the block runs (engines built inside read it)."""
    saved = hf_model.generation_config.eos_token_id, hf_model.config.eos_token_id
    hf_model.generation_config.eos_token_id = hf_model.config.eos_token_id = token_id
    try:
        yield
    finally:
        hf_model.generation_config.eos_token_id, hf_model.config.eos_token_id = saved


def test_eos_ignore_eos_and_min_tokens(make_engine, hf_model, tok, hf_greedy):
    # The trained tiny model's words differ between CPUs (it is trained where it is built),
    # so whether it says EOS here is not known: EOS becomes a token it does say (portable).
    hello = tok.encode(HELLO).ids
    free = hf_greedy(hello, 40)
    said = [t for i, t in enumerate(free) if i >= 2 and t != EOS and t not in free[:i]]
    assert (free[-1] == EOS and len(free) >= 3) or said, f"no usable EOS in {free}"
    eos = EOS if free[-1] == EOS and len(free) >= 3 else said[0]
    with eos_is(hf_model, eos):
        engine = make_engine()
        ref = hf_greedy(hello, 40, eos=eos)
        assert ref[-1] == eos and len(ref) < 40
        res = run(engine, [req("e", hello, max_tokens=40)])["e"]
        assert res.tokens == ref and res.finish_reason == "stop" and res.stop_token_id is None

        res = run(engine, [req("i", hello, max_tokens=len(ref) + 5, ignore_eos=True)])["i"]
        assert res.tokens[: len(ref)] == ref and len(res.tokens) == len(ref) + 5
        assert res.finish_reason == "length"

        # min_tokens masks EOS (and stop ids) until reached: same as HF's min_new_tokens.
        m, n = len(ref) + 3, len(ref) + 8
        res = run(engine, [req("n", hello, max_tokens=n, min_tokens=m)])["n"]
        assert eos not in res.tokens[: m]
        assert res.tokens == hf_greedy(hello, n, min_new=m, eos=eos)
        # ... and a stop id below min_tokens is ignored, above it honoured.
        stop = ref[1] if ref[1] != eos else ref[0]
        res = run(engine, [req("t", hello, max_tokens=40, min_tokens=3, stop_token_ids=[stop])])["t"]
        assert stop not in res.tokens[:2] and len(res.tokens) >= 3


def test_context_full_is_length(make_engine, prompts, hf_greedy):
    engine = make_engine(max_model_len=40)
    p = prompts[4][:30]
    res = run(engine, [req("c", p, max_tokens=None, ignore_eos=True)])["c"]
    assert len(res.tokens) == 10 and res.finish_reason == "length"
    ref = hf_greedy(p, 10)
    assert res.tokens[: len(ref)] == ref


def test_abort(make_engine, prompts):
    engine = make_engine(max_batch=1)
    engine.add(req("run", prompts[0], max_tokens=50, ignore_eos=True))  # (running still, on any CPU)
    engine.add(req("wait", prompts[1], max_tokens=50))
    got = []
    for _ in range(3):
        got += engine.step()
    assert [o.request_id for o in got] == ["run"] * 3
    engine.abort("run")
    engine.abort("wait", reason="whatever")
    engine.abort("unknown")
    outs = engine.step()
    finals = {o.request_id: o for o in outs if o.finish_reason}
    assert finals["run"].finish_reason == "abort" and finals["run"].token_ids == []
    assert finals["wait"].finish_reason == "abort"
    assert not engine.has_work()
    # The id can be used again at once.
    engine.add(req("run", prompts[0], max_tokens=2, ignore_eos=True))
    assert len(run(engine, [])["run"].tokens) == 2


def test_a_request_ended_before_its_prefill_did_sends_no_part_of_its_prompt_logprobs(make_engine):
    """A prompt in 8-position prefill chunks, aborted after two of its five (a cancel, a
    deadline): its final output carried the 16 prompt logprobs computed so far, and the
    derender answered the abort as a bad chunk ("17 entries for 40 prompt ids")."""
    engine = make_engine(max_batch=2, prefill_chunk=8)
    prompt = list(range(10, 50))
    engine.add(req("a", prompt, max_tokens=4, prompt_logprobs=1))
    engine.add(req("whole", prompt, max_tokens=0, prompt_logprobs=1))
    for _ in range(2):  # (both prefill part of their prompts: 16 of 40 positions)
        assert not any(o.finish_reason for o in engine.step())
    engine.abort("a")
    finals = {o.request_id: o for _ in range(8) for o in engine.step() if o.finish_reason}
    assert finals["a"].finish_reason == "abort" and finals["a"].prompt_logprobs is None
    assert len(finals["whole"].prompt_logprobs) == len(prompt)  # (the same, ended with it whole)


def test_an_attempt_that_ends_while_its_id_is_aborted_and_added_again_forgets_only_itself(make_engine):
    """While a step runs, the request it ends on its own (max_tokens 1) is aborted and
    added again (the worker thread's calls). Its end forgot the id of the new attempt:
    that attempt's abort was ignored, and a third copy of the id was accepted (two finals
    for one id)."""
    engine = make_engine(max_batch=4)

    def attempt(n: int) -> GenerateRequest:
        return req("r", [5, 6, 7], max_tokens=n, ignore_eos=True)
    engine.add(attempt(1))
    execute = engine.runner.execute

    def abort_and_add_during_the_step(plan):
        engine.abort("r")
        engine.add(attempt(40))
        return execute(plan)
    engine.runner.execute = abort_and_add_during_the_step
    assert [(o.request_id, o.finish_reason) for o in engine.step() if o.finish_reason] == [("r", "length")]
    engine.runner.execute = execute
    with pytest.raises(ValidationError, match="already running"):
        engine.add(attempt(40))  # the second attempt runs: a copy of its id is refused
    engine.abort("r")
    finals = [(o.finish_reason, o.num_output_tokens) for o in run(engine, [])["r"].outputs if o.finish_reason]
    assert finals == [("abort", 0)] and not engine.has_work()


def test_deadline_aborts(make_engine, prompts):
    engine = make_engine()
    past = int(time.time() * 1000) - 1
    res = run(engine, [GenerateRequest(request_id="d", prompt_token_ids=prompts[0],
                                       sampling=SamplingParams(max_tokens=50), deadline_ms=past)])
    assert res["d"].finish_reason == "abort" and res["d"].tokens == []


def test_validation_errors(make_engine, prompts):
    engine = make_engine(max_model_len=64)
    with pytest.raises(ValidationError, match="context is 64"):
        engine.add(req("long", list(range(3, 67))))
    with pytest.raises(ValidationError, match=r"prompt_token_ids\[1\].*out of range.*2000"):
        engine.add(req("oov", [1, 2000, 5]))
    with pytest.raises(ValidationError, match="sampling.logprobs"):
        engine.add(req("lp", [1, 5], logprobs=22))  # a completion's cap is max_logprobs + 1
    with pytest.raises(ValidationError, match="prompt_token_ids must be non-empty"):
        engine.add(req("empty", []))
    engine.add(req("dup", [1, 5], max_tokens=1))
    with pytest.raises(ValidationError, match="already running"):
        engine.add(req("dup", [1, 5], max_tokens=1))
    assert run(engine, [])["dup"].tokens


# --------------------------------------------------------------------------- logprobs


def _ref_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """float64 log-softmax of the HF model's logits at every position of `ids`."""
    with torch.inference_mode():
        logits = hf_model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def test_logprobs_match_float64_recomputation(make_engine, hf_model, prompts):
    p = prompts[1]
    engine = make_engine(prefill_chunk=5)  # prompt logprobs across chunks
    res = run(engine, [req("l", p, max_tokens=12, logprobs=5, prompt_logprobs=3, ignore_eos=True),
                       req("x", prompts[0], max_tokens=12)])
    assert all(o.logprobs is None for o in res["x"].outputs) and res["x"].prompt_logprobs is None
    res = res["l"]
    assert len(res.logprobs) == len(res.tokens) == 12
    ref = _ref_logprobs(hf_model, p + res.tokens)
    for i, (tok, entry) in enumerate(zip(res.tokens, res.logprobs)):
        row = ref[len(p) - 1 + i]
        assert entry.token_id == tok
        assert entry.logprob == pytest.approx(row[tok].item(), abs=1e-4)
        best = row.max().item()
        tied = (row >= best - 1e-5).sum().item() > 1
        assert entry.rank == 1 or tied  # greedy: the sampled token is the top one
        tops = entry.top_logprobs
        assert len(tops) == 5 and tops[0].token_id == tok and tops[0].rank == entry.rank
        assert len({t.token_id for t in tops}) == 5
        order = row.argsort(descending=True)
        for j, t in enumerate(tops[1:], start=2):
            assert t.rank == j
            assert t.logprob == pytest.approx(row[order[j - 1]].item(), abs=1e-4)
            assert t.logprob == pytest.approx(row[t.token_id].item(), abs=1e-4)
        assert all(math.isfinite(t.logprob) for t in tops)
    # Prompt logprobs: first None, then each prompt token under the preceding positions.
    plp = res.prompt_logprobs
    assert plp is not None and len(plp) == len(p) and plp[0] is None
    ref_p = _ref_logprobs(hf_model, p)
    for i in range(1, len(p)):
        e = plp[i]
        assert e.token_id == p[i]
        assert e.logprob == pytest.approx(ref_p[i - 1, p[i]].item(), abs=1e-4)
        # (within a rounding of the reference: engine and HF differ by ~3e-6 on some CPUs)
        v = ref_p[i - 1, p[i]]
        assert 1 + int((ref_p[i - 1] > v + 1e-5).sum()) <= e.rank <= int((ref_p[i - 1] >= v - 1e-5).sum())
        assert e.top_logprobs[0].token_id == p[i] and len(e.top_logprobs) == 3


# --------------------------------------------------------------------------- other runners


def test_generic_fallback_runner_matches_hf(make_engine, prompts, hf_greedy):
    engine = make_engine(force_fallback=True, max_batch=3, prefill_chunk=8)
    assert not engine.native
    reqs = [req(f"f{i}", prompts[i], max_tokens=m) for i, m in enumerate([10, 4, 8, 6])]
    results = run(engine, reqs[:2], arrivals={2: reqs[2:]})
    for r in reqs:
        ref = hf_greedy(r.prompt_token_ids, 24)[: r.sampling.max_tokens]
        if EOS in ref:
            ref = ref[: ref.index(EOS) + 1]
        assert results[r.request_id].tokens == ref


def test_other_model_architecture_uses_fallback(tmp_path, prompts):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=2000, n_positions=128, n_embd=32, n_layer=2, n_head=2, eos_token_id=2)
    model = GPT2LMHeadModel(cfg).eval()
    model.save_pretrained(tmp_path)
    engine = Engine(tmp_path)
    assert not engine.native and engine.max_model_len == 128
    res = run(engine, [req("g", prompts[0], max_tokens=6, ignore_eos=True)])["g"]
    with torch.inference_mode():
        ref = engine.model.generate(torch.tensor([prompts[0]]), do_sample=False, max_new_tokens=6,
                                    min_new_tokens=6, attention_mask=torch.ones(1, len(prompts[0]), dtype=torch.long))
    assert res.tokens == ref[0, len(prompts[0]):].tolist()


def test_bfloat16_runs(model_dir, prompts):
    engine = Engine(model_dir, dtype="bfloat16")
    assert engine.runner.k_cache.dtype == torch.bfloat16
    res = run(engine, [req("b", prompts[0], max_tokens=8, logprobs=2, ignore_eos=True),
                       req("c", prompts[2], max_tokens=4, temperature=1.0, seed=3,
                                           ignore_eos=True)])
    assert len(res["b"].tokens) == 8 and len(res["c"].tokens) == 4
    assert all(-9999.0 <= e.logprob <= 0.0 for e in res["b"].logprobs)


def test_add_and_abort_from_another_thread(make_engine, prompts):
    engine = make_engine(max_batch=3)
    finals: dict[str, str] = {}
    done = threading.Event()

    def producer():
        for i in range(8):
            engine.add(req(f"t{i}", prompts[i % 5], max_tokens=3 + i))
            time.sleep(0.002)
        engine.abort("t7")
        done.set()

    th = threading.Thread(target=producer)
    th.start()
    deadline = time.time() + 60
    while (not done.is_set() or engine.has_work()) and time.time() < deadline:
        for out in engine.step():
            if out.finish_reason:
                finals[out.request_id] = out.finish_reason
    th.join()
    assert set(finals) == {f"t{i}" for i in range(8)}
    assert all(r in ("length", "stop") for k, r in finals.items() if k != "t7")


def test_stop_ids_include_secondary_eos(hf_model, prompts, hf_greedy):
    """generation_config may list several EOS ids: the first ends with stop_token_id None,
    the others like stop_token_ids (as vLLM does); ignore_eos disables all of them."""
    ref = hf_greedy(prompts[2], 24)
    head = ref[: ref.index(EOS)] if EOS in ref else ref  # (the model may say EOS early on another CPU)
    if not head:
        pytest.skip("this CPU's tiny model says EOS first: no token to make a second EOS of")
    second = head[min(4, len(head) - 1)]
    model = copy.copy(hf_model)
    model.generation_config = copy.deepcopy(hf_model.generation_config)
    model.generation_config.eos_token_id = [EOS, second]
    engine = Engine(model=model)
    res = run(engine, [req("s", prompts[2], max_tokens=24)])["s"]
    assert res.tokens == ref[: ref.index(second) + 1]
    assert res.finish_reason == "stop" and res.stop_token_id == second
    res = run(engine, [req("i", prompts[2], max_tokens=10, ignore_eos=True)])["i"]
    assert len(res.tokens) == 10


def _tiny_random(arch: str):
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.2, bos_token_id=1, eos_token_id=2)  # peaked logits: no near-ties
    torch.manual_seed(0)
    if arch == "mistral-sliding-window":
        return MistralForCausalLM(MistralConfig(sliding_window=8, **common)).eval()
    if arch == "qwen2-bias-some-sliding-layers":
        return Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                            **common)).eval()
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return LlamaForCausalLM(LlamaConfig(rope_parameters=rope, **common)).eval()


@pytest.mark.parametrize("arch", ["mistral-sliding-window", "qwen2-bias-some-sliding-layers", "llama3-rope"])
def test_native_forward_other_llama_family_configs(arch):
    """Random tiny Mistral (sliding window 8), Qwen2 (q/k/v biases, sliding layers) and
    Llama with llama3 rope scaling: native forward, greedy equal to HF generate(), with
    prompts longer than the window, chunked prefill and requests sharing the batch."""
    model = _tiny_random(arch)
    engine = Engine(model=model, max_batch=3, prefill_chunk=5)
    assert engine.native
    prompts = [[1] + [(7 * i + 3) % 290 + 5 for i in range(n)] for n in (3, 12, 20, 30)]
    reqs = [req(f"r{i}", p, max_tokens=16, ignore_eos=True) for i, p in enumerate(prompts)]
    results = run(engine, reqs[:2], arrivals={3: reqs[2:]})
    for r in reqs:
        p = r.prompt_token_ids
        with torch.inference_mode():
            ref = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
        assert results[r.request_id].tokens == ref, r.request_id


# --------------------------------------------------------------------------- engine thread


async def test_engine_thread_paces_steps_and_keeps_the_tokens(make_engine, prompts, hf_greedy):
    """`--min-step-ms`: every step lasts at least the pace; the tokens are unchanged."""
    import asyncio
    import time

    from workers.generate.engine_thread import EngineThread

    loop = asyncio.get_running_loop()
    outputs: list[RequestOutput] = []
    done = asyncio.Event()

    def deliver(step_outputs, step_s):  # on the engine thread
        outputs.extend(step_outputs)
        if any(o.finish_reason for o in step_outputs):
            loop.call_soon_threadsafe(done.set)

    thread = EngineThread(make_engine(max_batch=2), deliver, min_step_s=0.04)
    thread.start()
    try:
        started = time.perf_counter()
        thread.add(req("paced", prompts[0], max_tokens=6, ignore_eos=True))
        await asyncio.wait_for(done.wait(), 30)
        elapsed = time.perf_counter() - started
    finally:
        thread.stop()
    assert [t for o in outputs for t in o.token_ids] == hf_greedy(prompts[0], 6, eos=None)
    # six steps, five pauses between them; a lower bound, never flaky on a slow box. One
    # pause may be cut short: the add's own wake can land after the first step began (a new
    # request ends a pause), hence four.
    assert elapsed >= 4 * 0.04, elapsed


def test_max_tokens_zero_gives_the_prompt_logprobs_and_no_token(make_engine, prompts, hf_greedy):
    """The prompt only (an evaluation harness scoring a text): one final output, no token,
    every prompt position's logprob; requests beside it are unaffected."""
    engine = make_engine(prefill_chunk=4)  # across prefill chunks, with a normal request in the batch
    res = run(engine, [req("score", prompts[1], max_tokens=0, prompt_logprobs=2),
                       req("bare", prompts[2], max_tokens=0),
                       req("x", prompts[0], max_tokens=8)])
    score = res["score"]
    assert score.tokens == [] and score.finish_reason == "length" and len(score.outputs) == 1
    assert len(score.prompt_logprobs) == len(prompts[1]) and score.prompt_logprobs[0] is None
    assert [e.token_id for e in score.prompt_logprobs[1:]] == prompts[1][1:]
    assert res["bare"].tokens == [] and res["bare"].finish_reason == "length" and res["bare"].prompt_logprobs is None
    assert res["x"].tokens == hf_greedy(prompts[0], 8)
