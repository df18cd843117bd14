"""Grouped GEMM over rows grouped by expert, in Triton: ``GroupedExperts(gemm="triton")``.

``triton_grouped_mm(x, w, group_ends)`` is ``torch._grouped_mm(x, w, offs=group_ends)``:
rows ``[group_ends[g-1], group_ends[g])`` of ``x`` (R, K) times ``w[g]`` (K, N), so ragged
groups, empty ones included, with the group ends kept on the device (no host sync). Rows
past the last group are written as zeros (``torch._grouped_mm`` leaves them undefined).
Differentiable: ``dX`` is the same kernel against ``w`` transposed (a strided view, no copy),
``dW[g] = X[g]^T dY[g]`` a second kernel with one program per (expert, K tile, N tile).

Forward grid: the row tiles of every group (each group tiled from its own first row) and
of the tail cannot outnumber ``cdiv(R, BLOCK_M) + E``, so the grid has that many row
programs; each finds its group from ``group_ends`` with a prefix sum over the groups' tile
counts (one vector of ``E`` in registers) and exits when it has none. Accumulation is fp32;
fp32 inputs use IEEE products (``input_precision="ieee"``: no TF32, like
``torch.matmul``'s default). On CPU tensors the kernels run under ``TRITON_INTERPRET=1``
(tests); on ``meta`` tensors only shapes are produced (fake-backend runs).
"""

from __future__ import annotations

import functools

import torch

from dist_moe.kernels import resolve_backend

__all__ = ["triton_grouped_mm"]

