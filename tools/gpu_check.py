"""Everything GPU-only in one command, within a hard time budget, with a one-page summary.

    python tools/gpu_check.py [--budget 480] [--extended] [--report gpu_check_report]
                              [--only SUBSTRING ...] [--install-torch]

It first asks the driver (``nvidia-smi``) what is there: no NVIDIA GPU is one line and exit 3
within seconds. The locked torch is a CUDA 13.2 build; when the driver is older (a CUDA 12
driver) torch cannot see the GPU, and the check prints the one command that installs the torch
build matching the driver (``--install-torch`` runs it into this environment first) and exits 4.

The steps run in order, each bounded by its own limit and by what is left of ``--budget``
(default 8 minutes: the core steps' limits sum under it; ``--extended`` adds the long ones,
for a longer lease). A failing step does not stop the others. ``<report>.json`` and
``<report>.txt`` list every step: passed, failed, timed out or skipped (with the reason), its
seconds and the last lines it printed (its measurements). The exit status is 0 when every
step that ran passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 480
"""The default total: 8 minutes for the core steps."""
PROBE_S = 30
"""Kept back from the budget for the probes (driver, torch) and the summary."""

TORCH_CUDA_BUILDS = ("12.6", "12.8", "12.9", "13.0", "13.2")
"""CUDA versions of the torch builds published for the locked torch
(``https://download.pytorch.org/whl/cuXYZ``); the lock's own is 13.2."""


@dataclass(frozen=True)
class Step:
    """One bounded command."""

    name: str
    limit_s: int
    argv: tuple[str, ...]
    min_gpus: int = 1
    min_capability: int = 0
    """Compute capability as ``major * 10 + minor`` (sm90 = 90); 0: any."""
    max_capability: int = 10_000
    extended: bool = False
    """Only with ``--extended`` (it does not fit the default budget)."""
    env: str = ""
    """An environment variable the step needs (skipped, with the reason, when unset)."""


def _uv(*args: str) -> tuple[str, ...]:
    return ("uv", "run", *args)


_TRAIN = (
    "--training.device", "cuda", "--training.mixed-precision", "bf16",
    "--metrics.no-tensorboard", "--metrics.validate-every", "0", "--checkpoint.interval", "0",
    "--metrics.log-every", "10", "--output-dir", "{run}",
)  # fmt: skip
_1B = (
    "--model.flavor", "1B", "--model.vocab-size", "128256", "--training.seq-len", "2048",
    "--training.batch-size", "8", "--lr-schedule.warmup-steps", "10",
)  # fmt: skip

_HOST_SYNCS = "apps/titan_train/tests/test_host_syncs.py"

STEPS: tuple[Step, ...] = (
    # --- core: fits 8 minutes on one GPU ------------------------------------------------------
    Step(
        "pytest -m gpu (NCCL flexshard, CUDA remat, Triton / symmetric memory / CUDA graphs / "
        "CuTe experts, Triton grouped GEMM, CUDA-graph pipeline stage, checkpoint GPU, "
        "FlexAttention and varlen, delta-rule Triton, FP8 GEMMs)",
        200,
        _uv(
            "pytest",
            "-m",
            "gpu",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "--deselect",
            "libs/titan_models/tests/test_nvfp4.py::test_device_gemms_match_the_emulation",
            "--deselect",
            "libs/titan_rl/tests/test_actors.py::test_distributed_grpo_on_cuda",
            "--deselect",  # its own (extended) step: three short training runs
            f"{_HOST_SYNCS}::test_no_cuda_sync_outside_log_steps",
        ),
    ),
    Step(
        "llama3_debug on one GPU, bf16, 50 steps",
        60,
        _uv("titan-train", "--recipe", "llama3_debug", "--training.steps", "50", *_TRAIN),
    ),
    Step(
        "Llama 1B, 30 steps, local compile (tok/s, MFU)",
        120,
        _uv(
            "titan-train",
            "--recipe",
            "llama3_debug",
            "--name",
            "llama3_1b",
            *_1B,
            "--compile.mode",
            "local",
            "--training.steps",
            "30",
            *_TRAIN,
        ),
    ),
    Step(
        "checkpoint load into GPU tensors, 2 -> 1 and 1 -> 2 ranks (pinned staging, H2D overlap)",
        60,
        _uv(
            "python",
            "libs/torch_checkpointing/benchmarks/vs_dcp.py",
            "--device",
            "cuda",
            "--gib",
            "0.25",
            "--ranks",
            "2",
            "--reps",
            "1",
            "--layout",
            "1d",
            "--shard-numel",
            "4194304",
        ),
    ),
    # --- extended: the long ones ------------------------------------------------------------
    Step(
        "symmetric-memory dispatch vs all-to-all",
        90,
        (
            "uv",
            "run",
            "torchrun",
            "--standalone",
            "--nproc-per-node",
            "{gpus}",
            "libs/dist_moe/benchmarks/bench_symm_dispatch.py",
        ),
        min_gpus=2,
        extended=True,
    ),
    Step(
        "CP 2 on NCCL: llama3_debug, 20 steps",
        90,
        _uv(
            "titan-train",
            "--nproc",
            "2",
            "--recipe",
            "llama3_debug",
            "--name",
            "cp2",
            "--parallel.cp",
            "2",
            "--parallel.dp-shard",
            "1",
            "--training.steps",
            "20",
            *_TRAIN,
        ),
        min_gpus=2,
        extended=True,
    ),
    Step(
        "symm_mem dispatch from the app: qwen3_moe_debug at EP 2, 20 steps",
        120,
        _uv(
            "titan-train",
            "--nproc",
            "2",
            "--recipe",
            "qwen3_moe_debug",
            "--name",
            "ep2_symm",
            "--parallel.ep",
            "2",
            "--parallel.dp-shard",
            "2",
            "--moe.dispatch",
            "symm_mem",
            "--training.steps",
            "20",
            *_TRAIN,
        ),
        min_gpus=2,
        extended=True,
    ),
    Step(
        "CUDA-graph pipeline stage = eager (outputs, gradients)",
        60,
        _uv(
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "-m",
            "gpu",
            "libs/pipeline/tests/test_cuda_graph.py",
        ),
        extended=True,
    ),
    Step(
        "grouped GEMM cute: GroupedExperts(gemm='cute') = torch, forward and backward",
        90,
        _uv(
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "-m",
            "gpu",
            "libs/dist_moe/tests/test_cute_gemm.py",
        ),
        min_capability=90,
        max_capability=109,
        extended=True,
    ),
    Step(
        "grouped GEMM triton: triton_grouped_mm and GroupedExperts(gemm='triton') = torch, "
        "fp32 and bf16, forward and backward",
        90,
        _uv(
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "-m",
            "gpu",
            "libs/dist_moe/tests/test_triton_gemm.py",
        ),
        extended=True,
    ),
    Step(
        "host syncs on CUDA: none outside log steps (llama3_debug, qwen3_moe_debug with the "
        "torch and the triton grouped GEMM; sync debug mode)",
        150,
        _uv(
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "-m",
            "gpu",
            f"{_HOST_SYNCS}::test_no_cuda_sync_outside_log_steps",
        ),
        extended=True,  # the core steps' limits already take 440 s of 450
    ),
    Step(
        "checkpoint benchmark vs DCP on the node's own disk: 2 ranks of 2-D state on the GPU; "
        "load, 2 -> 1, 1 -> 2",
        180,
        _uv(
            "python",
            "libs/torch_checkpointing/benchmarks/vs_dcp.py",
            "--device",
            "cuda",
            "--gib",
            "0.5",
            "--ranks",
            "2",
            "--reps",
            "3",
        ),
        extended=True,
    ),
    Step(
        "graph mode vs eager vs local compile (step time, peak memory)",
        240,
        _uv(
            "python",
            "apps/titan_train/benchmarks/graph_vs_eager.py",
            "--device",
            "cuda",
            "--batch-size",
            "8",
            "--seq-len",
            "512",
        ),
        extended=True,
    ),
    Step(
        "CuTe grouped GEMM vs torch._grouped_mm",
        60,
        _uv("python", "libs/dist_moe/benchmarks/bench_cute_grouped_gemm.py"),
        extended=True,
    ),
    Step(
        "pack / combine bandwidth",
        60,
        _uv("python", "libs/dist_moe/benchmarks/bench_pack_bandwidth.py"),
        extended=True,
    ),
    Step(
        "titan_rl: DistributedGRPO on CUDA (NCCL trainer, CUDA replica)",
        120,
        _uv(
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "libs/titan_rl/tests/test_actors.py::test_distributed_grpo_on_cuda",
        ),
        extended=True,
    ),
    Step(
        "titan_rl: vLLM (GPU) = TorchGenerator, incl. multi-turn",
        180,
        ("{TITAN_RL_VLLM_GPU_PYTHON}", "libs/titan_rl/vllm_generator/check_greedy.py"),
        extended=True,
        env="TITAN_RL_VLLM_GPU_PYTHON",
    ),
    Step(
        "NVFP4 scaled_mm vs the emulation (sm100)",
        90,
        _uv(
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "libs/titan_models/tests/test_nvfp4.py::test_device_gemms_match_the_emulation",
        ),
        min_capability=100,
        max_capability=109,
        extended=True,
    ),
    Step(
        "low-precision numerics with the device kernels, llama3_debug 100 steps",
        180,
        _uv(
            "python",
            "apps/titan_train/benchmarks/low_precision_numerics.py",
            "--kernels",
            "auto",
            "--modes",
            "fp8_rowwise",
            "--steps",
            "100",
            "--out",
            "{report}.numerics.png",
            "--",
            "--training.device",
            "cuda",
            "--training.mixed-precision",
            "bf16",
        ),
        extended=True,
    ),
    Step(
        "Llama 1B, quantize.linear=fp8_rowwise, 30 steps",
        120,
        _uv(
            "titan-train",
            "--recipe",
            "llama3_debug",
            "--name",
            "llama3_1b_fp8",
            *_1B,
            "--training.steps",
            "30",
            "--quantize.linear",
            "fp8_rowwise",
            *_TRAIN,
        ),
        extended=True,
    ),
)


@dataclass
class Outcome:
    name: str
    status: str
    """passed, failed, timeout or skipped."""
    seconds: float = 0.0
    reason: str = ""
    tail: list[str] = field(default_factory=list)


def torch_index_for(driver_cuda: str) -> str | None:
    """The torch build a driver supporting CUDA ``driver_cuda`` runs, as a wheel index suffix
    (``"cu129"``): the newest build of the driver's major version (CUDA's minor-version
    compatibility), else of an older major; None when the driver is older than every build."""

    def key(v: str) -> tuple[int, int]:
        major, minor = [*v.split("."), "0"][:2]
        return int(major), int(minor)

    usable = [v for v in TORCH_CUDA_BUILDS if key(v)[0] <= key(driver_cuda)[0]]
    return "cu" + max(usable, key=key).replace(".", "") if usable else None


def probe_driver() -> dict | None:
    """GPUs and the driver's CUDA version from ``nvidia-smi``; None when there is none."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi"], capture_output=True, text=True, timeout=15, check=False
        ).stdout
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=15, check=False,
        ).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    gpus = [line.split(",")[0].strip() for line in names.splitlines() if line.strip()]
    caps = [line.split(",")[-1].strip() for line in names.splitlines() if line.strip()]
    match = re.search(r"CUDA Version:\s*([0-9]+\.[0-9]+)", out)
    if not gpus:
        return None
    capability = int(float(caps[0]) * 10) if caps and re.fullmatch(r"[0-9.]+", caps[0]) else 0
    return {"gpus": gpus, "cuda": match.group(1) if match else "", "capability": capability}


def probe_torch() -> dict:
    """What the environment's torch sees (``uv run``: the locked environment)."""
    code = (
        "import json, torch; print(json.dumps({'version': torch.__version__, "
        "'cuda': torch.version.cuda, 'available': torch.cuda.is_available(), "
        "'count': torch.cuda.device_count()}))"
    )
    done = subprocess.run(
        ["uv", "run", "python", "-c", code], capture_output=True, text=True, timeout=120,
        cwd=ROOT, check=False,
    )  # fmt: skip
    lines = done.stdout.strip().splitlines()
    return (
        json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": done.stderr[-500:]}
    )


def install_command(torch_version: str, index: str) -> list[str]:
    """The one command that puts the matching torch build into this environment."""
    base = torch_version.split("+")[0]
    url = f"https://download.pytorch.org/whl/{index}"
    return ["uv", "pip", "install", "--reinstall", f"torch=={base}", "--index-url", url]


def plan(extended: bool, only: list[str], gpus: int, capability: int) -> list[tuple[Step, str]]:
    """Each step with '' (run it) or why it is skipped."""
    out = []
    for s in STEPS:
        why = ""
        if only and not any(o.lower() in s.name.lower() for o in only):
            why = "not selected (--only)"
        elif s.extended and not extended:
            why = "extended step (--extended)"
        elif gpus < s.min_gpus:
            why = f"needs {s.min_gpus} GPUs, {gpus} here"
        elif not s.min_capability <= capability <= s.max_capability:
            why = f"needs compute capability {s.min_capability}-{s.max_capability}, sm{capability} here"
        elif s.env and not os.environ.get(s.env):
            why = f"set {s.env}"
        out.append((s, why))
    return out


def run_step(step: Step, limit: float, fill: dict[str, str]) -> Outcome:
    argv = [a.format(**fill) for a in step.argv]
    start = time.perf_counter()
    try:
        done = subprocess.run(
            argv, cwd=ROOT, capture_output=True, text=True, timeout=limit, check=False
        )
        output, status = done.stdout + done.stderr, "passed" if done.returncode == 0 else "failed"
        reason = "" if done.returncode == 0 else f"exit {done.returncode}"
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        status, reason = "timeout", f"limit {limit:.0f} s"
    tail = output.strip().splitlines()[-25:]
    return Outcome(step.name, status, round(time.perf_counter() - start, 1), reason, tail)


def write_summary(path: Path, header: dict, outcomes: list[Outcome]) -> None:
    record = {**header, "steps": [asdict(o) for o in outcomes]}
    path.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [f"gpu_check: {header.get('verdict', '')}"]
    lines += [f"{k}: {v}" for k, v in header.items() if k != "verdict"]
    for o in outcomes:
        lines.append(
            f"[{o.status:>7}] {o.name} ({o.seconds:.0f} s){': ' + o.reason if o.reason else ''}"
        )
        lines += [f"          {t}" for t in o.tail[-5:]]
    path.with_suffix(".txt").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=int, default=BUDGET_S, help="total seconds (default 480)")
    p.add_argument("--extended", action="store_true", help="add the steps past 8 minutes")
    p.add_argument("--report", default="gpu_check_report", help="summary path without suffix")
    p.add_argument("--only", nargs="*", default=[], help="run the steps whose name has these")
    p.add_argument("--install-torch", action="store_true", help="install the matching torch")
    args = p.parse_args(argv)
    if args.budget < PROBE_S + 30:
        p.error(f"--budget={args.budget} must be at least {PROBE_S + 30} seconds")
    report = Path(args.report)
    started = time.perf_counter()
    driver = probe_driver()
    if driver is None:
        print("gpu_check: no NVIDIA GPU here (nvidia-smi finds none): nothing to check")
        write_summary(report, {"verdict": "no GPU"}, [])
        return 3
    header = {
        "gpus": driver["gpus"],
        "driver_cuda": driver["cuda"],
        "capability": driver["capability"],
    }
    seen = probe_torch()
    header["torch"] = seen
    if not seen.get("available"):
        index = torch_index_for(driver["cuda"]) if driver["cuda"] else None
        if index is None:
            header["verdict"] = (
                f"the driver (CUDA {driver['cuda'] or '?'}) is older than every torch build"
            )
            print(f"gpu_check: {header['verdict']}; update the driver")
            write_summary(report, header, [])
            return 4
        command = install_command(str(seen.get("version", "2.15.0")), index)
        if not args.install_torch:
            header["verdict"] = "torch cannot see the GPU; install the build for this driver"
            print(
                f"gpu_check: torch {seen.get('version')} (CUDA {seen.get('cuda')}) cannot use this "
                f"driver (CUDA {driver['cuda']}); run: {' '.join(command)}  (or pass --install-torch)"
            )
            write_summary(report, header, [])
            return 4
        subprocess.run(command, cwd=ROOT, check=True, timeout=600)
        seen = header["torch"] = probe_torch()
        if not seen.get("available"):
            print("gpu_check: torch still cannot see the GPU after installing the matching build")
            return 4
    gpus = int(seen.get("count", 1))
    fill = {
        "gpus": str(gpus),
        "report": str(report),
        "run": str(Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu_check_{os.getpid()}"),
        "TITAN_RL_VLLM_GPU_PYTHON": os.environ.get("TITAN_RL_VLLM_GPU_PYTHON", ""),
    }
    outcomes = []
    for step, why in plan(args.extended, args.only, gpus, driver["capability"]):
        left = args.budget - PROBE_S - (time.perf_counter() - started)
        if not why and left < 20:
            why = "the budget is spent"
        if why:
            outcomes.append(Outcome(step.name, "skipped", reason=why))
            print(f"[skipped] {step.name}: {why}", flush=True)
            continue
        print(f"== {step.name} (limit {min(step.limit_s, left):.0f} s)", flush=True)
        outcome = run_step(step, min(step.limit_s, left), fill)
        outcomes.append(outcome)
        print("\n".join(outcome.tail[-10:]))
        print(f"-- {outcome.status} in {outcome.seconds:.0f} s {outcome.reason}", flush=True)
    bad = [o for o in outcomes if o.status in ("failed", "timeout")]
    header["verdict"] = f"{len(bad)} of {sum(o.status != 'skipped' for o in outcomes)} steps failed"
    header["seconds"] = round(time.perf_counter() - started, 1)
    write_summary(report, header, outcomes)
    print(f"gpu_check: {header['verdict']} in {header['seconds']:.0f} s; summary {report}.txt")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
