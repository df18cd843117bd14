"""Numerics of low-precision training: a debug recipe in fp32, FP8 and MXFP8 (emulated), the
three loss curves in one PNG and the final-loss gaps to fp32.

    uv run python apps/titan_train/benchmarks/low_precision_numerics.py \\
        [--recipe llama3_debug] [--steps 200] [--out numerics.png] [--kernels auto]
        [-- extra titan-train args, e.g. --training.device cuda]

Each run is a fresh ``titan-train`` process with the recipe's settings and ``--quantize.linear``
(and, for MoE recipes, ``--quantize.experts``) set to the mode, kernels emulated by default
(the device kernels' quantisation, products in fp32), logging every step. The gap is that of the mean
loss over the last 10 % of the steps (single-step losses are noisy), relative to fp32. A
loss gap transfers to accelerators as is: the emulation rounds exactly as the kernels do.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("none", "fp8_rowwise", "mxfp8")
LABELS = {"none": "unquantised", "fp8_rowwise": "FP8 rowwise", "mxfp8": "MXFP8"}


def _run(
    recipe: str, mode: str, steps: int, out: str, kernels: str, extra: list[str]
) -> list[float]:
    from titan_train.recipes import get_recipe

    moe = "moe" in get_recipe(recipe).model.family or recipe.startswith("deepseek")
    cmd = [
        sys.executable, "-m", "titan_train", "--recipe", recipe, "--name", mode,
        "--training.steps", str(steps), "--metrics.log-every", "1",
        "--metrics.validate-every", "0", "--metrics.no-tensorboard", "--output-dir", out,
        "--quantize.linear", mode, "--quantize.kernels", kernels,
        *(["--quantize.experts", mode] if moe else []), *extra,
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ))
    rows = [json.loads(line) for line in (Path(out) / mode / "metrics.jsonl").open()]
    return [r["loss"] for r in rows if r.get("split") == "train"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="llama3_debug")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="low_precision_numerics.png")
    parser.add_argument(
        "--modes", nargs="+", default=list(MODES[1:]), choices=MODES[1:],
        help="quantised runs next to the unquantised one (mxfp8 kernels need sm100)",
    )  # fmt: skip
    parser.add_argument(
        "--kernels", choices=("emulated", "auto"), default="emulated",
        help="auto: the device's fp8 kernels (with -- --training.device cuda)",
    )  # fmt: skip
    parser.add_argument("extra", nargs="*", help="more titan-train arguments (after --)")
    args = parser.parse_args()
    curves = {}
    with tempfile.TemporaryDirectory() as out:
        for mode in ("none", *args.modes):
            curves[mode] = _run(args.recipe, mode, args.steps, out, args.kernels, args.extra)
    tail = max(1, len(curves["none"]) // 10)
    final = {m: sum(c[-tail:]) / len(c[-tail:]) for m, c in curves.items()}
    print(f"{args.recipe}, {args.steps} steps, kernels {args.kernels} {' '.join(args.extra)}")
    print(f"mean loss of the last {tail} steps:")
    for m in curves:
        gap = (final[m] - final["none"]) / final["none"]
        print(f"{LABELS[m]:12s} final loss {final[m]:.4f}   gap to unquantised {gap:+.2%}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for m in curves:
        ax.plot(range(1, len(curves[m]) + 1), curves[m], label=LABELS[m], lw=1)
    ax.set(
        xlabel="step", ylabel="train loss", title=f"{args.recipe}: FP8 and MXFP8 ({args.kernels})"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"curves: {args.out}")


if __name__ == "__main__":
    main()
