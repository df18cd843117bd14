"""Speed of the emulated NVFP4 linears: one llama3 debug training step (forward and backward,
every linear but the head in NVFP4) against fp32, optionally against the NVFP4 codec of an
earlier git revision in the same process (its losses and gradients must agree bit for bit).

    uv run python libs/titan_models/benchmarks/nvfp4_emulation.py \\
        [--batch 8] [--seq 128] [--steps 5] [--threads 1] [--against REV]

Times are per step, the best of ``--steps`` steps, as CPU time of this process (on a shared
machine less noisy than wall time), and wall time next to it. With ``--against``, also the
codec alone: the six operands of the largest linear's three GEMMs (x, w; dy, w.T; dy.T, x.T
for 1024 tokens, 256 -> 768), best of 20.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from titan_models import Float8Recipe, get_model, quantize_modules
from titan_models.components import nvfp4, scaled_mm

NVFP4_PATH = "libs/titan_models/src/titan_models/components/nvfp4.py"


def _codec_at(rev: str):
    """The nvfp4 module as of git revision ``rev``."""
    root = Path(__file__).resolve().parents[3]
    src = subprocess.run(
        ["git", "-C", str(root), "show", f"{rev}:{NVFP4_PATH}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / f"nvfp4_{rev}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"nvfp4_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _codec_times(previous, rev: str) -> None:
    """CPU ms of ``round_trip`` over one linear's six GEMM operands, ``rev`` and this tree."""
    g = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*s, generator=g) for s in ((1024, 256), (768, 256), (1024, 768)))
    operands = (x, w, dy, w.T, dy.T, x.T)
    for name, codec in ((f"@ {rev}", previous), ("this tree", nvfp4)):
        best = float("inf")
        for _ in range(20):
            c = time.process_time()
            for op in operands:
                codec.round_trip(op)
            best = min(best, time.process_time() - c)
        print(f"codec, one linear's six operands, {name:16s} cpu {best * 1e3:7.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--against", metavar="REV", help="also time nvfp4.py of this revision")
    args = parser.parse_args()
    if min(args.batch, args.seq, args.steps, args.threads) < 1:
        parser.error("--batch, --seq, --steps and --threads must be positive")
    torch.set_num_threads(args.threads)
    model_cls, config = get_model("llama3", "debug")
    torch.manual_seed(0)
    fp32 = model_cls(config)
    fp32.init_weights()
    quantised = model_cls(config)
    quantised.load_state_dict(fp32.state_dict())
    quantize_modules(quantised, linear=Float8Recipe("nvfp4", emulate=True), exclude=("output",))
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1))

    def step(model):
        model.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    def timed(model) -> tuple[float, float, tuple]:
        out = step(model)  # warm-up
        cpu = wall = float("inf")
        for _ in range(args.steps):
            c, w = time.process_time(), time.perf_counter()
            step(model)
            cpu, wall = min(cpu, time.process_time() - c), min(wall, time.perf_counter() - w)
        return cpu, wall, out

    if args.against:
        _codec_times(_codec_at(args.against), args.against)
    rows = [("fp32", timed(fp32))]
    if args.against:
        scaled_mm.nvfp4 = _codec_at(args.against)
        rows.append((f"nvfp4 @ {args.against}", timed(quantised)))
        scaled_mm.nvfp4 = nvfp4
    rows.append(("nvfp4 (this tree)", timed(quantised)))
    print(f"llama3 debug, batch {args.batch} x seq {args.seq}, {args.threads} thread(s), best of")
    print(f"{args.steps} steps (forward + backward):")
    for name, (cpu, wall, _) in rows:
        print(f"  {name:24s} cpu {cpu * 1e3:8.1f} ms   wall {wall * 1e3:8.1f} ms")
    if args.against:
        (_, _, (l0, g0)), (_, _, (l1, g1)) = rows[1][1], rows[2][1]
        same = torch.equal(l0, l1) and all(map(torch.equal, g0, g1))
        print(f"speedup over {args.against}: {rows[1][1][0] / rows[2][1][0]:.2f}x (cpu time); ")
        print(f"loss and every gradient bitwise equal: {same}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
