"""Numerics of low-precision training: a debug recipe in fp32, FP8, MXFP8 and NVFP4 (emulated),
the loss curves in one PNG and the final-loss gaps to fp32.

    uv run python apps/titan_train/benchmarks/low_precision_numerics.py \\
        [--recipe llama3_debug] [--steps 200] [--seeds 0 1 2] [--out numerics.png] [--kernels auto]
        [-- extra titan-train args, e.g. --training.device cuda]

Each run is a fresh ``titan-train`` process with the recipe's settings and ``--quantize.linear``
(and, for MoE recipes and fp8 modes, ``--quantize.experts``) set to the mode, kernels emulated by default
(the device kernels' quantisation, products in fp32), logging every step. The final loss of a
run is its mean over the last 10 % of the steps (single-step losses are noisy); each mode runs
with ``--seeds`` seeds (weights and data order), and the gap is that of the mean final losses,
relative to fp32, printed next to the seed-to-seed spread of fp32 itself so that a gap can be
told from noise. A loss gap transfers to accelerators as is: the emulation rounds exactly as
the kernels do. On a CPU whose cores other jobs share, run it with ``OMP_NUM_THREADS=1``
(the runs inherit the environment): two contended OpenMP threads make every elementwise
pass, and so the emulated steps, many times slower.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("none", "fp8_rowwise", "mxfp8", "nvfp4")
LABELS = {"none": "unquantised", "fp8_rowwise": "FP8 rowwise", "mxfp8": "MXFP8", "nvfp4": "NVFP4"}


def _run(
    recipe: str, mode: str, seed: int, steps: int, out: str, kernels: str, extra: list[str]
) -> list[float]:
    from titan_train.recipes import get_recipe

    moe = "moe" in get_recipe(recipe).model.family or recipe.startswith("deepseek")
    cmd = [
        sys.executable, "-m", "titan_train", "--recipe", recipe, "--name", f"{mode}-{seed}",
        "--training.steps", str(steps), "--training.seed", str(seed), "--metrics.log-every", "1",
        "--metrics.validate-every", "0", "--metrics.no-tensorboard", "--output-dir", out,
        "--checkpoint.interval", "0",
        "--quantize.linear", mode, "--quantize.kernels", kernels,
        *(["--quantize.experts", mode] if moe and mode != "nvfp4" else []), *extra,
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ))
    rows = [json.loads(line) for line in (Path(out) / f"{mode}-{seed}" / "metrics.jsonl").open()]
    return [r["loss"] for r in rows if r.get("split") == "train"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="llama3_debug")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2],
        help="one run per mode and seed (weights and data order; runs are bitwise repeatable)",
    )  # fmt: skip
    parser.add_argument("--out", default="low_precision_numerics.png")
    parser.add_argument(
        "--modes", nargs="+", default=list(MODES[1:3]), choices=MODES[1:],
        help="quantised runs next to the unquantised one (mxfp8, nvfp4 kernels need sm100)",
    )  # fmt: skip
    parser.add_argument(
        "--kernels", choices=("emulated", "auto"), default="emulated",
        help="auto: the device's fp8 kernels (with -- --training.device cuda)",
    )  # fmt: skip
    parser.add_argument("extra", nargs="*", help="more titan-train arguments (after --)")
    args = parser.parse_args()
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        parser.error(f"--seeds must be distinct non-negative integers, got {args.seeds}")
    modes, seeds = ("none", *args.modes), args.seeds
    curves: dict[str, list[list[float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as out:
        for seed in seeds:  # seed-major: an interrupted run has every mode of a seed
            for mode in modes:
                curves[mode].append(
                    _run(args.recipe, mode, seed, args.steps, out, args.kernels, args.extra)
                )
    tail = max(1, args.steps // 10)
    finals = {m: [statistics.fmean(c[-tail:]) for c in cs] for m, cs in curves.items()}
    mean = {m: statistics.fmean(f) for m, f in finals.items()}
    print(f"{args.recipe}, {args.steps} steps, seeds {args.seeds}, kernels {args.kernels}")
    print(f"final loss = mean of the last {tail} steps; per seed, then the mean over seeds:")
    for m in modes:
        per_seed = " ".join(f"{f:.4f}" for f in finals[m])
        gap = (mean[m] - mean["none"]) / mean["none"]
        print(f"{LABELS[m]:12s} {per_seed}   mean {mean[m]:.4f}   gap to unquantised {gap:+.2%}")
    if len(seeds) > 1:
        spread = statistics.stdev(finals["none"]) / mean["none"]
        print(f"seed-to-seed spread of the unquantised final loss (stdev / mean): {spread:.2%}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for m in modes:  # the mean curve over seeds
        avg = [statistics.fmean(step) for step in zip(*curves[m], strict=True)]
        ax.plot(range(1, len(avg) + 1), avg, label=LABELS[m], lw=1)
    ax.set(
        xlabel="step",
        ylabel="train loss",
        title=f"{args.recipe}: low precision ({args.kernels}, mean of {len(seeds)} seeds)",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"curves: {args.out}")


if __name__ == "__main__":
    main()
