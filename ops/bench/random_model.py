"""Write a model directory of a Llama-family shape with random weights and the tiny spm
tokenizer: the real engine at a realistic size, behind workers that load a directory
(`ops/bench/throughput.py --engine model`, ops/device/throughput_gpu.sh). No model hub
is reachable from this project's machines, so no real weights.

The vocabulary is the tiny tokenizer's (2,000 ids, not Llama 3's 128,256): the derender
decodes every sampled id with the tokenizer it is given, and an id past its vocabulary
would be an error result. So the lm_head is 1/64 of the shape's real one, and a step a
little faster than the real model's (`ops/bench/gpu_engine.py` times the real vocabulary):
that asks more of the Kafka side, not less.

    python ops/bench/random_model.py --shape 1b --out DIR [--device cuda] [--max-len 1024]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from ops.bench.gpu_engine import SHAPES, make_model  # noqa: E402
from workers.models.tinymodel import build_tokenizer, save_tokenizer  # noqa: E402


def write_random_model(shape: str, out: Path, device: str = "cpu", max_len: int = 1024) -> int:
    """`shape`'s layers with random bf16 weights (seeded) and the tiny spm tokenizer, in
    `out`; returns the number of parameters."""
    tokenizer = build_tokenizer("spm")
    model = make_model(shape, torch.device(device), torch.bfloat16, max_len,
                       vocab_size=tokenizer.get_vocab_size(with_added_tokens=True))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)  # (weights made on `device`, where random init is fast)
    save_tokenizer(tokenizer, "spm", out)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", type=Path, required=True, help="the model directory to write")
    parser.add_argument("--device", default="cpu", help="where the random weights are made (cuda: fast)")
    parser.add_argument("--max-len", type=int, default=1024, help="the config's max_position_embeddings")
    args = parser.parse_args(argv)
    params = write_random_model(args.shape, args.out, args.device, args.max_len)
    print(f"wrote {args.shape} ({params / 1e6:,.1f}M parameters, bf16, the tiny spm vocabulary) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
