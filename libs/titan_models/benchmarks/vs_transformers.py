"""Forward+backward tokens/s of titan_models vs Hugging Face transformers, same config/weights.

    uv run python libs/titan_models/benchmarks/vs_transformers.py [--family llama3|qwen3]
        [--threads 2] [--rounds 5] [--skip-bf16] [--compile]

Both models get identical weights (the HF model is saved and loaded with ``from_hf``), the same
input and the same loss (``F.cross_entropy`` on the logits, outside both models); transformers
runs with ``use_cache=False``, as in training (no KV cache is built). Steps are
interleaved (ours, theirs, ours, ...) so a change in machine load hits both; the median step
time is reported. CPU "MFU" is ``flops_per_token × tokens/s`` over the FLOP/s of a large
matmul measured in the same run. fp32 is the main row; the bf16 row uses a much smaller config
(stated in the output) because on some of these CPUs a bf16 matmul is ~150–400× slower.
``--compile`` adds an fp32 row where every transformer block of *both* models is
``torch.compile``d (``module.compile()``; embedding, head and loss stay eager); compilation
happens in the warm-up step and is not timed. Eager rows are the default and the target.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
import transformers

import titan_models

MAIN = dict(layers=8, dim=512, heads=8, kv_heads=4, ffn=1536, vocab=32000, seq=512, batch=4)
SMALL_BF16 = dict(layers=2, dim=256, heads=4, kv_heads=2, ffn=768, vocab=4096, seq=128, batch=2)


def hf_config(family: str, c: dict) -> transformers.PretrainedConfig:
    common = dict(
        vocab_size=c["vocab"],
        hidden_size=c["dim"],
        intermediate_size=c["ffn"],
        num_hidden_layers=c["layers"],
        num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"],
        head_dim=c["dim"] // c["heads"],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    if family == "llama3":
        return transformers.LlamaConfig(rope_theta=500_000.0, rms_norm_eps=1e-5, **common)
    return transformers.Qwen3Config(rope_theta=1_000_000.0, rms_norm_eps=1e-6, **common)


def matmul_flops(dtype: torch.dtype, n: int) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def step_time(step) -> float:
    t = time.perf_counter()
    step()
    return time.perf_counter() - t


def compare(
    family: str, c: dict, dtype: torch.dtype, rounds: int, peak: float, compile: bool = False
) -> None:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        hf_config(family, c), attn_implementation="sdpa"
    )
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = titan_models.from_hf(tmp, dtype=dtype)
    hf = hf.to(dtype)
    if compile:
        for block in (*ours.layers.values(), *hf.model.layers):
            block.compile()
    tokens = torch.randint(0, c["vocab"], (c["batch"], c["seq"]))
    labels = torch.randint(0, c["vocab"], (c["batch"], c["seq"]))

    def loss_of(logits):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    def ours_step():
        ours.zero_grad(set_to_none=True)
        loss_of(ours(tokens)).backward()

    def hf_step():
        hf.zero_grad(set_to_none=True)
        loss_of(hf(input_ids=tokens, use_cache=False).logits).backward()

    ours_step(), hf_step()  # warm-up
    times = {"titan_models": [], "transformers": []}
    for _ in range(rounds):
        times["titan_models"].append(step_time(ours_step))
        times["transformers"].append(step_time(hf_step))

    cfg = ours.config
    ntok = c["batch"] * c["seq"]
    flops = titan_models.flops_per_token(cfg, c["seq"]) * ntok
    print(
        f"\n{family} {str(dtype).removeprefix('torch.')}{' compiled blocks' if compile else ''}: "
        f"{c['layers']} layers, dim {c['dim']}, "
        f"heads {c['heads']}/{c['kv_heads']} kv, ffn {c['ffn']}, vocab {c['vocab']}, "
        f"batch {c['batch']} x seq {c['seq']}, {rounds} interleaved steps (median)"
    )
    print(f"  {'':14s} {'step s':>8s} {'tokens/s':>10s} {'GFLOP/s':>9s} {'CPU MFU':>8s}")
    rate = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rate[name] = ntok / med
        print(
            f"  {name:14s} {med:8.3f} {rate[name]:10.1f} {flops / med / 1e9:9.1f} "
            f"{flops / med / peak:8.1%}"
        )
    print(
        f"  ratio titan_models / transformers: {rate['titan_models'] / rate['transformers']:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["llama3", "qwen3"], default="llama3")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-bf16", action="store_true")
    parser.add_argument(
        "--compile", action="store_true", help="also an fp32 row with both models' blocks compiled"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{args.threads} threads, load average {os.getloadavg()[0]:.1f} at start"
    )
    peak32 = matmul_flops(torch.float32, 2048)
    print(f"measured fp32 matmul (2048^3): {peak32 / 1e9:.1f} GFLOP/s")
    compare(args.family, MAIN, torch.float32, args.rounds, peak32)
    if not args.skip_bf16:
        peak16 = matmul_flops(torch.bfloat16, 512)
        print(f"\nmeasured bf16 matmul (512^3): {peak16 / 1e9:.2f} GFLOP/s")
        print(
            "bf16 uses a much smaller config: on some of these CPUs bf16 matmul is 150-400x slower"
        )
        compare(args.family, SMALL_BF16, torch.bfloat16, args.rounds, peak16)
    if args.compile:
        compare(args.family, MAIN, torch.float32, args.rounds, peak32, compile=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} at end")


if __name__ == "__main__":
    main()
