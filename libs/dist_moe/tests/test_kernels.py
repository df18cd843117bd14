"""Triton kernels equal the torch reference: on CPU under TRITON_INTERPRET=1, on CUDA natively.

TRITON_INTERPRET must be set before triton is first imported, so the CPU checks run in a
fresh child process (``run_distributed(..., init_process_group=False, env=...)``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from dist_moe import (
    MoE,
    MoEConfig,
    PermuteConfig,
    RouterConfig,
    combine_rows,
    expert_histogram,
    permute_rows,
    plan_permutation,
)
from titan_testing import requires_gpus, run_distributed


def _kernel_checks(device: str) -> dict[str, float]:
    """Max |triton - torch| per check (0.0 = bitwise equal); -1.0 marks a shape mismatch."""
    torch.manual_seed(0)
    out: dict[str, float] = {}

    def diff(name, a, b):
        if a.shape != b.shape or a.dtype != b.dtype:
            out[name] = -1.0
        elif a.numel() == 0:
            out[name] = 0.0
        else:  # relative to the largest magnitude, so one bf16 ulp reads as <= 2**-7
            err = (a.double() - b.double()).abs().max().item()
            out[name] = err / max(1.0, b.double().abs().max().item())

    for n, e in ((0, 4), (1, 1), (37, 5), (3000, 64), (2000, 160)):
        idx = torch.randint(0, e, (n,), device=device)
        diff(
            f"histogram n={n} E={e}",
            expert_histogram(idx, e, backend="triton"),
            expert_histogram(idx, e, backend="torch"),
        )
        assert expert_histogram(idx, e, backend="triton").dtype == torch.int64

    cases = [
        ("dropless", 29, 3, 8, 20, PermuteConfig(alignment=4)),
        ("static", 50, 2, 16, 64, PermuteConfig(alignment=8, static_shapes=True)),
        ("capacity", 40, 2, 8, 33, PermuteConfig(alignment=2, capacity_factor=0.5)),
        ("top1_wide", 17, 1, 4, 1100, PermuteConfig(alignment=1)),
    ]
    for name, t, k, e, h, cfg in cases:
        idx = torch.stack([torch.randperm(e, device=device)[:k] for _ in range(t)])
        plan = plan_permutation(idx, e, cfg)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(t, h, device=device, dtype=dtype)
            w = torch.rand(t, k, device=device, dtype=dtype)
            y = torch.randn(plan.num_rows, h, device=device, dtype=dtype)
            ra, slot = plan.row_assignment, plan.slot
            tag = f"{name} {dtype}"
            diff(
                f"permute {tag}",
                permute_rows(x, ra, k, backend="triton"),
                permute_rows(x, ra, k, backend="torch"),
            )
            diff(
                f"permute*scale {tag}",
                permute_rows(x, ra, k, w, backend="triton"),
                permute_rows(x, ra, k, w, backend="torch"),
            )
            diff(
                f"combine {tag}",
                combine_rows(y, slot, k, w, backend="triton"),
                combine_rows(y, slot, k, w, backend="torch"),
            )
            diff(
                f"combine unweighted {tag}",
                combine_rows(y, slot, k, backend="triton"),
                combine_rows(y, slot, k, backend="torch"),
            )

    # the whole layer, forward and backward, with every data movement done by the kernels
    torch.manual_seed(1)
    cfg = MoEConfig(
        dim=32,
        hidden_dim=16,
        router=RouterConfig(num_experts=8, top_k=2),
        permute=PermuteConfig(alignment=4, kernels="torch"),
    )
    ref = MoE(cfg).to(device)
    ref.reset_parameters(std=0.3)
    tri = copy.deepcopy(ref)
    tri.dispatcher.config = PermuteConfig(alignment=4, kernels="triton")
    x1 = torch.randn(24, 32, device=device, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    g = torch.randn(24, 32, device=device)
    y1, y2 = ref(x1), tri(x2)
    (y1 * g).sum().backward()
    (y2 * g).sum().backward()
    diff("moe out", y2, y1)
    diff("moe x.grad", x2.grad, x1.grad)
    for (n, p1), (_, p2) in zip(ref.named_parameters(), tri.named_parameters(), strict=True):
        diff(f"moe {n}.grad", p2.grad, p1.grad)
    return out


def _assert_results(res: dict[str, float]) -> None:
    """Integer and copy kernels bit for bit; fp32 arithmetic within 1e-6; bf16 within one
    rounding (the interpreter's fp32 -> bf16 conversion does not round like torch's)."""
    assert len(res) > 40
    for name, err in res.items():
        if name.startswith(("histogram", "permute ")):  # integer counts, row copies
            tol = 0.0
        elif "bfloat16" in name:
            tol = 2.0**-7
        else:
            tol = 1e-6
        assert 0.0 <= err <= tol, f"{name}: {err}"


def test_triton_kernels_equal_torch_reference_under_the_interpreter():
    [res] = run_distributed(
        _kernel_checks,
        1,
        "cpu",
        init_process_group=False,
        env={"TRITON_INTERPRET": "1"},
        timeout=300,
    )
    _assert_results(res)


@pytest.mark.gpu
@requires_gpus(1)
def test_triton_kernels_equal_torch_reference_on_cuda():
    _assert_results(_kernel_checks("cuda"))
