"""The built-in tiny test/demo model (`genpipe model tiny`).

Two variants, both made offline from the corpus shipped in ``corpus/``:

- ``spm``: a SentencePiece/Llama-style BPE (Metaspace ``▁``, byte fallback, the 256
  ``<0xNN>`` pieces as ordinary vocabulary, ``<unk>``/``<s>``/``</s>`` = 0/1/2).
- ``bytelevel``: a GPT-2-style byte-level BPE with ``<|endoftext|>`` as the last id.

Each comes with a ~1.3M parameter ``LlamaForCausalLM`` (GQA: 4 query heads, 2 kv heads)
trained for a few hundred steps on the corpus so the demo prints corpus-like text.
Two builds on one machine are byte-identical. Builds on different CPUs are not: the
weights are trained here, and float results differ between x86-64 kernels (AVX-512,
AVX2, none), so what the model says differs too. Tests derive their expectations on the
machine (a reference run, or stop ids / ignore_eos set explicitly), never from a
remembered answer.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from workers.cache import cache_root

# Bump whenever the output of a build changes; it names the cache directory.
BUILDER_VERSION = 1
KINDS = ("spm", "bytelevel")
VOCAB_SIZE = 2000
MANIFEST = "genpipe-tiny.json"
CORPUS_DIR = Path(__file__).parent / "corpus"

# spm: characters seen fewer times than this are left out of the alphabet, so rare CJK
# and emoji characters are encoded as byte pieces (what the derender must handle).
MIN_CHAR_COUNT = 3

# ~50k training tokens (about 10 passes over the ~5k-token corpus): ~12 s of one CPU
# core, enough to get the loss from 7.6 to ~1.7 so samples look like the corpus.
TRAIN_STEPS = 100
TRAIN_BATCH = 8
TRAIN_SEQ_LEN = 64
TRAIN_LR = 1e-2
# With the usual 0.02 the model sat on unigram statistics for the whole (short) run.
INIT_STD = 0.1

SPM_SPECIALS = ("<unk>", "<s>", "</s>")
EOT = "<|endoftext|>"

# "[role]: content" turns joined by newlines; an assistant turn ends with eos so the model
# learns to stop. The generation prompt has no trailing space: the first sampled token
# carries its own (`▁Hello` / `ĠHello`).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "[{{ message['role'] }}]: {{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{% if messages %}{{ '\\n' }}{% endif %}[assistant]:"
    "{% endif %}"
)


# --------------------------------------------------------------------------- corpus


def read_corpus() -> list[str]:
    """Documents of the corpus: blank-line separated blocks, files in name order."""
    docs: list[str] = []
    for path in sorted(CORPUS_DIR.glob("*.txt")):
        block: list[str] = []
        for line in path.read_text("utf-8").splitlines() + [""]:
            if line.strip():
                block.append(line)
            elif block:
                docs.append("\n".join(block))
                block = []
    return docs


def _is_chat(doc: str) -> bool:
    return doc.startswith("[user]: ")


# --------------------------------------------------------------------------- tokenizers


def _spm_alphabet(lines: list[str]) -> list[str]:
    # Chosen here rather than with BpeTrainer(limit_alphabet=...): the trainer breaks
    # count ties at the cut-off in hash-map order, which differs between runs.
    counts = Counter(ch for line in lines for ch in line.replace(" ", "▁"))
    counts["▁"] += len(lines)
    return sorted(ch for ch, n in counts.items() if n >= MIN_CHAR_COUNT)


def _renumber(tok_json: dict[str, Any], vocab: list[str], specials: dict[str, int]) -> dict:
    """Give `vocab` ids 0.. in order and point the added (special) tokens at them."""
    tok_json["model"]["vocab"] = {piece: i for i, piece in enumerate(vocab)}
    for added in tok_json["added_tokens"]:
        added["id"] = specials[added["content"]]
    return tok_json


def _build_spm(docs: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    # Train on single lines: no newline in the alphabet, so "\n" becomes <0x0A> as in Llama.
    lines = [line for doc in docs for line in doc.split("\n")]
    alphabet = _spm_alphabet(lines)
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    # "first": a leading ▁ on the first word only, none after special tokens (Llama
    # non-legacy). split=True keeps merges inside words, like SentencePiece.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 256,
        special_tokens=list(SPM_SPECIALS),
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)

    # Llama layout: specials, then the 256 byte pieces as ordinary vocabulary (never
    # added/special tokens, or decode() would drop them), then the trained pieces.
    tok_json = json.loads(tok.to_str())
    trained = sorted(tok_json["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = [*SPM_SPECIALS, *(f"<0x{b:02X}>" for b in range(256))]
    vocab += [piece for piece, _ in trained if piece not in SPM_SPECIALS]
    specials = {s: i for i, s in enumerate(SPM_SPECIALS)}
    tok = Tokenizer.from_str(json.dumps(_renumber(tok_json, vocab, specials)))

    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),  # drops the space of the first ▁ (even for one id)
        ]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", 1)]
    )
    return tok


def _build_bytelevel(docs: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)

    # GPT-2 keeps <|endoftext|> as the last id; do the same so code never assumes
    # "specials come first".
    tok_json = json.loads(tok.to_str())
    trained = sorted(tok_json["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = [piece for piece, _ in trained if piece != EOT] + [EOT]
    tok = Tokenizer.from_str(json.dumps(_renumber(tok_json, vocab, {EOT: len(vocab) - 1})))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def build_tokenizer(kind: str = "spm"):
    """The trained `tokenizers.Tokenizer` of one kind (deterministic)."""
    docs = read_corpus()
    if kind == "spm":
        return _build_spm(docs)
    if kind == "bytelevel":
        return _build_bytelevel(docs)
    raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {KINDS}")


def _special_tokens(kind: str) -> dict[str, str]:
    if kind == "spm":
        return {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    return {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}


def save_tokenizer(tok, kind: str, out: Path) -> None:
    # Written by hand rather than by save_pretrained: the file set and format of that
    # differ between transformers versions; this loads with 4.x and 5.x alike.
    tok.save(str(out / "tokenizer.json"), pretty=True)
    specials = _special_tokens(kind)
    config = {
        **specials,
        "added_tokens_decoder": {
            str(i): {
                "content": t.content,
                "lstrip": t.lstrip,
                "normalized": t.normalized,
                "rstrip": t.rstrip,
                "single_word": t.single_word,
                "special": t.special,
            }
            for i, t in sorted(tok.get_added_tokens_decoder().items())
        },
        "chat_template": CHAT_TEMPLATE,
        # True would rewrite " ." to "." etc. and break exact round trips.
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", specials)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n", "utf-8")


# --------------------------------------------------------------------------- model


@contextlib.contextmanager
def _deterministic_torch(seed: int) -> Iterator[None]:
    """One intra-op thread and a seeded RNG; the caller's settings come back after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # reductions split across threads are not bitwise stable
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        torch.set_num_threads(threads)


