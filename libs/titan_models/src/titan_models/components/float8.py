"""FP8 and MXFP8 scaled casts: the one codec every quantised GEMM of Titan uses.

A tensor is quantised as ``q = fp8(x / s)`` (round to nearest even) with scales ``s`` shared by
a group of elements, and dequantised as ``q * s``. Three groupings, always along the GEMM
operand's *reduction* axis ``axis``:

* ``"tensor"``: one scale per matrix (the last two dims: one per expert of an (E, N, K) stack);
* ``"axis"``: one scale per slice along ``axis`` (per row of ``x`` for ``x @ w.T``; "rowwise");
* ``"block"``: one scale per :data:`MX_BLOCK` = 32 consecutive elements along ``axis``
  (OCP Microscaling, MXFP8: e4m3 elements, e8m0 scales).

Scales are powers of two in every grouping: ``s = 2^k`` with ``k`` the smallest integer such
that ``amax / s <= fmax`` (448 for e4m3, 57344 for e5m2), clamped to the e8m0 range
``[-127, 127]``. So nothing saturates, dequantisation ``q * s`` is exact in fp32, and an MX
scale is exactly representable as e8m0 (this is the "round-up" e8m0 choice of NVIDIA's
``cvt.rp.satfinite.ue8m0`` and torchao's RCEIL mode; the OCP reference rounds the exponent
down and saturates instead). An all-zero group gets ``s = 1``.

Error bound (stated and tested): with ``m`` mantissa bits and smallest subnormal ``2^-d``
(e4m3: m=3, d=9; e5m2: m=2, d=16), round-to-nearest errs by half a unit in the last place:

    |x - q * s| <= 2^-(m+1) * |x| + 2^-(d+1) * s            (every element, every grouping)

Values already on the grid (``x = v * s`` with ``v`` an fp8 value and ``s`` the group's scale)
round-trip exactly. Non-finite input: a group holding an inf or a NaN gets a NaN scale, so every
element of that group dequantises to NaN (and so does every GEMM output it touches); nothing is
silently clipped to a finite value. The GEMMs do not check (that would read the device on the
host every step): a NaN loss is how it shows. :func:`check_finite` is the explicit check.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

__all__ = [
    "E4M3",
    "E5M2",
    "MX_BLOCK",
    "Granularity",
    "check_finite",
    "dequantize",
    "fp8_max",
    "quantization_error_bound",
    "quantize",
    "to_e8m0",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
MX_BLOCK = 32
"""Elements per MXFP8 scale block (OCP MX v1.0)."""

Granularity = Literal["tensor", "axis", "block"]
GRANULARITIES: tuple[str, ...] = ("tensor", "axis", "block")

# (largest finite value, mantissa bits, exponent of the smallest subnormal)
_FORMATS = {E4M3: (448.0, 3, -9), E5M2: (57344.0, 2, -16)}
_E8M0_MIN, _E8M0_MAX = -127, 127


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 ``dtype`` (e4m3: 448, e5m2: 57344)."""
    return _format(dtype)[0]


def _format(dtype: torch.dtype) -> tuple[float, int, int]:
    if dtype not in _FORMATS:
        raise ValueError(f"fp8 dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    return _FORMATS[dtype]


def pow2_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Smallest power of two ``s`` with ``amax / s <= fmax``, exactly (from the binary exponent,
    no log rounding); 1 for zero, NaN for inf/NaN, exponent clamped to e8m0's range."""
    fmax = _format(dtype)[0]
    emax = math.frexp(fmax)[1] - 1  # fmax = f * 2^emax, f in [1, 2): 448 = 1.75 * 2^8
    f = fmax / 2.0**emax
    mant, exp = torch.frexp(amax)  # amax = mant * 2^exp, mant in [0.5, 1)
    # amax / 2^(exp-1-emax) = 2*mant * 2^emax, which fits iff 2*mant <= f
    k = exp - 1 - emax + (2 * mant > f).to(exp.dtype)
    k = k.clamp(_E8M0_MIN, _E8M0_MAX)
    scale = torch.ldexp(torch.ones_like(amax), k)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, math.nan))


