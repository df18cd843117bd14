"""Data movement of MoE dispatch: expert histogram, permute and unpermute-and-combine.

Each operation has a torch implementation (any device, the CPU path) and a Triton kernel
(used on CUDA; also runs on CPU tensors under ``TRITON_INTERPRET=1``, which is how the tests
check it against the torch implementation). Triton is imported lazily, on first kernel use.

The index vocabulary shared by all three (``N = T * K`` assignments of ``T`` tokens to
``K`` experts each; ``R`` rows of the permuted buffer):

* ``row_assignment[r]`` (``R``,) int64: the assignment ``a`` held by row ``r``, or ``-1``
  for a padding row. The token of assignment ``a`` is ``a // K``.
* ``slot[a]`` (``N``,) int64: the row that holds assignment ``a``, or ``-1`` when the
  assignment was dropped (capacity mode).

``permute_rows`` and ``combine_rows`` are each other's adjoint: the backward of one is the
other, so the autograd functions in ``permute.py`` need nothing else.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

__all__ = [
    "KernelBackend",
    "combine_rows",
    "expert_histogram",
    "permute_rows",
    "resolve_backend",
    "triton_available",
]

KernelBackend = Literal["auto", "torch", "triton"]
_BACKENDS = ("auto", "torch", "triton")


@functools.cache
def triton_available() -> bool:
    """True when ``import triton`` works (it ships with Linux torch wheels)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(
    backend: str, device: torch.device, *, what: str = "kernel backend"
) -> Literal["torch", "triton"]:
    """``"auto"`` → Triton on CUDA when importable, torch elsewhere; explicit names are
    checked (``what`` names the setting in errors; titan_models' linear attention shares
    this choice)."""
    if backend not in _BACKENDS:
        raise ValueError(f"{what} must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError(f"{what} 'triton' requested but triton is not importable")
        if device.type != "cuda" and not _interpreting():
            raise RuntimeError(
                f"{what} 'triton' needs CUDA tensors (got {device.type}); on CPU set "
                "TRITON_INTERPRET=1 before triton is first imported to run the interpreter"
            )
    return backend  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------
# torch implementations (the reference; the CPU path)
# ---------------------------------------------------------------------------------------


def _histogram_torch(indices: torch.Tensor, num_bins: int) -> torch.Tensor:
    # scatter_add rather than bincount: bincount on CUDA reads max() back to the host.
    flat = indices.reshape(-1)
    counts = torch.zeros(num_bins, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


def _permute_torch(
    x: torch.Tensor, row_assignment: torch.Tensor, top_k: int, scale: torch.Tensor | None
) -> torch.Tensor:
    num_tokens = x.shape[0]
    padding = row_assignment < 0
    token = torch.where(padding, num_tokens, row_assignment // top_k)
    x_ext = torch.cat([x, x.new_zeros(1, x.shape[1])])
    out = x_ext.index_select(0, token)
    if scale is not None:
        s = torch.cat([scale.reshape(-1), scale.new_zeros(1)])
        s = s.index_select(0, torch.where(padding, s.shape[0] - 1, row_assignment))
        out = out * s.to(out.dtype)[:, None]
    return out


def _combine_torch(
    y: torch.Tensor, slot: torch.Tensor, top_k: int, weights: torch.Tensor | None
) -> torch.Tensor:
    # Accumulate in fp32 (fp64 stays fp64), k = 0..K-1 in order: the Triton kernel's arithmetic.
    acc_dtype = torch.promote_types(y.dtype, torch.float32)
    num_rows = y.shape[0]
    slot_TK = slot.reshape(-1, top_k)
    y_ext = torch.cat([y, y.new_zeros(1, y.shape[1])])
    dropped = slot_TK < 0
    acc = torch.zeros(slot_TK.shape[0], y.shape[1], dtype=acc_dtype, device=y.device)
    for k in range(top_k):
        rows = y_ext.index_select(0, torch.where(dropped[:, k], num_rows, slot_TK[:, k]))
        v = rows.to(acc_dtype)
        if weights is not None:
            v = v * weights.reshape(-1, top_k)[:, k].to(acc_dtype)[:, None]
        acc = acc + v
    return acc.to(y.dtype)


# ---------------------------------------------------------------------------------------
# Triton kernels (built on first use)
# ---------------------------------------------------------------------------------------


@functools.cache
def _triton_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def histogram_kernel(idx_ptr, counts_ptr, n, NUM_BINS: tl.constexpr, BLOCK: tl.constexpr):
        # One block histogram per program, then one vector atomic add: integer adds
        # commute, so the result is exact whatever the order.
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        e = tl.load(idx_ptr + offs, mask=mask, other=0).to(tl.int32)
        hist = tl.histogram(e, NUM_BINS, mask=mask)
        tl.atomic_add(counts_ptr + tl.arange(0, NUM_BINS), hist)

    @triton.jit
    def permute_kernel(
        x_ptr,
        assign_ptr,
        scale_ptr,
        out_ptr,
        H,
        stride_x,
        stride_out,
        TOP_K: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        r = tl.program_id(0)
        a = tl.load(assign_ptr + r)
        token = tl.where(a >= 0, a // TOP_K, 0)
        if HAS_SCALE:
            s = tl.load(scale_ptr + tl.where(a >= 0, a, 0))
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            m = cols < H
            # (the interpreter rejects a scalar & block mask: broadcast the scalar first)
            mask = m & (tl.full([BLOCK_H], 0, tl.int64) + a >= 0)
            v = tl.load(x_ptr + token * stride_x + cols, mask=mask, other=0.0)
            if HAS_SCALE:
                # fp32 product rounded once: what torch does for a bf16/fp16 multiply
                # s is bound: HAS_SCALE is one compile-time constant for both branches
                v = (v.to(tl.float32) * s.to(v.dtype).to(tl.float32)).to(v.dtype)  # pyrefly: ignore[unbound-name]
            tl.store(out_ptr + r * stride_out + cols, v, mask=m)

    @triton.jit
    def combine_kernel(
        y_ptr,
        slot_ptr,
        w_ptr,
        out_ptr,
        H,
        stride_y,
        stride_out,
        TOP_K: tl.constexpr,
        HAS_WEIGHTS: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        t = tl.program_id(0)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            m = cols < H
            acc = tl.zeros([BLOCK_H], dtype=tl.float32)
            for k in tl.static_range(TOP_K):
                s = tl.load(slot_ptr + t * TOP_K + k)
                row = tl.where(s >= 0, s, 0)
                mask = m & (tl.full([BLOCK_H], 0, tl.int64) + s >= 0)
                v = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
                if HAS_WEIGHTS:
                    v = v * tl.load(w_ptr + t * TOP_K + k).to(tl.float32)
                acc = acc + v
            tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=m)

    return triton, histogram_kernel, permute_kernel, combine_kernel


@functools.cache
def _triton_put_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def put_rows_kernel(
        src_ptr,
        src_row_ptr,
        peer_ptr,
        offset_ptr,
        table_ptr,
        D,
        stride_src,
        BLOCK_D: tl.constexpr,
    ):
        # Row i of the batch: src[src_row[i]] (zeros when -1) lands at element offset[i]
        # of rank peer[i]'s buffer, whose address is table[peer[i]] (peer-mapped memory on
        # CUDA: these are NVLink stores, no copy engine and no staging buffer).
        i = tl.program_id(0)
        s = tl.load(src_row_ptr + i)
        dst = tl.load(table_ptr + tl.load(peer_ptr + i)).to(
            tl.pointer_type(src_ptr.dtype.element_ty)
        )
        dst = dst + tl.load(offset_ptr + i)
        row = tl.where(s >= 0, s, 0)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            m = cols < D
            v = tl.load(
                src_ptr + row * stride_src + cols,
                mask=m & (tl.full([BLOCK_D], 0, tl.int64) + s >= 0),
                other=0.0,
            )
            tl.store(dst + cols, v, mask=m)

    return put_rows_kernel


def _block_h(h: int) -> int:
    return max(16, min(1024, 1 << (max(h, 1) - 1).bit_length()))


def _histogram_triton(indices: torch.Tensor, num_bins: int) -> torch.Tensor:
    triton, histogram_kernel, _, _ = _triton_kernels()
    flat = indices.reshape(-1).contiguous()
    bins = max(2, 1 << (num_bins - 1).bit_length())  # tl.histogram wants a power of two
    counts = torch.zeros(bins, dtype=torch.int32, device=flat.device)  # int32 atomics
    n = flat.numel()
    if n:
        block = 1024
        histogram_kernel[(triton.cdiv(n, block),)](flat, counts, n, NUM_BINS=bins, BLOCK=block)
    return counts[:num_bins].long()


def _permute_triton(
    x: torch.Tensor, row_assignment: torch.Tensor, top_k: int, scale: torch.Tensor | None
) -> torch.Tensor:
    _, _, permute_kernel, _ = _triton_kernels()
    x = x.contiguous()
    num_rows, h = row_assignment.shape[0], x.shape[1]
    out = torch.empty(num_rows, h, dtype=x.dtype, device=x.device)
    if num_rows and h:
        scale_c = scale.reshape(-1).contiguous() if scale is not None else row_assignment
        permute_kernel[(num_rows,)](
            x,
            row_assignment.contiguous(),
            scale_c,
            out,
            h,
            x.stride(0),
            out.stride(0),
            TOP_K=top_k,
            HAS_SCALE=scale is not None,
            BLOCK_H=_block_h(h),
        )
    return out


def _combine_triton(
    y: torch.Tensor, slot: torch.Tensor, top_k: int, weights: torch.Tensor | None
) -> torch.Tensor:
    _, _, _, combine_kernel = _triton_kernels()
    y = y.contiguous()
    num_tokens, h = slot.numel() // top_k, y.shape[1]
    out = torch.empty(num_tokens, h, dtype=y.dtype, device=y.device)
    if num_tokens and h:
        w = weights.reshape(-1).contiguous() if weights is not None else slot
        combine_kernel[(num_tokens,)](
            y,
            slot.contiguous(),
            w,
            out,
            h,
            y.stride(0),
            out.stride(0),
            TOP_K=top_k,
            HAS_WEIGHTS=weights is not None,
            BLOCK_H=_block_h(h),
        )
    return out


def put_rows_to_peers(
    src_RD: torch.Tensor,
    src_rows: torch.Tensor,
    dst_peer: torch.Tensor,
    dst_offset: torch.Tensor,
    peer_table: torch.Tensor,
) -> None:
    """Triton: ``buffer[dst_peer[i]][dst_offset[i] : + D] = src[src_rows[i]]`` (0 for -1).

    ``peer_table`` (ep,) int64 holds the address of every rank's symmetric buffer (same
    dtype as ``src``). The symmetric-memory dispatcher's one-kernel put of a chunk to every
    peer: packing (``src_rows`` = token of each row) and sending are one pass.
    """
    put_rows_kernel = _triton_put_kernel()
    src = src_RD.contiguous()
    n, d = src_rows.shape[0], src.shape[1]
    if n and d:
        put_rows_kernel[(n,)](
            src, src_rows, dst_peer, dst_offset, peer_table, d, src.stride(0), BLOCK_D=_block_h(d)
        )


# ---------------------------------------------------------------------------------------
# public entry points
# ---------------------------------------------------------------------------------------


def expert_histogram(
    indices: torch.Tensor, num_experts: int, *, backend: KernelBackend = "auto"
) -> torch.Tensor:
    """Tokens per expert: ``counts[e] = (indices == e).sum()`` as int64 (E,), no host sync."""
    if resolve_backend(backend, indices.device) == "triton":
        return _histogram_triton(indices, num_experts)
    return _histogram_torch(indices, num_experts)


def permute_rows(
    x_TH: torch.Tensor,
    row_assignment: torch.Tensor,
    top_k: int,
    scale: torch.Tensor | None = None,
    *,
    backend: KernelBackend = "auto",
) -> torch.Tensor:
    """``out[r] = scale[a] * x[a // top_k]`` for ``a = row_assignment[r] >= 0``, else 0.

    Returns (R, H). ``scale`` (N,) is optional; this is the permute of the forward pass and,
    with ``scale`` = routing weights, the backward of ``combine_rows``.
    """
    if resolve_backend(backend, x_TH.device) == "triton":
        return _permute_triton(x_TH, row_assignment, top_k, scale)
    return _permute_torch(x_TH, row_assignment, top_k, scale)


def combine_rows(
    y_RH: torch.Tensor,
    slot: torch.Tensor,
    top_k: int,
    weights: torch.Tensor | None = None,
    *,
    backend: KernelBackend = "auto",
) -> torch.Tensor:
    """``out[t] = sum_k weights[t, k] * y[slot[t * top_k + k]]`` (dropped slots add 0).

    Returns (T, H); accumulates in fp32 in the order k = 0..K-1. Without ``weights`` this is
    the unpermute (K = 1) or the backward of ``permute_rows``.
    """
    if resolve_backend(backend, y_RH.device) == "triton":
        return _combine_triton(y_RH, slot, top_k, weights)
    return _combine_torch(y_RH, slot, top_k, weights)
