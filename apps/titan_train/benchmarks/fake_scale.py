"""Fake-backend steps of every full-size recipe at its production layout: wall time and peak
RSS of the process (each recipe in a fresh one) and the per-rank memory table it writes.

    uv run python apps/titan_train/benchmarks/fake_scale.py [--steps 2] [--recipes ...]

What it measures transfers to the cluster: the parameter, gradient and optimizer bytes per
rank are exact for the layout; activations are the exact count of live storages of the
fake step (with the attention backend the fake device runs, see the app README).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECIPES = {
    "llama3_8b": [],
    "llama3_70b": [],
    "llama3_405b": [],
    "qwen3_32b": [],
    "qwen3_moe_235b": [],
    "deepseek_v3_671b": [],
    "deepseek_v4_flash": [],
    "qwen3_5_moe_35b_a3b": [],
    "kimi_linear_48b_a3b": [],
    "kimi_k25_1t": [],
}


def _world(recipe: str) -> int:
    from titan_train.recipes import get_recipe

    p = get_recipe(recipe).parallel
    return p.dp_replicate * p.dp_shard * p.tp * p.pp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--recipes", nargs="*", default=list(RECIPES))
    parser.add_argument("--out", default="", help="write the rows as JSON here")
    args = parser.parse_args()
    gib = 2**30
    rows = []
    print(
        f"{'recipe':18s} {'ranks':>5s} {'B params':>8s} {'stage':>5s} {'params':>7s} "
        f"{'grads':>7s} {'optim':>7s} {'activ':>7s} {'gather':>7s} {'wall s':>7s} {'RSS GiB':>7s}"
    )
    for recipe in args.recipes:
        with tempfile.TemporaryDirectory() as out:
            cmd = [
                sys.executable, "-m", "titan_train", "--recipe", recipe,
                "--comm.fake-world-size", str(_world(recipe)), *RECIPES[recipe],
                "--training.steps", str(args.steps), "--output-dir", out,
            ]  # fmt: skip
            start = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ))
            wall = time.perf_counter() - start
            report = json.loads((Path(out) / recipe / "memory.json").read_text())
        report["wall_s"] = wall
        rows.append(report)
        for row in report["stages"]:
            cells = [
                row.get(k, 0) / gib
                for k in (
                    "params_bytes",
                    "grads_bytes",
                    "optimizer_bytes",
                    "activations_peak_bytes",
                    "gathered_params_peak_bytes",
                )
            ]
            print(
                f"{recipe:18s} {report['world_size']:5d} {report['parameters'] / 1e9:8.1f} "
                f"{','.join(map(str, row['stages'])):>5s} "
                + " ".join(f"{c:7.2f}" for c in cells)
                + f" {wall:7.0f} {report['peak_rss_bytes'] / gib:7.2f}"
            )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