def _check(x: torch.Tensor, granularity: str, axis: int) -> int:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if x.dim() < 1:
        raise ValueError("quantize: needs a tensor with at least one dim")
    axis = axis % x.dim()
    if granularity == "block" and x.shape[axis] % MX_BLOCK:
        raise ValueError(
            f"quantize: MXFP8 blocks of {MX_BLOCK} along dim {axis} need that dim divisible by "
            f"{MX_BLOCK}, got shape {tuple(x.shape)}"
        )
    return axis


def _amax(x: torch.Tensor, granularity: str, axis: int) -> torch.Tensor:
    """Absolute max of each group, shaped to broadcast against ``x`` (blocks: a trailing
    block dim of size 1 after ``axis`` is split into (n/32, 32))."""
    a = x.abs()
    if granularity == "tensor":
        dims = (-2, -1) if x.dim() >= 2 else (-1,)
        # amax of an empty tensor is undefined: an empty group is all-zero
        return a.amax(dim=dims, keepdim=True) if x.numel() else a.new_zeros([1] * x.dim())
    if granularity == "axis":
        return a.amax(dim=axis, keepdim=True) if x.shape[axis] else a.sum(axis, keepdim=True)
    blocks = a.unflatten(axis, (-1, MX_BLOCK))
    return blocks.amax(dim=axis + 1, keepdim=True)


def quantize(
    x: torch.Tensor, dtype: torch.dtype, granularity: Granularity, axis: int = -1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` -> (``q`` in ``dtype``, fp32 power-of-two scales) grouped along ``axis``.

    Scale shapes: ``"tensor"``: ``x`` with the last two dims 1; ``"axis"``: ``x`` with
    ``axis`` 1; ``"block"``: ``x`` with ``axis`` divided by 32. ``ValueError`` for another
    dtype or granularity, or a block axis not divisible by 32.
    """
    _format(dtype)
    axis = _check(x, granularity, axis)
    xf = x.float()
    scale = pow2_scale(_amax(xf, granularity, axis), dtype)
    if granularity == "block":
        q = (xf.unflatten(axis, (-1, MX_BLOCK)) / scale).to(dtype).flatten(axis, axis + 1)
        return q, scale.squeeze(axis + 1)
    return (xf / scale).to(dtype), scale


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, granularity: Granularity, axis: int = -1
) -> torch.Tensor:
    """``q * scale`` in fp32 (exact): the inverse of :func:`quantize` on representable values."""
    axis = _check(q, granularity, axis)
    if granularity == "block":
        return (q.float().unflatten(axis, (-1, MX_BLOCK)) * scale.unsqueeze(axis + 1)).flatten(
            axis, axis + 1
        )
    return q.float() * scale


def quantization_error_bound(
    x: torch.Tensor, dtype: torch.dtype, granularity: Granularity, axis: int = -1
) -> torch.Tensor:
    """Per-element bound on ``|x - dequantize(*quantize(x))|`` (see the module doc)."""
    _, m, d = _format(dtype)
    axis = _check(x, granularity, axis)
    xf = x.float()
    scale = pow2_scale(_amax(xf, granularity, axis), dtype)
    if granularity == "block":
        scale = scale.expand(*xf.unflatten(axis, (-1, MX_BLOCK)).shape).flatten(axis, axis + 1)
    return xf.abs() * 2.0 ** -(m + 1) + scale * 2.0 ** (d - 1)


def to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales as ``torch.float8_e8m0fnu`` (bits ``k + 127``; NaN -> 0xFF)."""
    _, exp = torch.frexp(scale)
    bits = (exp - 1 + 127).clamp(0, 254).to(torch.uint8)
    bits = torch.where(torch.isnan(scale), torch.full_like(bits, 255), bits)
    return bits.view(torch.float8_e8m0fnu)


def check_finite(x: torch.Tensor, name: str = "tensor") -> None:
    """``ValueError`` if ``x`` holds an inf or a NaN (reads the device: not for the hot path)."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        raise ValueError(
            f"{name} holds {int(bad.sum())} non-finite values (inf/NaN); FP8 quantisation of "
            "such a group yields NaN scales (see titan_models.components.float8)"
        )
