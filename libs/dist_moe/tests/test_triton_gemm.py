"""The Triton grouped GEMM equals the torch grouped GEMM, forward and backward, on ragged
groups with empty ones: on CPU under TRITON_INTERPRET=1, on CUDA natively (fp32, bf16).

TRITON_INTERPRET must be set before triton is first imported, so the CPU checks run in a
fresh child process (``run_distributed(..., init_process_group=False, env=...)``). The
reference is one ``torch.mm`` per group (any device, any dtype); ``GroupedExperts`` is also
compared whole, ``gemm="triton"`` against ``gemm="torch"``, with and without biases.
The interpreter checks fp32 only: its ``tl.dot`` on bf16 operands returns garbage (numpy has
no bf16), so bf16 is checked on CUDA.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from dist_moe import GroupedExperts, triton_grouped_mm
from titan_testing import requires_gpus, run_distributed

# Group sizes: an empty first and middle group, one over two 64-row tiles, a tail of 7
# rows past the last group. K = 40 and N = 80 span two K (32) and two N (64) tiles.
SIZES, TAIL, K, N = (0, 70, 5, 0, 33), 7, 40, 80
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-5}
"""Largest |triton - torch| relative to the largest |torch| (at least 1). fp32: sums in
another order (~4e-7 measured under the interpreter); TF32 products would miss it by an
order of magnitude. bf16: each GEMM rounds its output once (2**-8), compounded through the
experts' three GEMMs, the activation and their backward."""


def _reference_mm(x_RK: torch.Tensor, w_EKN: torch.Tensor, ends: list[int]) -> torch.Tensor:
    out = x_RK.new_zeros(x_RK.shape[0], w_EKN.shape[2])
    for g, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        out[start:end] = x_RK[start:end] @ w_EKN[g]
    return out


