"""Grouped GEMM over packed experts with a CuTe DSL kernel (optional ``cutlass`` extra).

``cute_grouped_mm(x, w, counts)`` computes ``out[g, :counts[g]] = x[g, :counts[g]] @ w[g].T``
for bf16 ``x`` (G, M, K) (each expert's rows at a static capacity M, as the symmetric-memory
dispatcher lays them out), ``w`` (G, N, K) and int32 ``counts`` (G,) that stay on the device.
The kernel (``_cute_grouped_gemm.py``) is compiled once per architecture with
``cute.compile`` and cached. It needs ``pip install 'titan-dist-moe[cutlass]'`` and an SM90
(Hopper) or SM100 (Blackwell) GPU; code generation alone works without a GPU
(``cute_codegen``), which is what the CPU tests check.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["cute_available", "cute_codegen", "cute_grouped_mm"]

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