_BLOCK_M, _BLOCK_N, _BLOCK_K = 64, 64, 32


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_mm_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        ends_ptr,
        R,
        N,
        K,
        E,
        stride_xr,
        stride_xk,
        stride_we,
        stride_wk,
        stride_wn,
        stride_or,
        stride_on,
        SEGMENTS: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # Segments 0..E-1 are the groups, segment E the tail past the last group (zeros),
        # the rest (padding up to a power of two) empty.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        seg = tl.arange(0, SEGMENTS)
        seg_end = tl.load(ends_ptr + seg, mask=seg < E, other=0).to(tl.int32)
        seg_end = tl.where(seg < E, seg_end, R)
        prev = tl.load(ends_ptr + seg - 1, mask=(seg > 0) & (seg <= E), other=0).to(tl.int32)
        seg_start = tl.where(seg > E, R, prev)
        tiles = (seg_end - seg_start + BLOCK_M - 1) // BLOCK_M
        tile_end = tl.cumsum(tiles, 0)
        g = tl.sum((tile_end <= pid_m).to(tl.int32), 0)  # my segment (SEGMENTS: none)
        mine = seg == g
        start = tl.sum(tl.where(mine, seg_start, 0), 0)
        end = tl.sum(tl.where(mine, seg_end, 0), 0)
        first_tile = tl.sum(tl.where(mine, tile_end - tiles, 0), 0)
        rows = start + (pid_m - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < end
        col_ok = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if g < E:
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < K
                a = tl.load(
                    x_ptr + rows[:, None] * stride_xr + ks[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                b = tl.load(
                    w_ptr + g * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                    mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0,
                )
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
        tl.store(
            out_ptr + rows[:, None] * stride_or + cols[None, :] * stride_on,
            acc.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )

    @triton.jit
    def grouped_wgrad_kernel(
        x_ptr,
        dy_ptr,
        dw_ptr,
        ends_ptr,
        K,
        N,
        stride_xr,
        stride_xk,
        stride_dr,
        stride_dn,
        stride_we,
        stride_wk,
        stride_wn,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # dW[g] (K, N) tile = sum over my group's rows of x^T dy; an empty group stores zeros.
        g = tl.program_id(0)
        ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = ks < K
        col_ok = cols < N
        end = tl.load(ends_ptr + g).to(tl.int32)
        start = tl.where(g > 0, tl.load(ends_ptr + tl.maximum(g - 1, 0)).to(tl.int32), 0)
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < end
            a = tl.load(
                x_ptr + rows[None, :] * stride_xr + ks[:, None] * stride_xk,
                mask=k_ok[:, None] & row_ok[None, :],
                other=0.0,
            )
            b = tl.load(
                dy_ptr + rows[:, None] * stride_dr + cols[None, :] * stride_dn,
                mask=row_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        tl.store(
            dw_ptr + g * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
            acc.to(dw_ptr.dtype.element_ty),
            mask=k_ok[:, None] & col_ok[None, :],
        )

    return triton, grouped_mm_kernel, grouped_wgrad_kernel


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # (ignored below fp32)


def _mm(x_RK: torch.Tensor, w_EKN: torch.Tensor, ends_E: torch.Tensor) -> torch.Tensor:
    rows, num_experts, n = x_RK.shape[0], w_EKN.shape[0], w_EKN.shape[2]
    out = torch.empty(rows, n, dtype=x_RK.dtype, device=x_RK.device)
    if x_RK.device.type == "meta" or out.numel() == 0:
        return out
    triton, kernel, _ = _kernels()
    grid = (triton.cdiv(rows, _BLOCK_M) + num_experts, triton.cdiv(n, _BLOCK_N))
    kernel[grid](
        x_RK,
        w_EKN,
        out,
        ends_E,
        rows,
        n,
        x_RK.shape[1],
        num_experts,
        *x_RK.stride(),
        *w_EKN.stride(),
        *out.stride(),
        SEGMENTS=triton.next_power_of_2(num_experts + 1),
        PRECISION=_precision(x_RK.dtype),
        BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K,
    )
    return out


def _wgrad(
    x_RK: torch.Tensor, dy_RN: torch.Tensor, ends_E: torch.Tensor, like: torch.Tensor
) -> torch.Tensor:
    dw_EKN = torch.empty_like(like)  # w's strides: the parameter's gradient stays contiguous
    if x_RK.device.type == "meta" or dw_EKN.numel() == 0:
        return dw_EKN
    triton, _, kernel = _kernels()
    num_experts, k, n = dw_EKN.shape
    grid = (num_experts, triton.cdiv(k, _BLOCK_K), triton.cdiv(n, _BLOCK_N))
    kernel[grid](
        x_RK,
        dy_RN,
        dw_EKN,
        ends_E,
        k,
        n,
        *x_RK.stride(),
        *dy_RN.stride(),
        *dw_EKN.stride(),
        PRECISION=_precision(x_RK.dtype),
        BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K,
    )
    return dw_EKN


class _TritonGroupedMm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RK: torch.Tensor, w_EKN: torch.Tensor, ends_E: torch.Tensor):
        ctx.save_for_backward(x_RK, w_EKN, ends_E)
        return _mm(x_RK, w_EKN, ends_E)

    @staticmethod
    def backward(ctx, grad_RN: torch.Tensor):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        x_RK, w_EKN, ends_E = ctx.saved_tensors
        # Strided operands are read in place: a stride-0 gradient (from a sum) needs no copy.
        grad_x = _mm(grad_RN, w_EKN.transpose(1, 2), ends_E) if ctx.needs_input_grad[0] else None
        grad_w = _wgrad(x_RK, grad_RN, ends_E, w_EKN) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def triton_grouped_mm(
    x_RK: torch.Tensor, w_EKN: torch.Tensor, group_ends: torch.Tensor
) -> torch.Tensor:
    """``out[r] = x[r] @ w[g]`` for the rows ``r`` of group ``g`` (``group_ends`` (E,) int:
    the groups' ends, on the device); rows past ``group_ends[-1]`` are zeros. Returns (R, N).

    Differentiable in ``x`` and ``w``. Any strides; ``x`` and ``w`` of one floating dtype.
    Needs CUDA tensors (or ``TRITON_INTERPRET=1`` set before triton is imported: CPU tests);
    ``meta`` tensors give shapes only.
    """
    if x_RK.dim() != 2 or w_EKN.dim() != 3 or w_EKN.shape[1] != x_RK.shape[1]:
        raise ValueError(
            f"triton_grouped_mm: x must be (R, K) and w (E, K, N), got {tuple(x_RK.shape)} "
            f"and {tuple(w_EKN.shape)}"
        )
    if x_RK.dtype != w_EKN.dtype or not x_RK.is_floating_point():
        raise ValueError(
            f"triton_grouped_mm: x and w must share one floating dtype, got {x_RK.dtype} and "
            f"{w_EKN.dtype}"
        )
    num_experts = w_EKN.shape[0]
    if num_experts < 1 or group_ends.shape != (num_experts,) or group_ends.is_floating_point():
        raise ValueError(
            f"triton_grouped_mm: group_ends must be an integer ({num_experts},) tensor, got "
            f"{group_ends.dtype} {tuple(group_ends.shape)}"
        )
    if x_RK.device.type != "meta":
        resolve_backend("triton", x_RK.device, what="triton_grouped_mm: backend")
    return _TritonGroupedMm.apply(x_RK, w_EKN, group_ends.contiguous())