def _checks(device: str, dtype: torch.dtype, sizes=SIZES, tail=TAIL, k=K, n=N) -> dict:
    """Max |triton - reference| / max(1, |reference|) per tensor; -1.0: shape or dtype differ."""
    torch.manual_seed(0)
    out: dict[str, float] = {}

    def diff(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.shape != b.shape or a.dtype != b.dtype:
            out[name] = -1.0
            return
        err = (a.double() - b.double()).abs().max().item()
        out[name] = err / max(1.0, b.double().abs().max().item())

    ends = torch.tensor(sizes, device=device).cumsum(0)
    rows = int(ends[-1]) + tail
    x = torch.randn(rows, k, device=device, dtype=dtype)
    w_ENK = torch.randn(len(sizes), n, k, device=device, dtype=dtype) / k**0.5
    grad = torch.randn(rows, n, device=device, dtype=dtype)
    results = []
    for fn in (triton_grouped_mm, _reference_mm):
        xi, wi = x.clone().requires_grad_(), w_ENK.clone().requires_grad_()
        y = fn(xi, wi.transpose(1, 2), ends if fn is triton_grouped_mm else ends.tolist())
        (y * grad).sum().backward()
        results.append((y, xi.grad, wi.grad))
    for name, a, b in zip(("out", "x.grad", "w.grad"), *results, strict=True):
        diff(f"mm {name}", a, b)
    (y, x_grad, w_grad), last = results[0], int(ends[-1])
    out["exact: tail rows and their grads are zero"] = float(
        y[last:].abs().sum().item() + x_grad[last:].abs().sum().item()
    )
    out["exact: empty groups get zero weight grads"] = float(w_grad[[0, 3]].abs().sum().item())
    out["exact: w.grad contiguous like w"] = 0.0 if w_grad.is_contiguous() else 1.0
    xs = x.clone().requires_grad_()  # a stride-0 gradient (from a sum) is read in place
    triton_grouped_mm(xs, w_ENK.transpose(1, 2), ends).sum().backward()
    diff("mm x.grad of a sum", xs.grad[:last], _sum_grad(w_ENK, ends))

    for bias in (False, True):  # the experts whole: three GEMMs, SwiGLU, biases
        torch.manual_seed(1)
        ref = GroupedExperts(k, 24, len(sizes), bias=bias).to(device=device, dtype=dtype)
        ref.reset_parameters(std=0.3)
        if bias:
            for b in (ref.b_gate, ref.b_up, ref.b_down):
                torch.nn.init.normal_(b, std=0.3)
        tri = copy.deepcopy(ref)
        tri.gemm = "triton"
        xs = [x.clone().requires_grad_() for _ in range(2)]
        g = torch.randn(rows, k, device=device, dtype=dtype)
        y_ref, y_tri = ref(xs[0], ends), tri(xs[1], ends)
        (y_ref[:last] * g[:last]).sum().backward()  # rows past the groups are undefined in torch
        (y_tri[:last] * g[:last]).sum().backward()
        tag = f"experts bias={bias}"
        diff(f"{tag} out", y_tri[:last], y_ref[:last])
        diff(f"{tag} x.grad", xs[1].grad[:last], xs[0].grad[:last])
        for (name, p_ref), (_, p_tri) in zip(
            ref.named_parameters(), tri.named_parameters(), strict=True
        ):
            diff(f"{tag} {name}.grad", p_tri.grad, p_ref.grad)
    return out


def _sum_grad(w_ENK: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """d(sum(out))/dx for the rows in groups: each row gets its group's w summed over N."""
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    per_group = w_ENK.sum(1)  # (E, K)
    return per_group.repeat_interleave(sizes, dim=0)


def _assert_close(res: dict[str, float], dtype: torch.dtype) -> None:
    assert len(res) >= 20
    for name, err in res.items():
        tol = 0.0 if name.startswith("exact") else TOL[dtype]
        assert 0.0 <= err <= tol, f"{name}: {err}"


def test_triton_grouped_mm_equals_torch_under_the_interpreter():
    [res] = run_distributed(
        _checks,
        1,
        "cpu",
        torch.float32,
        init_process_group=False,
        env={"TRITON_INTERPRET": "1"},
        timeout=300,
    )
    _assert_close(res, torch.float32)


@pytest.mark.gpu
@requires_gpus(1)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_grouped_mm_equals_torch_on_cuda(dtype):
    _assert_close(_checks("cuda", dtype), dtype)
    big = (0, 700, 1, 0, 129, 64, 3000, 17)  # many tiles, 8 experts, realistic widths
    _assert_close(_checks("cuda", dtype, sizes=big, tail=100, k=256, n=384), dtype)


def test_triton_is_refused_with_the_requirement_off_cuda():
    experts = GroupedExperts(8, 8, 2, gemm="triton")
    ends = torch.tensor([3, 5])
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError, match=r"GroupedExperts: gemm 'triton' needs CUDA"):
            experts(torch.randn(6, 8), ends)
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            triton_grouped_mm(torch.randn(6, 8), torch.randn(2, 8, 4), ends)
    with pytest.raises(ValueError, match=r"x must be \(R, K\) and w \(E, K, N\)"):
        triton_grouped_mm(torch.randn(6, 8), torch.randn(2, 4, 8), ends)
    with pytest.raises(ValueError, match="group_ends must be an integer"):
        triton_grouped_mm(torch.randn(6, 8), torch.randn(3, 8, 4), ends)
    with pytest.raises(ValueError, match="must be one of"):
        GroupedExperts(8, 8, 2, gemm="cublas")  # pyrefly: ignore[bad-argument-type]
    with torch.device("meta"):  # shapes only (fake-backend runs), backward included
        experts = GroupedExperts(8, 8, 2, gemm="triton")
        x = torch.randn(6, 8, requires_grad=True)
        experts(x, torch.tensor([3, 5])).sum().backward()
    assert x.grad is not None and x.grad.shape == (6, 8)
    assert experts.w_gate.grad is not None and experts.w_gate.grad.shape == (2, 8, 8)
