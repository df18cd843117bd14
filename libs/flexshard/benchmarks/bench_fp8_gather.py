"""Block-FP8 all-gather vs bf16 all-gather of the same BlockShard buckets.

Bytes are counted from the buffers each rank hands to ``all_gather_into_tensor`` (fp8 tiles
plus one fp32 scale per tile, vs bf16 tiles). Prints bytes, gather time and the ratios.

    uv run python libs/flexshard/benchmarks/bench_fp8_gather.py [--world 2] [--block 128 128]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
    res = {}
    for q in (None, "fp8_block"):
        out = run_distributed(
            R.fp8_gather_bench, a.world, q, cfg, timeout=1800, num_threads=a.threads
        )
        res[q or "bf16"] = (max(o["gather_s"] for o in out), out[0]["bytes_per_gather"])
    print(f"model {cfg}, world {a.world}, gloo; every matrix BlockShard{cfg['block']}")
    for k, (t, nbytes) in res.items():
        print(f"{k:10s} bytes sent/rank per full gather {nbytes:>14,d}   gather time {t:8.4f} s")
    print(f"fp8_block/bf16 bytes ratio: {res['fp8_block'][1] / res['bf16'][1]:.4f}")
    print(f"fp8_block/bf16 gather time ratio: {res['fp8_block'][0] / res['bf16'][0]:.3f}")


if __name__ == "__main__":
    main()
