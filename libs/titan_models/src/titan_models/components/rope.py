"""Rotary position embeddings (Su et al., 2021) in the rotate-half or the interleaved layout.

Frequencies: plain ``theta``, Llama 3.1 scaling, or YaRN (Peng et al., 2023). The default
layout is the one most Hugging Face checkpoints use (the two halves of a head are the real and
imaginary parts), so their q/k projections load without any permutation; ``interleaved=True``
rotates adjacent channel pairs instead (DeepSeek-V4), for checkpoints stored that way.

Shapes: B batch, S sequence, H heads, D rotary head dim, d = D // 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency scaling: long wavelengths slowed by ``factor``, a smooth ramp between."""

    factor: float
    """Divisor of the frequencies whose wavelength exceeds ``original_max_seq_len / low_freq_factor``."""
    low_freq_factor: float = 1.0
    """Wavelengths above ``original_max_seq_len / low_freq_factor`` are fully scaled."""
    high_freq_factor: float = 4.0
    """Wavelengths below ``original_max_seq_len / high_freq_factor`` are left alone."""
    original_max_seq_len: int = 8192
    """Context length of pre-training before the long-context extension."""


@dataclass(frozen=True, kw_only=True, slots=True)
class YarnRopeScaling:
    """YaRN: interpolate low frequencies by ``factor``, keep high ones, ramp between; scale cos/sin."""

    factor: float
    """Context extension factor."""
    original_max_seq_len: int
    """Context length of pre-training before the extension."""
    beta_fast: float = 32.0
    """Rotations at which the ramp starts (frequencies above are extrapolated)."""
    beta_slow: float = 1.0
    """Rotations at which the ramp ends (frequencies below are interpolated)."""
    mscale: float | None = None
    """DeepSeek-style magnitude scale numerator (with ``mscale_all_dim``)."""
    mscale_all_dim: float | None = None
    """DeepSeek-style magnitude scale denominator."""
    attention_factor: float | None = None
    """Explicit cos/sin scale; by default ``0.1 · ln(factor) + 1`` (or the mscale ratio)."""
    truncate: bool = True
    """Round the ramp bounds to whole dimensions, as the reference implementation does."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeConfig:
    """Rotary embedding frequencies."""

    theta: float
    """Base wavelength."""
    scaling: Llama3RopeScaling | YarnRopeScaling | None = None
    """Long-context frequency scaling; ``None`` for plain RoPE."""

    def __post_init__(self) -> None:
        if not self.theta > 0:
            raise ValueError(f"RopeConfig.theta must be > 0, got {self.theta!r}")
        allowed = (Llama3RopeScaling, YarnRopeScaling, type(None))
        if not isinstance(self.scaling, allowed):
            raise ValueError(
                "RopeConfig.scaling must be Llama3RopeScaling, YarnRopeScaling or None, "
                f"got {type(self.scaling).__name__}"
            )


def rope_frequencies(
    rope: RopeConfig, head_dim: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``(head_dim // 2,)`` in fp32 and the scale applied to cos/sin.

    Computed with the same operations, in the same order, as ``transformers``'
    ``ROPE_INIT_FUNCTIONS``, so the tables agree bit for bit.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    scaling = rope.scaling
    if scaling is None:
        return inv_freq, 1.0
    if isinstance(scaling, Llama3RopeScaling):
        return _llama3_scaled(inv_freq, scaling), 1.0
    return _yarn_scaled(rope.theta, head_dim, scaling, device)


def _llama3_scaled(inv_freq: torch.Tensor, s: Llama3RopeScaling) -> torch.Tensor:
    low_freq_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_freq_wavelen = s.original_max_seq_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 · mscale · ln(scale) + 1`` (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_scaled(
    theta: float, dim: int, s: YarnRopeScaling, device: torch.device | str | None
) -> tuple[torch.Tensor, float]:
    if s.attention_factor is not None:
        attention_factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention_factor = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(s.factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_seq_len / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp

    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (s.factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp.to(device)  # 1 where the frequency is extrapolated (kept as is)
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class RopeTables(Protocol):
    """What a model calls for its ``(cos, sin)`` tables: ``RotaryEmbedding`` (positions
    ``(B, S)``) or a variant such as M-RoPE (positions ``(3, B, S)``)."""

    def __call__(
        self, positions: torch.Tensor, dtype: torch.dtype, /
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class RotaryEmbedding:
    """cos/sin tables for given positions; a plain object (no parameters, no buffers).

    The inverse frequencies are cached per device outside the module tree, so meta-device
    construction, ``to_empty`` and dtype casts of the model never touch them.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, *, interleaved: bool = False) -> None:
        """``interleaved``: tables for ``apply_rotary(..., interleaved=True)`` (channel pairs
        ``(2i, 2i+1)`` rotate together) instead of the rotate-half layout."""
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.rope = rope
        self.head_dim = head_dim
        self.interleaved = interleaved
        self._inv_freq: dict[torch.device, tuple[torch.Tensor, float]] = {}

    def __call__(
        self, positions_BS: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` tables ``(B, S, 1, D)`` in ``dtype``, broadcastable over heads.

        ``cos`` is HF's ``cat(cos, cos)``; ``sin`` carries the sign of the rotation,
        ``cat(-sin, sin)``, so a rotation is ``x·cos + swap_halves(x)·sin``. Interleaved: each
        angle repeated for its pair, ``sin`` as ``(-sin, sin)`` pairs, and ``swap_pairs``.
        """
        device = positions_BS.device
        if device not in self._inv_freq:
            self._inv_freq[device] = rope_frequencies(self.rope, self.head_dim, device)
        inv_freq, scale = self._inv_freq[device]
        freqs_BSd = positions_BS[..., None].float() * inv_freq
        cos, sin = freqs_BSd.cos(), freqs_BSd.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        if self.interleaved:
            cos_BSD = cos.repeat_interleave(2, -1)
            sin_BSD = torch.stack([-sin, sin], -1).flatten(-2)
        else:
            cos_BSD, sin_BSD = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
        return cos_BSD.to(dtype).unsqueeze(2), sin_BSD.to(dtype).unsqueeze(2)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)


def _swap_pairs(x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)


class _RotaryFunction(torch.autograd.Function):
    """``x·cos + swap(x)·sin`` in three kernels; its gradient is the inverse rotation,
    ``g·cos − swap(g)·sin``, so nothing but the tables is saved."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
    ) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.swap = _swap_pairs if interleaved else _swap_halves
        return torch.addcmul(x * cos, ctx.swap(x), sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        cos, sin = ctx.saved_tensors
        return torch.addcmul(grad * cos, ctx.swap(grad), sin, value=-1), None, None, None


def apply_rotary(
    x_BSHD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], *, interleaved: bool = False
) -> torch.Tensor:
    """Rotate ``x`` by the position angles; ``rope`` is ``RotaryEmbedding``'s ``(cos, sin)``
    (``interleaved`` as the tables were built: rotate channel pairs, not halves).

    Tables narrower than a head rotate its leading channels only and pass the rest through
    (partial rotary, as Qwen3.5's ``partial_rotary_factor``)."""
    cos, sin = rope
    rotated = cos.shape[-1]
    if rotated == x_BSHD.shape[-1]:
        return _RotaryFunction.apply(x_BSHD, cos, sin, interleaved)
    head, rest = x_BSHD.split([rotated, x_BSHD.shape[-1] - rotated], dim=-1)
    return torch.cat([_RotaryFunction.apply(head, cos, sin, interleaved), rest], dim=-1)


def apply_rotary_tail(
    x_BSHD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], *, interleaved: bool = False
) -> torch.Tensor:
    """Partial RoPE on the *last* channels of each head (as many as the tables are wide); the
    leading channels pass through (DeepSeek-V4 heads are ``[no-position | rotated]``)."""
    width = rope[0].shape[-1]
    if width == x_BSHD.shape[-1]:
        return apply_rotary(x_BSHD, rope, interleaved=interleaved)
    plain, rotated = x_BSHD.split([x_BSHD.shape[-1] - width, width], dim=-1)
    return torch.cat([plain, apply_rotary(rotated, rope, interleaved=interleaved)], dim=-1)
