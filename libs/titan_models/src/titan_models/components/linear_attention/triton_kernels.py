"""Triton kernels of the chunked gated delta rule, forward and backward (the math of
``delta_rule``), as one autograd function.

Used on CUDA tensors; on CPU tensors they run under ``TRITON_INTERPRET=1`` (how the tests
check them against the torch chunked form). Triton is imported lazily, on first use.

Per (batch, head) and chunk of ``C`` tokens, with ``G`` the in-chunk cumulative log decay:

forward
    1. ``_cumsum``: ``G``.
    2. ``_intra_fwd`` (chunks in parallel): ``A_kk``, ``A_qk``, ``T = (I + A_kk)^-1`` by forward
       substitution, ``w = T (beta k e^G)``, ``u = T (beta v)``.
    3. ``_state_fwd`` (chunks in sequence, value tiles in parallel): the state entering each
       chunk ``h_n``, ``v_new = u - w h_n``, ``h_{n+1}``.
    4. ``_output_fwd`` (chunks in parallel): ``o = (q e^G) h_n + A_qk v_new``.
backward
    5. ``_state_bwd`` (chunks in reverse): ``dv_new = K~ dh + A_qk^T do`` and the gradient
       ``dh`` of each chunk's incoming state (``K~ = k e^(G_last - G)``).
    6. ``_intra_bwd`` (chunks in parallel): every input gradient of the chunk from ``h``,
       ``dh``, ``v_new``, ``dv_new`` (through ``T``: ``dA_kk = -T^T dT T^T``), then
       ``dg`` = reverse cumulative sum of ``dG``.

Decays per key channel are exact and stable: ``exp(G_i - G_j)`` is formed per pair (never as
``exp(G_i) exp(-G_j)``), one column of the ``C x C`` matrix at a time. Per-head decays use
``tl.dot``. Packed documents: a segment id per token; the masks are those of the torch form.
Every product is fp32 (``input_precision="ieee"``: no TF32).

Shapes: B batch, H heads, S padded sequence, N chunks, C chunk size, K / V head dims (BK / BV
their power-of-two tiles, at least 16).
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F

import dist_moe.kernels
from dist_moe.kernels import triton_available

__all__ = ["resolve_backend", "triton_available", "triton_chunk_delta_rule"]


def resolve_backend(backend: str, device: torch.device) -> Literal["torch", "triton"]:
    """``auto`` → Triton on CUDA when importable, torch elsewhere; explicit names are checked
    (dist_moe's choice of kernels, shared)."""
    return dist_moe.kernels.resolve_backend(backend, device, what="linear-attention backend")


def _tile(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def triton_chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    chunk_size: int,
    initial_state: torch.Tensor | None,
    document_ids: torch.Tensor | None,
    output_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``chunk_delta_rule`` on the Triton kernels (same arguments, checked by the caller)."""
    from .delta_rule import document_segments

    B, S, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    if C < 16:
        raise ValueError(f"the Triton backend needs chunk_size >= 16, got {C}")
    N = -(-S // C)
    pad = N * C - S

    def layout(t: torch.Tensor, scale_by: float = 1.0) -> torch.Tensor:
        t = t.float().transpose(1, 2)  # (B, H, S, ...)
        t = t * scale_by if scale_by != 1.0 else t
        if pad:
            t = F.pad(t, (0, 0, 0, pad) if t.dim() == 4 else (0, pad))
        return t.contiguous()

    if document_ids is None:
        seg = None
    else:
        seg = document_segments(document_ids)
        if pad:
            seg = torch.cat([seg, seg[:, -1:].expand(-1, pad)], dim=1)
        seg = seg.to(torch.int32).contiguous()
    state = (
        torch.zeros(B, H, K, V, dtype=torch.float32, device=v.device)
        if initial_state is None
        else initial_state.float().contiguous()
    )
    o, final = _ChunkDeltaRule.apply(
        layout(q, scale), layout(k), layout(v), layout(g), layout(beta), state, seg, C
    )
    o = o[:, :, :S].transpose(1, 2).to(v.dtype)
    return o, (final if output_final_state else None)


class _ChunkDeltaRule(torch.autograd.Function):
    """Inputs in the kernels' layout: ``q`` (scaled), ``k`` ``(B, H, S, K)``, ``v``
    ``(B, H, S, V)``, ``g`` ``(B, H, S[, K])``, ``beta`` ``(B, H, S)``, the initial state
    ``(B, H, K, V)``, segment ids ``(B, S)`` or ``None``; outputs ``o`` and the final state."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, state, seg, C):
        kernels = _kernels()
        B, H, S, K = k.shape
        V, N = v.shape[-1], S // C
        per_channel = g.dim() == 4
        BK, BV = _tile(K), _tile(V)
        f32 = {"dtype": torch.float32, "device": v.device}
        G = torch.empty_like(g)
        T = torch.empty(B, H, S, C, **f32)
        A_qk = torch.empty(B, H, S, C, **f32)
        w = torch.empty(B, H, S, K, **f32)
        u = torch.empty(B, H, S, V, **f32)
        h = torch.empty(B, H, N, K, V, **f32)
        v_new = torch.empty(B, H, S, V, **f32)
        o = torch.empty(B, H, S, V, **f32)
        final = torch.empty(B, H, K, V, **f32)
        seg_arg = seg if seg is not None else torch.zeros(1, dtype=torch.int32, device=v.device)
        meta = {"C": C, "BK": BK, "BV": BV, "PER_CHANNEL": per_channel, "HAS_SEG": seg is not None}
        dims = (H, S, K, V)
        kernels.cumsum[(N, B * H)](g, G, *dims, C=C, BK=BK, PER_CHANNEL=per_channel)
        kernels.intra_fwd[(N, B * H)](q, k, v, G, beta, seg_arg, T, A_qk, w, u, *dims, **meta)
        kernels.state_fwd[(B * H,)](k, G, seg_arg, w, u, state, h, v_new, final, *dims, N, **meta)
        kernels.output_fwd[(N, B * H)](q, G, seg_arg, A_qk, h, v_new, o, *dims, N, **meta)
        ctx.save_for_backward(q, k, v, G, beta, seg, T, A_qk, w, h, v_new)
        ctx.C, ctx.per_channel = C, per_channel
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        kernels = _kernels()
        q, k, v, G, beta, seg, T, A_qk, w, h, v_new = ctx.saved_tensors
        B, H, S, K = k.shape
        V, C = v.shape[-1], ctx.C
        N = S // C
        BK, BV = _tile(K), _tile(V)
        do = do.float().contiguous()
        dfinal = (
            torch.zeros(B, H, K, V, dtype=torch.float32, device=v.device)
            if dfinal is None
            else dfinal.float().contiguous()
        )
        seg_arg = seg if seg is not None else torch.zeros(1, dtype=torch.int32, device=v.device)
        meta = {
            "C": C,
            "BK": BK,
            "BV": BV,
            "PER_CHANNEL": ctx.per_channel,
            "HAS_SEG": seg is not None,
        }
        dims = (H, S, K, V)
        dh = torch.empty_like(h)
        dv_new = torch.empty_like(v_new)
        dstate = torch.empty(B, H, K, V, dtype=torch.float32, device=v.device)
        kernels.state_bwd[(B * H,)](
            q, k, G, seg_arg, A_qk, w, do, dfinal, dh, dv_new, dstate, *dims, N, **meta
        )
        dq, dk, dv, dG = (torch.empty_like(t) for t in (q, k, v, G))
        dbeta = torch.empty_like(beta)
        kernels.intra_bwd[(N, B * H)](
            q, k, v, G, beta, seg_arg, T, h, v_new, dh, dv_new, do,
            dq, dk, dv, dG, dbeta, *dims, N, **meta,
        )  # fmt: skip
        return dq, dk, dv, dG, dbeta, dstate, None, None


@functools.cache
def _kernels():
    from . import delta_rule_kernels

    return delta_rule_kernels
