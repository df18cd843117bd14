"""Batch-invariant mode: every row's result is computed in an order that ignores its neighbours.

A matmul library picks its kernel, blocking and threading from the shapes; SDPA picks its key
tiling from the sequence length. So the same row of activations gives results that differ in
the last bits with the batch size, with the other rows present, and between a one-token decode
step and a full-sequence forward. Inside ``batch_invariant()`` the two ops whose reduction
order depends on that are replaced (through a ``TorchFunctionMode``, so the model code is
untouched):

- ``F.linear``: the ``M`` rows are padded to a multiple of ``row_block`` and every block is one
  ``torch.mm`` of exactly ``row_block`` rows, so the kernel (and its reduction order over ``K``)
  is the same for every row whatever ``M`` is.
- ``F.scaled_dot_product_attention``: keys are cut into blocks of ``key_block`` (the last one
  padded and masked); a query's scores, softmax denominator and output are reduced inside a
  block over a fixed length and across blocks by a left-to-right fold. A block a query cannot
  see adds an exact zero, so a decode step over a longer, partly masked cache and the trainer's
  causal forward over the whole sequence produce the same bits.

Everything else the model runs (embedding, RMSNorm's row statistics, RoPE, SwiGLU, the
log-softmax of a row) is already elementwise or reduces each row over a fixed length, which
the tests check. The mode is thread-local: a rollout thread enters it on its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_ROW_BLOCK = 8
"""Default rows per GEMM of ``invariant_linear``. Measured on the debug model (batch 8, 32-token
prompts, 64 new tokens, 1 and 2 threads): 8-row GEMMs leave a decode step of 8 rows unpadded;
with ``_KEY_BLOCK`` the mode cost 1.7-1.9x the default mode's time, against 1.9-2.0x for 16 rows
and 64 keys."""

_KEY_BLOCK = 32
"""Default keys per block of ``invariant_attention``: 32-key blocks pad a short cache less than
64 (measured with ``_ROW_BLOCK``, see there)."""


def invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    row_block: int = _ROW_BLOCK,
) -> torch.Tensor:
    """``F.linear`` whose every output row is computed by the same fixed-shape GEMM."""
    x_MK = x.reshape(-1, x.shape[-1])
    M = x_MK.shape[0]
    pad = (-M) % row_block
    if pad:
        x_MK = torch.cat([x_MK, x_MK.new_zeros(pad, x_MK.shape[1])])
    w_KN = weight.t()
    blocks = [torch.mm(x_MK[i : i + row_block], w_KN) for i in range(0, M + pad, row_block)]
    out_MN = torch.cat(blocks)[:M]
    if bias is not None:
        out_MN = out_MN + bias
    return out_MN.view(*x.shape[:-1], weight.shape[0])


def invariant_attention(
    q_BHSE: torch.Tensor,
    k_BKLE: torch.Tensor,
    v_BKLE: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    key_block: int = _KEY_BLOCK,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with a per-query reduction order fixed by key blocks.

    Shapes: B batch, H query heads, K kv heads, S queries, L keys, E head dim. ``attn_mask`` must
    be boolean (True = attend), broadcastable to ``(B, H, S, L)``.
    """
    if dropout_p:
        raise ValueError(f"batch-invariant attention has no dropout (dropout_p={dropout_p})")
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise TypeError(f"batch-invariant attention needs a boolean mask, got {attn_mask.dtype}")
    B, H, S, E = q_BHSE.shape
    L = k_BKLE.shape[2]
    if k_BKLE.shape[1] != H:
        if not enable_gqa:
            raise ValueError(f"{H} query heads vs {k_BKLE.shape[1]} kv heads needs enable_gqa")
        group = H // k_BKLE.shape[1]
        k_BKLE = k_BKLE.repeat_interleave(group, dim=1)
        v_BKLE = v_BKLE.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    if is_causal:  # SDPA's convention: query i sees keys 0..i (top-left aligned)
        causal = torch.ones(S, L, dtype=torch.bool, device=q_BHSE.device).tril()
        attn_mask = causal if attn_mask is None else attn_mask & causal
    if attn_mask is None:
        attn_mask = torch.ones(1, 1, S, L, dtype=torch.bool, device=q_BHSE.device)
    mask_BHSL = attn_mask.expand(B, H, S, L)
    pad = (-L) % key_block
    if pad:
        k_BKLE = F.pad(k_BKLE, (0, 0, 0, pad))
        v_BKLE = F.pad(v_BKLE, (0, 0, 0, pad))
        mask_BHSL = F.pad(mask_BHSL, (0, pad), value=False)

    nb = (L + pad) // key_block
    # Scores of every key block at once: (B, H, S, nb, key_block), each a fixed-length dot.
    k_BHnkE = k_BKLE.reshape(B, H, nb, key_block, E)
    s = (q_BHSE[:, :, :, None, None, :] * k_BHnkE[:, :, None]).sum(-1) * scale
    s = s.masked_fill(~mask_BHSL.reshape(B, H, S, nb, key_block), float("-inf"))
    row_max = s.amax(dim=(-2, -1), keepdim=True)  # exact: max has no rounding
    p = torch.exp(s - row_max)  # a key the query cannot see gives exactly 0
    psum_BHSn = p.sum(-1)
    v_BHnEk = v_BKLE.reshape(B, H, nb, key_block, E).transpose(-1, -2)
    o_BHSnE = (p[:, :, :, :, None, :] * v_BHnEk[:, :, None]).sum(-1)
    # Fold the blocks left to right: blocks past a query's last key add exact zeros.
    denom, out = psum_BHSn[..., 0:1], o_BHSnE[:, :, :, 0]
    for j in range(1, nb):
        denom = denom + psum_BHSn[..., j : j + 1]
        out = out + o_BHSnE[:, :, :, j]
    return out / denom


class _BatchInvariantMode(TorchFunctionMode):
    def __init__(self, row_block: int, key_block: int) -> None:
        super().__init__()
        self.row_block, self.key_block = row_block, key_block

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return invariant_linear(*args, **kwargs, row_block=self.row_block)
        if func is F.scaled_dot_product_attention:
            return invariant_attention(*args, **kwargs, key_block=self.key_block)
        return func(*args, **kwargs)


@contextmanager
def batch_invariant(*, row_block: int = _ROW_BLOCK, key_block: int = _KEY_BLOCK) -> Iterator[None]:
    """Run the enclosed model code in batch-invariant mode (see the module docstring).

    The trainer and the generator must use the same blocks (defaults: 8 rows, 32 keys,
    measured on the debug model; see ``_ROW_BLOCK``).
    """
    for name, value in (("row_block", row_block), ("key_block", key_block)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"batch_invariant {name}={value!r} must be an int >= 1")
    with _BatchInvariantMode(row_block, key_block):
        yield
