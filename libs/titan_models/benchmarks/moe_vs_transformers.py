"""Forward+backward tokens/s of our Qwen3-MoE / DeepSeek-V3 vs transformers, same weights.

    uv run python libs/titan_models/benchmarks/moe_vs_transformers.py [--threads 2]
        [--rounds 5] [--batch 4] [--seq 256]

Both families at the size of our ``debug`` flavours, fp32. The HF model is built random-init
from the config, saved, and loaded with ``from_hf``, so both hold identical weights (the
parity is checked before timing). Same input, same loss (``F.cross_entropy`` outside both
models); ours in ``eval()`` mode like the HF one computes no balance loss; transformers with
``use_cache=False``, as in training. Steps are
interleaved (ours, theirs, ours, ...) so load changes hit both; the median and the best step
are reported, with a ratio for each (on a shared machine the best step is the steadier one).
transformers runs its default experts implementation (printed: ``grouped_mm`` where
``torch._grouped_mm`` dispatches, else ``eager``) and SDPA attention.
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

COMMON = dict(vocab_size=2048, hidden_size=128, max_position_embeddings=2048)
CONFIGS = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        rope_theta=1_000_000.0,
    ),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **COMMON,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        moe_intermediate_size=64,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
    ),
}


def step_time(step) -> float:
    t = time.perf_counter()
    step()
    return time.perf_counter() - t


def compare(family: str, batch: int, seq: int, rounds: int) -> float:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        CONFIGS[family](), attn_implementation="sdpa"
    )
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = titan_models.from_hf(tmp).eval()
    vocab = hf.config.vocab_size
    tokens = torch.randint(0, vocab, (batch, seq))
    labels = torch.randint(0, vocab, (batch, seq))
    with torch.no_grad():
        diff = (ours(tokens) - hf(input_ids=tokens).logits).abs().max().item()

    def loss_of(logits):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def ours_step():
        ours.zero_grad(set_to_none=True)
        loss_of(ours(tokens)).backward()

    def hf_step():
        hf.zero_grad(set_to_none=True)
        loss_of(hf(input_ids=tokens, use_cache=False).logits).backward()

    for _ in range(2):  # warm-up
        ours_step(), hf_step()
    times = {"titan_models": [], "transformers": []}
    for _ in range(rounds):
        times["titan_models"].append(step_time(ours_step))
        times["transformers"].append(step_time(hf_step))

    ntok = batch * seq
    flops = titan_models.flops_per_token(ours.config, seq) * ntok
    print(
        f"\n{family} fp32 (our debug size): {ours.config.num_layers} layers, dim "
        f"{ours.config.dim}, 8 experts top-2, vocab {vocab}, batch {batch} x seq {seq}; "
        f"transformers experts={hf.config._experts_implementation}; "
        f"max |logit diff| {diff:.1e}; {rounds} interleaved steps"
    )
    print(
        f"  {'':14s} {'median s':>9s} {'tokens/s':>10s} {'best s':>8s} {'tokens/s':>10s} {'GFLOP/s':>8s}"
    )
    median, best = {}, {}
    for name, ts in times.items():
        median[name], best[name] = statistics.median(ts), min(ts)
        print(
            f"  {name:14s} {median[name]:9.3f} {ntok / median[name]:10.1f} {best[name]:8.3f} "
            f"{ntok / best[name]:10.1f} {flops / best[name] / 1e9:8.2f}"
        )
    ratio = median["transformers"] / median["titan_models"]
    ratio_best = best["transformers"] / best["titan_models"]
    print(f"  ratio titan_models / transformers: {ratio:.2f}x median, {ratio_best:.2f}x best")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{args.threads} threads, load average {os.getloadavg()[0]:.1f} at start"
    )
    for family in CONFIGS:
        compare(family, args.batch, args.seq, args.rounds)
    print(f"\nload average {os.getloadavg()[0]:.1f} at end")


if __name__ == "__main__":
    main()
