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


# fp32 bit patterns: magnitude mask, exponent field, 1.0, and 22 as an exponent increment
_ABS_BITS, _EXP_BITS, _ONE_BITS, _EXP_22 = 0x7FFFFFFF, 0x7F800000, 0x3F800000, 22 << 23


def _round_e2m1_(a: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
    """``a`` (fp32, >= 0 or NaN) rounded in place onto the E2M1 magnitudes, saturating at 6.

    Below 2, from 2 and from 4 the grid is evenly spaced by ``step = pow2floor(max(a, 1)) / 2``
    (0.5, 1, 2). With ``C = 2^23 * step`` (from the exponent bits of ``max(a, 1)``) the fp32 sum
    ``a + C`` has a unit in the last place of exactly ``step``, so ``(a + C) - C`` is ``a``
    rounded to a multiple of ``step``, ties to the even multiple, which is the even code.
    ``u`` (uniform in [0, 1), shaped like ``a``): stochastic, ``floor(a / step + u) * step``,
    up with probability (a - below) / step."""
    a.clamp_(max=E2M1_MAX)  # NaN stays NaN
    c = a.view(torch.int32).clamp(min=_ONE_BITS).bitwise_and_(_EXP_BITS)  # pow2floor(max(a, 1))
    if u is not None:
        step = c.sub_(1 << 23).view(torch.float32)  # halved
        return a.div_(step).add_(u).floor_().mul_(step)
    magic = c.add_(_EXP_22).view(torch.float32)
    return a.add_(magic).sub_(magic)


def _codes(q: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, sign in bit 3; NaN -> 0) of grid values ``q``."""
    mag = q.abs().nan_to_num(0.0)
    code = torch.where(mag < 2, mag * 2, torch.where(mag < 4, mag + 2, mag / 2 + 4))
    return (code + 8 * (torch.signbit(q) & ~torch.isnan(q))).to(torch.uint8)


def _storage_layout(xf: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(``xf`` in its memory order, the dim of it that holds ``xf``'s last): a transposed
    ``xf`` (``xf.mT`` contiguous, as the GEMMs' transposed operands) is worked on as stored,
    blocked along the rows, with no copy and the 16-element maxima vectorised across columns."""
    if xf.dim() >= 2 and not xf.is_contiguous() and xf.mT.is_contiguous():
        return xf.mT, xf.dim() - 2
    return xf.contiguous(), xf.dim() - 1


def _from_storage(y: torch.Tensor, store: torch.Tensor, dim: int, per_block: bool):
    """Blocked ``y`` back to the logical shape: (..., K) elements or (..., K / 16) scales."""
    shape = list(store.shape)
    if per_block:
        shape[dim] //= NVFP4_BLOCK
    y = y.reshape(shape)
    return y if dim == store.dim() - 1 else y.mT


def _quantized_magnitudes(x: torch.Tensor, stochastic: bool, generator):
    """(|E2M1 values|, e4m3 block scales as fp32, tensor scale, ``x`` as fp32, its storage,
    block dim), the first two blocked: the storage viewed (P, K / 16, 16, Q), the block axis
    third (Q = 1 unless ``x`` is a transposed view).

    The fp32 arithmetic of the module doc, elementwise and in place where it can be; |x| and
    the block maxima on the bit patterns (the max of non-negative floats is that of their
    bits: NaN above inf above every finite value)."""
    _check(x)
    xf = x.float()
    store, dim = _storage_layout(xf)
    shape = store.shape
    blocked = (
        math.prod(shape[:dim]),
        shape[dim] // NVFP4_BLOCK,
        NVFP4_BLOCK,
        math.prod(shape[dim + 1 :]),
    )
    a = store.view(blocked).view(torch.int32).bitwise_and(_ABS_BITS)  # |x|
    bmax = a.amax(2, keepdim=True) if a.numel() else a.new_zeros((*blocked[:2], 1, blocked[3]))
    bmax = bmax.view(torch.float32)
    amax = bmax.amax() if bmax.numel() else xf.new_zeros(())
    t = (amax / (E2M1_MAX * E4M3_MAX)).clamp_min(_TINY)
    t = torch.where(amax == 0, torch.ones_like(t), t)
    t = torch.where(torch.isfinite(amax), t, torch.full_like(t, math.nan))
    s = (bmax / (E2M1_MAX * t)).clamp_max(E4M3_MAX).to(torch.float8_e4m3fn).float()
    scale = s * t  # one fp32 product per block
    scale = torch.where(scale == 0, math.inf, scale)  # an underflowed block: (signed) zeros
    a = a.view(torch.float32).div_(scale)  # |x / (s * t)|
    u = None
    if stochastic:  # drawn in x's logical order, whatever its layout
        u = torch.rand(xf.shape, generator=generator, device=xf.device)
        u = (u if dim == xf.dim() - 1 else u.mT).reshape(blocked)
    return _round_e2m1_(a, u), s, t, xf, store, dim


def quantize(
    x: torch.Tensor, *, stochastic: bool = False, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` (..., K) -> (codes (..., K / 2) uint8, two per byte; block scales (..., K / 16)
    ``float8_e4m3fn``; tensor scale fp32 of shape ()).

    ``stochastic``: round each element up or down at random, unbiased (gradients only).
    ``ValueError`` when K is not a multiple of 16.
    """
    mag, s, t, xf, store, dim = _quantized_magnitudes(x, stochastic, generator)
    q = _from_storage(mag, store, dim, per_block=False).copysign(xf)  # x / (s t) has x's sign
    codes = _codes(q)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, _from_storage(s, store, dim, per_block=True).to(torch.float8_e4m3fn), t


def round_trip(
    x: torch.Tensor, *, stochastic: bool = False, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``dequantize(*quantize(x))`` (bitwise but for NaN's sign) without packing codes: what
    emulated GEMMs use. A transposed view (``x.mT`` contiguous) gives one, quantised as
    stored."""
    mag, s, t, xf, store, dim = _quantized_magnitudes(x, stochastic, generator)
    y = mag.mul_(s).mul_(t)  # (|e2m1| * s) * t: the first product is exact
    return _from_storage(y, store, dim, per_block=False).copysign_(xf)


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
