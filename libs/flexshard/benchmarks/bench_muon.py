"""Muon optimizer step: Owned (Newton–Schulz on the owner, no collective) vs the Shard(0)
baseline (all-gather each update, orthogonalise on every rank, keep the shard).

Prints both median step times and the ratio Owned / gather (goal <= 0.5).

    uv run python libs/flexshard/benchmarks/bench_muon.py [--world 2] [--dim 512] ...
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
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    cfg = {
        k: getattr(a, k) for k in ("dim", "layers", "hidden", "vocab", "heads", "warmup", "steps")
    }
    out = run_distributed(R.muon_step_bench, a.world, cfg, timeout=1800, num_threads=a.threads)
    res = {
        mode: (max(o[mode]["step_s"] for o in out), out[0][mode]["optim_comm"]["bytes"])
        for mode in ("gather", "owned")
    }
    print(f"model {cfg}, world {a.world}, gloo; Muon on the block matrices, AdamW on the rest")
    for mode, (t, comm) in res.items():
        per_step = sum(comm.values()) // (a.warmup + a.steps)
        print(f"{mode:8s} optimizer step {t:8.3f} s   collective bytes/rank/step {per_step:>12,d}")
    print(f"Muon step time ratio owned/gather: {res['owned'][0] / res['gather'][0]:.3f}")


if __name__ == "__main__":
    main()
