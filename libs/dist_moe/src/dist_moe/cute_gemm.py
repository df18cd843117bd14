"""Grouped GEMM over packed experts with a CuTe DSL kernel (optional ``cutlass`` extra).

``cute_grouped_mm(x, w, counts)`` computes ``out[g, :counts[g]] = x[g, :counts[g]] @ w[g].T``
for bf16 ``x`` (G, M, K) (each expert's rows at a static capacity M, as the symmetric-memory
dispatcher lays them out), ``w`` (G, N, K) and int32 ``counts`` (G,) that stay on the device.
The kernel (``_cute_grouped_gemm.py``) is compiled once per architecture with
``cute.compile`` and cached. It needs ``pip install 'titan-dist-moe[cutlass]'`` and an SM90
(Hopper) or SM100 (Blackwell) GPU; code generation alone works without a GPU
(``cute_codegen``), which is what the CPU tests check.

``cute_swiglu_experts`` is ``GroupedExperts(gemm="cute")``'s forward: the three projections
of the SwiGLU experts as CuTe grouped GEMMs over equal static groups, differentiable (the
backward is two more CuTe grouped GEMMs per projection, on transposed copies).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["cute_available", "cute_codegen", "cute_grouped_mm", "cute_swiglu_experts"]

_ARCH_OF_MAJOR = {9: "sm_90a", 10: "sm_100a"}


@functools.cache
def cute_available() -> bool:
    """True when ``import cutlass`` (``nvidia-cutlass-dsl``) works."""
    try:
        import cutlass  # noqa: F401
    except Exception:
        return False
    return True


def _kernel_module():
    if not cute_available():
        raise ImportError(
            "the CuTe grouped GEMM needs nvidia-cutlass-dsl: pip install 'titan-dist-moe[cutlass]'"
        )
    from dist_moe import _cute_grouped_gemm

    return _cute_grouped_gemm


def cute_codegen(arch: str) -> str:
    """Compile the kernel for ``arch`` (``"sm_90a"`` or ``"sm_100a"``) and return its PTX.

    Needs no GPU. Raises ``ValueError`` for another architecture.
    """
    if arch not in _ARCH_OF_MAJOR.values():
        raise ValueError(
            f"cute_codegen: arch must be one of {tuple(_ARCH_OF_MAJOR.values())} (SM90 Hopper, "
            f"SM100 Blackwell), got {arch!r}"
        )
    return _kernel_module().compile_grouped_gemm(arch)[1]


def _arch_of(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    if major not in _ARCH_OF_MAJOR:
        raise ValueError(
            f"cute_grouped_mm needs an SM90 (Hopper) or SM100 (Blackwell) GPU, got "
            f"sm_{major}{minor} on {device}; use torch._grouped_mm (GroupedExperts) there"
        )
    return _ARCH_OF_MAJOR[major]


def cute_grouped_mm(
    x_GMK: torch.Tensor,
    w_GNK: torch.Tensor,
    counts_G: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[g, m] = x[g, m] @ w[g].T`` for ``m < counts[g]`` (all rows when None).

    bf16 CUDA tensors, contiguous; M and N multiples of 128, K a multiple of 64. Row tiles
    past ``counts[g]`` are skipped on the device (their output rows are left as they were);
    no value is read back to the host.
    """
    for name, t in (("x_GMK", x_GMK), ("w_GNK", w_GNK)):
        if t.dim() != 3 or t.dtype != torch.bfloat16 or t.device.type != "cuda":
            raise ValueError(
                f"cute_grouped_mm: {name} must be a 3-D bfloat16 CUDA tensor, got "
                f"{t.dtype} {tuple(t.shape)} on {t.device}"
            )
    mod = _kernel_module()
    g, m, k = x_GMK.shape
    n = w_GNK.shape[1]
    if w_GNK.shape[0] != g or w_GNK.shape[2] != k:
        raise ValueError(
            f"cute_grouped_mm: w_GNK must be (G={g}, N, K={k}), got {tuple(w_GNK.shape)}"
        )
    if m % mod.TILE_M or n % mod.TILE_N or k % mod.TILE_K:
        raise ValueError(
            f"cute_grouped_mm: M={m} and N={n} must be multiples of {mod.TILE_M} and "
            f"{mod.TILE_N}, K={k} a multiple of {mod.TILE_K}"
        )
    arch = _arch_of(x_GMK.device)
    if counts_G is None:
        counts_G = torch.full((g,), m, dtype=torch.int32, device=x_GMK.device)
    if counts_G.shape != (g,) or counts_G.dtype != torch.int32:
        raise ValueError(
            f"cute_grouped_mm: counts_G must be int32 of shape ({g},), got "
            f"{counts_G.dtype} {tuple(counts_G.shape)}"
        )
    if out is None:
        out = torch.empty(g, m, n, dtype=torch.bfloat16, device=x_GMK.device)
    if out.shape != (g, m, n) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(
            f"cute_grouped_mm: out must be a contiguous bfloat16 ({g}, {m}, {n}) tensor, got "
            f"{out.dtype} {tuple(out.shape)}"
        )
    import cutlass.torch

    with torch.cuda.device(x_GMK.device):
        stream = cutlass.torch.current_stream()  # the CUstream torch is enqueuing on
    args = (
        _cute_tensor(x_GMK.contiguous(), (1, mod.TILE_M, mod.TILE_K)),
        _cute_tensor(w_GNK.contiguous(), (1, mod.TILE_N, mod.TILE_K)),
        _cute_tensor(out, (1, mod.TILE_M, mod.TILE_N)),
        _cute_tensor(counts_G.contiguous(), (1,)),
        stream,
    )
    if arch not in _RUNTIME_KERNELS:  # compiled once per architecture, for any shapes
        import cutlass.cute as cute

        _RUNTIME_KERNELS[arch] = cute.compile(mod.grouped_gemm, *args, options=f"--gpu-arch={arch}")
    _RUNTIME_KERNELS[arch](*args)
    return out


