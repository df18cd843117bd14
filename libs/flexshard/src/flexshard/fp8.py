"""Per-tile float8 (e4m3) quantisation used by the block-FP8 all-gather.

Each ``(r, c)`` tile ``x`` gets its own fp32 scale ``s = amax(|x|) / 448`` (448 is the
largest finite e4m3 value; an all-zero tile gets ``s = 1``) and is stored as
``q = e4m3(x / s)``. Dequantisation is ``q * s``.

Error bound (documented and tested): e4m3 keeps 3 mantissa bits, so round-to-nearest
errs by at most half a unit in the last place, 2^-4 of the value, for normal numbers; below
the smallest normal (2^-6) the spacing is the subnormal step 2^-9. Hence, for every element,

    |x - dequant(quant(x))| <= 2^-4 * |x| + 2^-10 * s,      s = amax(tile) / 448

(plus fp32 rounding of the division and multiplication, a few ulp of fp32). In particular
no element errs by more than ``amax(tile) / 16 + amax(tile) / 458752``.

``pow2=True`` (``Bucket(quantize="fp8_block_pow2")``) rounds each tile's scale up to a power
of two, ``s = 2^ceil(log2(amax / 448))`` (so ``s < 2 * amax / 448``; the bound above holds
with this ``s``). Then ``q * s`` is exact in fp32 and bf16, and re-quantising a gathered tile
into any finer power-of-two-scaled e4m3 format whose groups lie inside one tile (MXFP8 blocks
of 32 along either dim) is lossless: every group's scale is ``2^j <= s`` and ``q * s / 2^j``
is ``q`` times a power of two that stays <= 448. A quantised GEMM reading the gathered weight
therefore rounds it no further.
"""

from __future__ import annotations

import torch

__all__ = [
    "E4M3_MAX",
    "dequantize_tiles",
    "fp8_block_error_bound",
    "quantize_tiles",
]

E4M3_MAX = 448.0
_FP8 = torch.float8_e4m3fn


def quantize_tiles(tiles: torch.Tensor, *, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``tiles`` of shape ``(n, r, c)`` -> (``(n, r, c)`` float8_e4m3fn, ``(n,)`` fp32 scales);
    ``pow2``: scales rounded up to powers of two."""
    if tiles.dim() != 3:
        raise ValueError(f"quantize_tiles: tiles must be (n, r, c), got shape {tuple(tiles.shape)}")
    x = tiles.float()
    amax = x.abs().amax(dim=(1, 2)) if x.numel() else x.new_zeros(x.shape[0])
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if pow2:  # the smallest 2^k >= amax / 448, from the exponent (no log rounding)
        mant, exp = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exp - (mant == 0.5).to(exp.dtype))
    q = (x / scale[:, None, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(_FP8)
    return q, scale


def dequantize_tiles(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_tiles` (up to the bound of :func:`fp8_block_error_bound`)."""
    return (q.float() * scale.float()[:, None, None]).to(dtype)


def fp8_block_error_bound(tiles: torch.Tensor, *, pow2: bool = False) -> torch.Tensor:
    """Per-element bound on ``|x - dequant(quant(x))|`` for ``tiles`` of shape (n, r, c)."""
    x = tiles.float()
    scale = quantize_tiles(x, pow2=pow2)[1][:, None, None]
    return x.abs() * 2.0**-4 + scale * 2.0**-10 + x.abs() * 4 * torch.finfo(torch.float32).eps