def _training_stream(tok, kind: str) -> list[int]:
    """All corpus documents as one id stream, each wrapped in bos ... eos."""
    specials = _special_tokens(kind)
    bos, eos = tok.token_to_id(specials["bos_token"]), tok.token_to_id(specials["eos_token"])
    stream: list[int] = []
    for doc in read_corpus():
        if _is_chat(doc):
            # Exactly what the chat template renders for a user/assistant pair, so the
            # model sees at training time the ids apply_chat_template produces.
            text = specials["bos_token"] + doc + specials["eos_token"]
            stream += tok.encode(text, add_special_tokens=False).ids
        else:
            stream += [bos, *tok.encode(doc, add_special_tokens=False).ids, eos]
    return stream


def _train(model, stream: list[int], steps: int, seed: int) -> float:
    import torch

    data = torch.tensor(stream, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR, betas=(0.9, 0.95), weight_decay=0.01)
    # 10 warm-up steps, then linear decay to zero.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * (1 - s / steps))
    offsets = torch.arange(TRAIN_SEQ_LEN)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - TRAIN_SEQ_LEN, (TRAIN_BATCH,), generator=gen)
        batch = data[starts[:, None] + offsets]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()
    return loss.item()


def build_tiny_model(
    out_dir: str | os.PathLike,
    kind: str = "spm",
    seed: int = 0,
    *,
    train_steps: int = TRAIN_STEPS,
    overwrite: bool = False,
) -> Path:
    """Build the tiny model of `kind` into `out_dir` (a Hugging Face model directory).

    `train_steps=0` keeps the seeded random weights. Refuses a non-empty `out_dir`
    unless `overwrite`. Returns the directory.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if kind not in KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {KINDS}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer(kind)
    save_tokenizer(tok, kind, out)
    specials = _special_tokens(kind)
    bos, eos = tok.token_to_id(specials["bos_token"]), tok.token_to_id(specials["eos_token"])

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA on purpose: engines must handle kv heads != heads
        intermediate_size=352,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        initializer_range=INIT_STD,
        dtype="float32",
    )
    with _deterministic_torch(seed):
        # Eager attention trains ~15% faster than SDPA at this size; loaders pick their own.
        model = LlamaForCausalLM._from_config(config, attn_implementation="eager").to(torch.float32)
        final_loss = _train(model, _training_stream(tok, kind), train_steps, seed) if train_steps else None
    model.generation_config = GenerationConfig(
        bos_token_id=bos, eos_token_id=eos, pad_token_id=eos, do_sample=False
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in `model tiny` or the demo
    model.save_pretrained(out, safe_serialization=True)

    _write_json(
        out / MANIFEST,
        {
            "builder": "genpipe.tinymodel",
            "builder_version": BUILDER_VERSION,
            "kind": kind,
            "seed": seed,
            "train_steps": train_steps,
            "final_loss": None if final_loss is None else round(final_loss, 4),
            "vocab_size": tok.get_vocab_size(),
            "num_parameters": sum(p.numel() for p in model.parameters()),
        },
    )
    return out


def read_manifest(model_dir: str | os.PathLike) -> dict[str, Any] | None:
    try:
        return json.loads((Path(model_dir) / MANIFEST).read_text("utf-8"))
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- cache


def cached_model_dir(kind: str = "spm") -> Path | None:
    """The cached tiny model of `kind` if it is built already, else None."""
    target = cache_root() / "models" / f"tiny-{kind}-v{BUILDER_VERSION}"
    return target if _is_valid(target, kind) else None


def default_model_dir(kind: str = "spm") -> Path:
    """The cached tiny model of `kind` (seed 0), built on first use.

    Safe with several processes at once: each builds into a temp dir next to the target
    and renames it into place; a loser of the race throws its copy away.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {KINDS}")
    target = cache_root() / "models" / f"tiny-{kind}-v{BUILDER_VERSION}"
    if _is_valid(target, kind):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build_tiny_model(tmp, kind=kind, seed=0, overwrite=True)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache may be shared
        try:
            os.rename(tmp, target)  # atomic; fails if another process got there first
        except OSError:
            if not target.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not _is_valid(target, kind):
        raise RuntimeError(f"{target} exists but is not a tiny {kind} model; delete it to rebuild")
    return target


def _is_valid(target: Path, kind: str) -> bool:
    manifest = read_manifest(target)
    return bool(
        manifest
        and manifest.get("kind") == kind
        and manifest.get("builder_version") == BUILDER_VERSION
        and manifest.get("seed") == 0
    )
