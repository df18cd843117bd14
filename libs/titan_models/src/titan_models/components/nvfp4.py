"""NVFP4: FP4 (E2M1) elements in blocks of 16 with an e4m3 scale each, and one fp32 scale.

A tensor ``x`` (..., K) is quantised along its last dim, the GEMM operand's reduction axis:

* tensor scale ``t = amax(|x|) / (6 * 448)`` (fp32; 1 for an all-zero tensor, at least
  2^-126 so that a tiny tensor does not divide by zero), so that every block scale fits e4m3;
* block scale ``s = e4m3(min(amax(|block|) / (6 * t), 448))`` per :data:`NVFP4_BLOCK` = 16
  consecutive elements (round to nearest even, like every cast here);
* element code ``c = e2m1(x / (s * t))``: round to nearest on the E2M1 grid
  ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` with ties to the even code, saturating at 6 (which only
  happens when e4m3 rounded ``s`` down), the sign in bit 3 (a negative value that rounds to
  zero keeps it: -0);
* dequantised value ``e2m1_value(c) * s * t`` in fp32 (the first product is exact).

Every division and product above is one fp32 operation, in that order, so the codes are a
function of the fp32 input alone (the spec-level reference in the tests redoes them in numpy).
Codes are packed two per byte along K, element ``2i`` in the low nibble and ``2i + 1`` in the
high one (the layout of ``torch.float4_e2m1fn_x2`` and of the device GEMMs).

A block whose e4m3 scale underflows to 0 (its amax below ~2^-10 * 6 * t) quantises to zeros
(-0 for negative elements).
Error bound (stated and tested), with ``v = x / (s * t)`` and ``h(v)`` half the grid spacing
at ``|v|`` (0.25 below 2, 0.5 below 4, 1 from 4 on) and ``s* = amax(|block|) / (6 * t)``::

    |x - dequantize(quantize(x))| <= h(v) * s * t + 6 * t * max(s* - s, 0)

the second term being the saturation when e4m3 rounds the block scale down (at most 2^-4 s*
for a normal e4m3 scale, 2^-10 for a subnormal one).

Rounding of gradients may be stochastic (``stochastic=True``, off by default): each element
rounds to one of its two grid neighbours with probability linear in the distance, so the
quantisation is unbiased (``E[dequantize(quantize(x))] = x`` below saturation). It draws from
``generator`` (or the default one); it is never used for weights or activations.

Non-finite input: an inf or NaN anywhere gives a NaN tensor scale and NaN block scales, so the
whole tensor dequantises to NaN (E2M1 has no NaN code; the scales carry it). Nothing is clipped
silently; ``float8.check_finite`` is the explicit check.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "NVFP4_BLOCK",
    "dequantize",
    "quantization_error_bound",
    "quantize",
    "round_trip",
]

NVFP4_BLOCK = 16
"""Elements per NVFP4 block scale."""
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitude of each E2M1 code 0..7 (bit 3 is the sign)."""
E2M1_MAX = 6.0
E4M3_MAX = 448.0
_TINY = 2.0**-126  # smallest normal fp32: the least tensor scale


def _check(x: torch.Tensor, name: str = "x") -> None:
    if x.dim() < 1:
        raise ValueError(f"nvfp4: {name} needs at least one dim, got a scalar")
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(
            f"nvfp4: blocks of {NVFP4_BLOCK} along the last dim (dim {x.dim() - 1}, the "
            f"reduction dim K) need it divisible by {NVFP4_BLOCK}, got {name} of shape "
            f"{tuple(x.shape)}"
        )


