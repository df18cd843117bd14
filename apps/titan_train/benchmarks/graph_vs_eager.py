"""Graph mode vs eager vs local compile: step time and peak memory of the train step.

Run: ``uv run python apps/titan_train/benchmarks/graph_vs_eager.py`` (CPU, fp32) or
``... --device cuda --seq-len 512 --batch-size 8`` on a GPU (``tools/gpu_check.sh`` runs it).
Each mode runs in its own process: ``warmup`` steps (tracing / compiling happen there) then
``steps`` timed steps of ``train_step`` on the same batches; the median step time is
reported. Peak memory: ``torch.cuda.max_memory_allocated`` over the timed steps on CUDA, the
process's peak resident set on CPU (weights, optimizer state, Python and all). The graph
rows also check the loss of every step against eager (``torch.equal``).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time

MODES = {
    "eager": [],
    "local": ["--compile.mode", "local"],
    "graph": ["--compile.mode", "graph"],
    "graph+inductor": [
        "--compile.mode", "graph", "--compile.passes", "noop", "dce", "bucket", "inductor",
    ],
}  # fmt: skip


def _one(mode: str, a: argparse.Namespace) -> dict:
    import torch

    from titan_train.graph.parity import build_job
    from titan_train.trainer import train_step

    torch.set_num_threads(a.threads)
    argv = [
        "--training.batch-size", str(a.batch_size), "--training.seq-len", str(a.seq_len),
        "--training.device", a.device, "--model.attention-backend", "sdpa",
        "--checkpoint.interval", "0", "--metrics.no-tensorboard", *MODES[mode],
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as out:
        cfg, pm, opt, loader = build_job(out, a.recipe, *argv, small=False)
        device = torch.device(a.device)
        batches = [next(loader).to(device) for _ in range(a.warmup + a.steps)]
        losses, times = [], []
        for i, batch in enumerate(batches):
            if i == a.warmup and device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            r = train_step(pm, opt, batch, cfg)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
            losses.append(r.loss.float().cpu())
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "mode": mode,
        "step_ms": 1000 * statistics.median(times),
        "peak_mib": peak / 2**20,
        "losses": [float(x) for x in losses],
        "loss_bits": [x.view(torch.int32).item() for x in losses],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", default="llama3_debug")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one is not None:
        print(json.dumps(_one(a.one, a)))
        return
    rows = []
    for mode in a.modes:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--one", mode]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            print(f"{mode}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    eager = next((r for r in rows if r["mode"] == "eager"), None)
    print(f"{a.recipe} on {a.device}, batch {a.batch_size} x {a.seq_len}, {a.steps} timed steps")
    print(f"{'mode':<16}{'step ms':>10}{'peak MiB':>10}  losses == eager")
    for r in rows:
        same = "-" if eager is None else str(r["loss_bits"] == eager["loss_bits"])
        if eager is not None and r is eager:
            same = "(reference)"
        print(f"{r['mode']:<16}{r['step_ms']:>10.1f}{r['peak_mib']:>10.0f}  {same}")


if __name__ == "__main__":
    main()
