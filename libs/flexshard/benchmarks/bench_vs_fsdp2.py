"""flexshard (Shard(0) per block + root) vs torch FSDP2 ``fully_shard`` (per block + root).

Same model, same meta-device init, same AdamW, 2 ranks on gloo (CPU). Prints the median
step time and the peak resident memory growth of a training step for each, and the
ratios flexshard / FSDP2 (goal: both <= 1.0).

    uv run python libs/flexshard/benchmarks/bench_vs_fsdp2.py [--world 2] [--dim 512] ...
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
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    cfg = {
        k: getattr(a, k)
        for k in ("dim", "layers", "hidden", "vocab", "heads", "batch", "seq", "warmup", "steps")
    }
    res = {}
    for lib in ("fsdp2", "flexshard"):
        out = run_distributed(
            R.train_step_bench, a.world, lib, cfg, timeout=1800, num_threads=a.threads
        )
        res[lib] = {
            "step_s": max(o["step_s"] for o in out),
            "peak_mb": max(o["peak_bytes"] for o in out) / 2**20,
            "param_mb": out[0]["param_bytes_local"] / 2**20,
        }
    print(f"model {cfg}, world {a.world}, gloo")
    print(f"{'':12s} {'step (s)':>10s} {'peak +MiB':>10s} {'params/rank MiB':>16s}")
    for lib, r in res.items():
        print(f"{lib:12s} {r['step_s']:10.3f} {r['peak_mb']:10.1f} {r['param_mb']:16.1f}")
    print(
        f"step time ratio flexshard/fsdp2: {res['flexshard']['step_s'] / res['fsdp2']['step_s']:.3f}"
    )
    print(
        f"peak memory ratio flexshard/fsdp2: {res['flexshard']['peak_mb'] / res['fsdp2']['peak_mb']:.3f}"
    )


if __name__ == "__main__":
    main()
