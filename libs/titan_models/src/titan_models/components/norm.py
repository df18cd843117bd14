"""RMSNorm through torch's fused ``F.rms_norm``, rounded as Hugging Face rounds, and the gated
RMSNorm of linear-attention outputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .init import ONES, Constant, Init


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension (Zhang & Sennrich, 2019).

    ``weight * rms_norm(x)``: the statistics and the normalisation in at least fp32 (torch's
    fused kernel, forward and backward), the result cast back to ``x``'s dtype before the
    weight multiplies it, as ``transformers`` does; so bf16 outputs match HF's bit for bit.
    Works on DTensors (tensor-parallel QK-norm over local heads).

    The per-channel scale is ``weight + offset``: ``offset=0`` is the usual norm, ``offset=1``
    the zero-centred one of Qwen3.5 (its checkpoints store ``scale - 1``; the scale is formed
    and applied in fp32 before the cast, as there).
    """

    def __init__(self, dim: int, *, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(_at_least_fp32(x), (x.shape[-1],), eps=self.eps)
        if self.offset:
            return (normed * (_at_least_fp32(self.weight) + self.offset)).to(x.dtype)
        return self.weight * normed.to(x.dtype)

    def param_init(self, *, std: float = 0.0, out_std: float = 0.0) -> dict[str, Init]:
        """Scale of one on every channel (a weight of ``1 - offset``)."""
        return {"weight": Constant(1.0 - self.offset) if self.offset else ONES}

    def extra_repr(self) -> str:
        offset = f", offset={self.offset}" if self.offset else ""
        return f"{self.weight.shape[0]}, eps={self.eps}{offset}"


class GatedRMSNorm(nn.Module):
    """``weight * rmsnorm(x) * act(gate)`` over the last dimension, in fp32 (the output norm of
    Gated DeltaNet, ``act = silu``, and of Kimi Delta Attention, ``act = sigmoid``)."""

    def __init__(self, dim: int, *, eps: float, activation: str) -> None:
        super().__init__()
        if activation not in ("silu", "sigmoid"):
            raise ValueError(
                f"GatedRMSNorm activation must be 'silu' or 'sigmoid', got {activation!r}"
            )
        self.eps = eps
        self.activation = activation
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32, gate32 = _at_least_fp32(x), _at_least_fp32(gate)
        normed = F.rms_norm(x32, (x.shape[-1],), eps=self.eps)
        act = F.silu(gate32) if self.activation == "silu" else torch.sigmoid(gate32)
        return (normed * _at_least_fp32(self.weight) * act).to(x.dtype)

    def param_init(self, *, std: float = 0.0, out_std: float = 0.0) -> dict[str, Init]:
        """Scale of one on every channel."""
        return {"weight": ONES}

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, activation={self.activation}"


def unit_rms(x: torch.Tensor, *, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dimension with no learned scale (Muse Spark's QK-norm,
    attention-output norm, embedding norm and post-attention norm), in at least fp32."""
    return F.rms_norm(_at_least_fp32(x), (x.shape[-1],), eps=eps).to(x.dtype)


class InputScaledRMSNorm(nn.Module):
    """``rms_norm(x · (1 + weight))``: the zero-centred scale applied *before* the
    normalisation (Muse Spark's post-feed-forward and post-expert norms), so the weight sets
    each channel's share of the norm rather than the output's scale. The scaled input is
    rounded to ``x``'s dtype before the statistics, as ``transformers`` does."""

    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scaled = (_at_least_fp32(x) * (_at_least_fp32(self.weight) + 1.0)).to(x.dtype)
        return unit_rms(scaled, eps=self.eps)

    def param_init(self, *, std: float = 0.0, out_std: float = 0.0) -> dict[str, Init]:
        """Scale of one on every channel (a weight of zero)."""
        return {"weight": Constant(0.0)}

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