_RUNTIME_KERNELS: dict[str, Any] = {}  # compiled CuTe kernels


def _cute_tensor(t: torch.Tensor, divisibility: tuple[int, ...]):
    """Device tensor with dynamic compact shape (each mode a multiple of its divisibility)."""
    from cutlass.cute.runtime import from_dlpack

    c = from_dlpack(t, assumed_align=16 if t.element_size() == 2 else 4)
    for mode, div in enumerate(divisibility):
        c = c.mark_compact_shape_dynamic(mode=mode, stride_order=t.dim_order(), divisibility=div)
    return c


class _CuteGroupedLinear(torch.autograd.Function):
    """``y[g] = x[g] @ w[g].T`` on (G, M, K) x (G, N, K); backward ``dx[g] = dy[g] @ w[g]``
    and ``dw[g] = dy[g].T @ x[g]``, each a CuTe grouped GEMM on transposed copies."""

    @staticmethod
    def forward(ctx, x_GMK: torch.Tensor, w_GNK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_GMK, w_GNK)
        return cute_grouped_mm(x_GMK.contiguous(), w_GNK.contiguous())

    @staticmethod
    def backward(ctx, grad_GMN):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        x_GMK, w_GNK = ctx.saved_tensors
        g = grad_GMN.contiguous()
        grad_x = cute_grouped_mm(g, w_GNK.transpose(1, 2).contiguous())
        grad_w = cute_grouped_mm(g.transpose(1, 2).contiguous(), x_GMK.transpose(1, 2).contiguous())
        return grad_x, grad_w


def check_cute_experts(x_RD: torch.Tensor, weights: tuple[torch.Tensor, ...], groups: int) -> int:
    """Rows per group of ``GroupedExperts(gemm="cute")``'s input, or a ``ValueError`` naming
    what the CuTe path needs (checked before any kernel runs)."""
    need = (
        "GroupedExperts(gemm='cute') needs a CUDA GPU of compute capability SM90 (Hopper) or "
        "SM100 (Blackwell), bfloat16 inputs and weights, and nvidia-cutlass-dsl "
        "(pip install 'titan-dist-moe[cutlass]')"
    )
    if x_RD.device.type != "cuda":
        raise ValueError(f"{need}; got a {x_RD.device.type} tensor (use gemm='torch' there)")
    if x_RD.dtype != torch.bfloat16 or any(w.dtype != torch.bfloat16 for w in weights):
        raise ValueError(f"{need}; got {x_RD.dtype} inputs, {weights[0].dtype} weights")
    if len(weights) != 3:
        raise ValueError("GroupedExperts(gemm='cute') does not support per-expert biases")
    if not cute_available():
        raise ValueError(f"{need}; nvidia-cutlass-dsl is not installed")
    _arch_of(x_RD.device)
    rows, dim = x_RD.shape
    hidden = weights[0].shape[1]
    if groups < 1 or rows % groups:
        raise ValueError(
            f"GroupedExperts(gemm='cute') takes equal static groups (a capacity layout: "
            f"PermuteConfig.capacity_factor); {rows} rows do not split into {groups} experts"
        )
    per_group = rows // groups
    if per_group % 128 or dim % 128 or hidden % 128:
        raise ValueError(
            "GroupedExperts(gemm='cute'): rows per expert, dim and hidden_dim must be "
            f"multiples of 128, got {per_group}, {dim}, {hidden}"
        )
    return per_group


def cute_swiglu_experts(
    x_RD: torch.Tensor, weights: tuple[torch.Tensor, ...], activation: Any, groups: int
) -> torch.Tensor:
    """SwiGLU experts on (R, D) rows in ``groups`` equal groups, all three projections CuTe
    grouped GEMMs (forward and backward); ``weights`` = (w_gate, w_up, w_down)."""
    m = check_cute_experts(x_RD, weights, groups)
    w_gate, w_up, w_down = weights
    x_GMD = x_RD.reshape(groups, m, x_RD.shape[1])
    gate = _CuteGroupedLinear.apply(x_GMD, w_gate)
    up = _CuteGroupedLinear.apply(x_GMD, w_up)
    out = _CuteGroupedLinear.apply(activation(gate, up), w_down)
    return out.reshape(x_RD.shape)
