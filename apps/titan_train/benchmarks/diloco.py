"""DiLoCo against fully synchronous fault-tolerant training: the same replica groups, the
final loss and the number of cross-replica reductions.

    uv run python apps/titan_train/benchmarks/diloco.py [--recipe llama3_debug] [--steps 200]
        [--replicas 2] [--sync-steps 5] [--outer LR:MOMENTUM ...] [--out DIR]
        [-- extra titan-train args]

Each run is ``titan-train --fault-tolerance.local-replicas R`` (every group in every quorum:
``--fault-tolerance.min-replicas R``): once with gradients averaged every step, then once per
``--outer`` setting with ``--fault-tolerance.sync-steps H`` (DiLoCo: H inner steps, then an
outer SGD step on the averaged pseudo-gradient with that learning rate and Nesterov momentum;
``1:0`` is plain averaging of the groups' weights). Reported per run: the validation loss at the last step (under
DiLoCo a sync step, so every group holds the same weights), the training loss averaged over
the groups and the last 10 % of the steps, and ``replica_syncs`` (the model-sized
cross-replica all-reduces: gradients, or pseudo-gradients). ``--out DIR`` keeps the runs
(a run whose groups all logged the last step there is read, not run again).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _run(
    name: str, args: argparse.Namespace, sync_steps: int, out: str, outer: tuple[str, str]
) -> dict[str, float]:
    steps, replicas = args.steps, args.replicas
    cmd = [
        sys.executable, "-m", "titan_train", "--recipe", args.recipe, "--name", name,
        "--training.steps", str(steps), "--metrics.log-every", "1", "--metrics.no-tensorboard",
        "--metrics.validate-every", str(steps), "--output-dir", out, "--checkpoint.interval", "0",
        "--fault-tolerance.local-replicas", str(replicas),
        "--fault-tolerance.min-replicas", str(replicas),
        "--fault-tolerance.sync-steps", str(sync_steps),
        "--fault-tolerance.outer-lr", outer[0], "--fault-tolerance.outer-momentum", outer[1],
        *args.extra,
    ]  # fmt: skip
    files = [Path(out) / name / f"replica-{i}" / "metrics.jsonl" for i in range(replicas)]
    if not all(
        f.exists() and json.loads(f.read_text().splitlines()[-1])["step"] == steps for f in files
    ):
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    tail = max(1, steps // 10)
    train, val, syncs = [], [], []
    for f in files:
        rows = [json.loads(x) for x in f.open()]
        losses = [r["loss"] for r in rows if r["split"] == "train"]
        train.append(statistics.fmean(losses[-tail:]))
        val += [r["loss"] for r in rows if r["split"] == "validation"][-1:]
        syncs.append([r["replica_syncs"] for r in rows if r["split"] == "train"][-1])
    return {"val": statistics.fmean(val), "train": statistics.fmean(train), "syncs": max(syncs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="llama3_debug")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--sync-steps", type=int, default=5)
    parser.add_argument(
        "--outer",
        nargs="+",
        default=["1:0", "0.7:0.9"],
        help="DiLoCo outer LR:MOMENTUM settings, one run each (default: plain averaging, and "
        "the DiLoCo paper's 0.7:0.9, the config's default)",
    )
    parser.add_argument("--out", default=None, help="folder for the runs (default: temporary)")
    parser.add_argument("extra", nargs="*", help="titan-train arguments (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or tmp
        sync = _run("sync", args, 1, out, ("1", "0"))
        runs = {}
        for setting in args.outer:
            lr, momentum = setting.split(":")
            name = f"diloco_h{args.sync_steps}_lr{lr}_m{momentum}"
            runs[f"DiLoCo H={args.sync_steps}, outer lr {lr} momentum {momentum}"] = _run(
                name, args, args.sync_steps, out, (lr, momentum)
            )
    print(
        "| run | validation loss | gap to synchronous | train loss (last 10 %) | cross-replica reductions |"
    )
    print("|---|---:|---:|---:|---:|")
    print(f"| synchronous | {sync['val']:.4f} | | {sync['train']:.4f} | {sync['syncs']} |")
    for name, r in runs.items():
        gap = r["val"] / sync["val"] - 1
        print(f"| {name} | {r['val']:.4f} | {gap:+.2%} | {r['train']:.4f} | {r['syncs']} |")
    print(f"\n{sync['syncs'] / max(r['syncs'] for r in runs.values()):.1f}x fewer reductions")


if __name__ == "__main__":
    main()