def _scales(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tensor scale t (fp32, shape ()), ideal block scales s* (fp32), e4m3 block scales s
    as fp32), block scales shaped (..., K / 16)."""
    blocks = xf.abs().unflatten(-1, (-1, NVFP4_BLOCK))
    bmax = blocks.amax(-1) if xf.numel() else blocks.sum(-1)
    amax = bmax.amax() if bmax.numel() else xf.new_zeros(())
    t = (amax / (E2M1_MAX * E4M3_MAX)).clamp_min(_TINY)
    t = torch.where(amax == 0, torch.ones_like(t), t)
    t = torch.where(torch.isfinite(amax), t, torch.full_like(t, math.nan))
    ideal = (bmax / (E2M1_MAX * t)).clamp_max(E4M3_MAX)  # NaN stays NaN
    s = ideal.to(torch.float8_e4m3fn).float()
    return t, ideal, s


def _round_e2m1(v: torch.Tensor, stochastic: bool, generator) -> torch.Tensor:
    """``v`` (fp32) rounded onto the signed E2M1 grid, saturating at 6 (a negative value that
    rounds to zero gives -0; NaN stays NaN). Below 2, from 2 and from 4 the grid is evenly
    spaced by 0.5, 1 and 2, and ties to even multiples of the spacing are ties to even codes."""
    a = v.abs().clamp_max(E2M1_MAX)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    if stochastic:  # floor(a / step + u): up with probability (a - below) / step
        u = torch.rand(a.shape, generator=generator, device=a.device)
        q = (a / step + u).floor_() * step
    else:
        q = torch.round(a / step) * step  # round half to even
    return torch.copysign(q, v)


def _codes(q: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, sign in bit 3; NaN -> 0) of grid values ``q``."""
    mag = q.abs().nan_to_num(0.0)
    code = torch.where(mag < 2, mag * 2, torch.where(mag < 4, mag + 2, mag / 2 + 4))
    return (code + 8 * (torch.signbit(q) & ~torch.isnan(q))).to(torch.uint8)


def _quantized_values(
    x: torch.Tensor, stochastic: bool, generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E2M1 values (..., K / 16, 16) fp32, e4m3 block scales as fp32, tensor scale)."""
    _check(x)
    xf = x.float()
    t, _, s = _scales(xf)
    scale = (s * t).unsqueeze(-1)  # s * t per block: one fp32 product
    scale = torch.where(scale == 0, math.inf, scale)  # an underflowed block: (signed) zeros
    v = xf.unflatten(-1, (-1, NVFP4_BLOCK)) / scale
    return _round_e2m1(v, stochastic, generator), s, t


def quantize(
    x: torch.Tensor, *, stochastic: bool = False, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` (..., K) -> (codes (..., K / 2) uint8, two per byte; block scales (..., K / 16)
    ``float8_e4m3fn``; tensor scale fp32 of shape ()).

    ``stochastic``: round each element up or down at random, unbiased (gradients only).
    ``ValueError`` when K is not a multiple of 16.
    """
    q, s, t = _quantized_values(x, stochastic, generator)
    codes = _codes(q).flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, s.to(torch.float8_e4m3fn), t


def round_trip(
    x: torch.Tensor, *, stochastic: bool = False, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``dequantize(*quantize(x))`` (bitwise) without packing codes: what emulated GEMMs use."""
    q, s, t = _quantized_values(x, stochastic, generator)
    return ((q * s.unsqueeze(-1)) * t).flatten(-2)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """E2M1 values (fp32) of packed codes (..., K / 2) -> (..., K)."""
    table = torch.tensor(E2M1_VALUES, device=packed.device)
    table = torch.cat([table, -table])
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    return table[codes.long()]


def dequantize(packed: torch.Tensor, block_scale: torch.Tensor, tensor_scale: torch.Tensor):
    """``e2m1(code) * s * t`` in fp32, shape (..., K): the inverse of :func:`quantize` on
    representable values."""
    if packed.dtype != torch.uint8 or packed.shape[-1] * 2 != block_scale.shape[-1] * 16:
        raise ValueError(
            f"nvfp4.dequantize: codes (..., K / 2) uint8 and block scales (..., K / 16) "
            f"expected, got {packed.dtype} {tuple(packed.shape)} and {tuple(block_scale.shape)}"
        )
    vals = _unpack(packed).unflatten(-1, (-1, NVFP4_BLOCK))
    return ((vals * block_scale.float().unsqueeze(-1)) * tensor_scale.float()).flatten(-2)


def quantization_error_bound(x: torch.Tensor) -> torch.Tensor:
    """Per-element bound on ``|x - dequantize(*quantize(x))|`` (round to nearest; see the
    module doc)."""
    _check(x)
    xf = x.float()
    t, ideal, s = _scales(xf)
    scale = (s * t).unsqueeze(-1)
    a = (xf.unflatten(-1, (-1, NVFP4_BLOCK)) / scale).abs()
    a = torch.where(scale == 0, torch.zeros_like(a), a)
    half = torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))
    sat = (E2M1_MAX * t * (ideal - s).clamp_min(0)).unsqueeze(-1)
    return (half * scale + sat).expand_as(a).flatten(-2)
