"""Block-FP8 all-gather vs the bf16 and fp32 all-gathers of the same BlockShard buckets.

Bytes are counted from the buffers each rank hands to ``all_gather_into_tensor`` (fp8 tiles
plus one fp32 scale per tile, vs bf16 or fp32 tiles): per full gather of the model, and per
training step (forward and backward, whatever the runtime re-gathers). ``fp8_block_pow2`` is
the gather ``titan-train --flexshard.fp8-gather`` uses (scales rounded up to powers of two).
Bytes transfer to any interconnect; the gather times are gloo on a shared CPU (noisy: the
quantise / dequantise runs on the CPU, and loopback is not a network).

    uv run python libs/flexshard/benchmarks/bench_fp8_gather.py [--world 2] [--block 128 128]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_ranks as R

from titan_testing import run_distributed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--block", type=int, nargs=2, default=[128, 128])
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    cfg = {
        k: getattr(a, k) for k in ("dim", "layers", "hidden", "vocab", "heads", "warmup", "steps")
    }
    cfg["block"] = tuple(a.block)
    modes = {  # label -> (Bucket.quantize, param dtype; None: fp32 parameters, no mp)
        "fp32": (None, None),
        "bf16": (None, torch.bfloat16),
        "fp8_block": ("fp8_block", torch.bfloat16),
        "fp8_block_pow2": ("fp8_block_pow2", torch.bfloat16),
    }
    res = {}
    for label, (q, dtype) in modes.items():
        out = run_distributed(
            R.fp8_gather_bench, a.world, q, cfg, dtype, timeout=1800, num_threads=a.threads
        )
        res[label] = {
            "t": max(o["gather_s"] for o in out),
            "gather": out[0]["bytes_per_gather"],
            "step": out[0]["bytes_per_step"],
        }
    print(f"model {cfg}, world {a.world}, gloo; every matrix BlockShard{cfg['block']}")
    print(f"{'gather':16s} {'bytes/rank per gather':>22s} {'per train step':>15s} {'time':>9s}")
    for k, r in res.items():
        print(f"{k:16s} {r['gather']:>22,d} {r['step']:>15,d} {r['t']:8.4f}s")
    for q in ("fp8_block", "fp8_block_pow2"):
        for ref in ("bf16", "fp32"):
            b = res[q]["gather"] / res[ref]["gather"]
            st = res[q]["step"] / res[ref]["step"]
            print(f"{q}/{ref} bytes ratio: per gather {b:.4f}, per train step {st:.4f}")
    print(
        f"fp8_block_pow2/bf16 gather time ratio: {res['fp8_block_pow2']['t'] / res['bf16']['t']:.3f}"
    )


if __name__ == "__main__":
    main()
