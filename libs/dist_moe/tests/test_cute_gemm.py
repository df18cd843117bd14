"""The CuTe DSL grouped GEMM: code generation for SM90a/SM100a on CPU, numerics on a GPU.

``nvidia-cutlass-dsl`` is the optional ``cutlass`` extra, not in the default environment:
the direct test runs where it is installed; the slow one installs it into an isolated
throw-away environment with ``uv`` (no torch there: the kernel module imports only cutlass)
and runs the same check, so CI sees the code generation either way.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from dist_moe import cute_available, cute_codegen, cute_grouped_mm
from titan_testing import requires_gpus

KERNEL_FILE = Path(__file__).parents[1] / "src" / "dist_moe" / "_cute_grouped_gemm.py"
PATTERNS = {  # instruction -> how many a correct 128x128x64 tile on 2x2 warps unrolls
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32": 128,  # 32 per warp x 4 k-blocks
    "ldmatrix.sync.aligned": 32,  # A: 4 + B: 4 per k-block, x4 each
    "cp.async.cg.shared.global": 32,  # 16 x 16 B per thread per stage, prologue + loop
}

_CHECK_SCRIPT = """
import importlib.util, json, re, sys
spec = importlib.util.spec_from_file_location("cute_kernel", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
patterns = json.loads(sys.argv[2])
out = {}
for arch in mod.SUPPORTED_ARCHS:
    _, ptx = mod.compile_grouped_gemm(arch)
    counts = {p: len(re.findall(re.escape(p), ptx)) for p in patterns}
    counts["target"] = re.findall(r"^\\.target (\\S+)", ptx, re.M)
    out[arch] = counts
print("RESULT " + json.dumps(out))
"""


def _check_ptx_counts(per_arch: dict) -> None:
    assert set(per_arch) == {"sm_90a", "sm_100a"}
    for arch, counts in per_arch.items():
        assert counts.pop("target") == [arch], arch
        assert counts == PATTERNS, f"{arch}: {counts}"


@pytest.mark.skipif(not cute_available(), reason="nvidia-cutlass-dsl (the cutlass extra) absent")
def test_cute_grouped_gemm_generates_tensor_core_ptx_for_sm90_and_sm100():
    per_arch = {}
    for arch in ("sm_90a", "sm_100a"):
        ptx = cute_codegen(arch)
        counts = {p: len(re.findall(re.escape(p), ptx)) for p in PATTERNS}
        counts["target"] = re.findall(r"^\.target (\S+)", ptx, re.M)
        per_arch[arch] = counts
    _check_ptx_counts(per_arch)


@pytest.mark.slow  # installs nvidia-cutlass-dsl (~320 MB, cached by uv) into a throw-away env
def test_cute_grouped_gemm_codegen_with_the_cutlass_extra_in_an_isolated_env():
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    pyproject = tomllib.loads((KERNEL_FILE.parents[2] / "pyproject.toml").read_text())
    [spec] = pyproject["project"]["optional-dependencies"]["cutlass"]
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    cmd = [uv, "run", "--isolated", "--no-project", "--python", py, "--with", spec]
    cmd += ["python", "-c", _CHECK_SCRIPT, str(KERNEL_FILE), json.dumps(list(PATTERNS))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and re.search(r"(?i)failed to fetch|network|dns|connect", out):
        pytest.skip(f"could not install {spec}: {out[-500:]}")
    assert proc.returncode == 0, out[-4000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    _check_ptx_counts(json.loads(line[len("RESULT ") :]))


def test_cute_entry_points_reject_bad_input(monkeypatch):
    with pytest.raises(ValueError, match="sm_90a"):
        cute_codegen("sm_80")
    from dist_moe import cute_gemm

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    with pytest.raises(ValueError, match=r"SM90 \(Hopper\) or SM100 \(Blackwell\) GPU, got sm_86"):
        cute_gemm._arch_of(torch.device("cuda", 0))
    x = torch.zeros(1, 128, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA tensor"):
        cute_grouped_mm(x, x)
    with pytest.raises(ValueError, match="bfloat16"):
        cute_grouped_mm(x.float(), x)


@pytest.mark.gpu
@requires_gpus(1)
@pytest.mark.skipif(not cute_available(), reason="nvidia-cutlass-dsl (the cutlass extra) absent")
def test_cute_grouped_mm_matches_torch_grouped_mm_in_bf16():
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("the CuTe kernel targets SM90 / SM100")
    torch.manual_seed(0)
    g, m, n, k = 4, 256, 384, 512
    x = torch.randn(g, m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    counts = torch.tensor([256, 130, 0, 128], dtype=torch.int32, device="cuda")
    out = torch.full((g, m, n), 7.0, device="cuda", dtype=torch.bfloat16)
    cute_grouped_mm(x, w, counts, out=out)
    offs = torch.arange(1, g + 1, device="cuda", dtype=torch.int32) * m
    ref = torch._grouped_mm(x.reshape(g * m, k), w.transpose(-2, -1), offs=offs).reshape(g, m, n)
    for e, c in enumerate(counts.tolist()):
        live = -(-c // 128) * 128  # whole row tiles are computed
        err = (out[e, :live].float() - ref[e, :live].float()).norm() / ref[e, :live].float().norm()
        assert live == 0 or err <= 1e-2, (e, err.item())
        assert (out[e, live:] == 7.0).all(), f"expert {e}: a skipped tile was written"


def test_grouped_experts_choose_the_grouped_gemm_and_cute_refuses_the_cpu_clearly():
    from dist_moe import GroupedExperts, MoEConfig, RouterConfig

    experts = GroupedExperts(128, 128, 2)
    assert experts.gemm == "torch"  # the default: torch._grouped_mm, today's path
    assert GroupedExperts(128, 128, 2, gemm="triton").gemm == "triton"  # built anywhere
    with pytest.raises(
        ValueError, match=r"gemm must be one of \('torch', 'triton', 'cute'\), got 'cublas'"
    ):
        GroupedExperts(128, 128, 2, gemm="cublas")  # pyrefly: ignore[bad-argument-type]
    with pytest.raises(ValueError, match=r"MoEConfig.grouped_gemm must be one of"):
        MoEConfig(
            dim=8, hidden_dim=8, router=RouterConfig(num_experts=2, top_k=1), grouped_gemm="x"
        )  # pyrefly: ignore[bad-argument-type]
    cute = GroupedExperts(128, 128, 2, gemm="cute")
    ends = torch.tensor([128, 256], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"SM90 \(Hopper\) or SM100 \(Blackwell\).*got a cpu"):
        cute(torch.randn(256, 128), ends)


@pytest.mark.gpu
@requires_gpus(1)
@pytest.mark.skipif(not cute_available(), reason="nvidia-cutlass-dsl (the cutlass extra) absent")
def test_cute_experts_forward_and_backward_match_torch_grouped_mm_in_bf16():
    from dist_moe import GroupedExperts

    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("the CuTe kernel targets SM90 / SM100")
    torch.manual_seed(0)
    ref = GroupedExperts(256, 128, 4).cuda().to(torch.bfloat16)
    cute = GroupedExperts(256, 128, 4, gemm="cute").cuda().to(torch.bfloat16)
    cute.load_state_dict(ref.state_dict())
    x = torch.randn(4 * 128, 256, device="cuda", dtype=torch.bfloat16)
    ends = torch.arange(1, 5, device="cuda", dtype=torch.int32) * 128  # a capacity layout
    outs = []
    for m in (ref, cute):
        xi = x.clone().requires_grad_()
        y = m(xi, ends)
        y.float().square().sum().backward()
        outs.append([y, xi.grad, m.w_gate.grad, m.w_up.grad, m.w_down.grad])
    for a, b in zip(*outs, strict=True):  # bf16 GEMMs in other tile orders: relative 1e-2
        assert ((a.float() - b.float()).norm() / a.float().norm()).item() <= 1e-2
