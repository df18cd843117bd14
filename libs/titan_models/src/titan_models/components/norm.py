"""RMSNorm with a hand-written backward (fewer passes over the activations than autograd's), and
the gated RMSNorm of linear-attention outputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


class _RMSNormFunction(torch.autograd.Function):
    """``weight * (x * rsqrt(mean(x²) + eps))``, statistics in fp32, rounded as HF rounds.

    Autograd of the composite formula saves four activations and runs about ten elementwise
    kernels backward. Here the forward reads ``x`` once for the statistics (``vector_norm``)
    and once for the output; only ``x`` and the per-row ``rstd`` are saved. The backward is the
    closed form ``dx = rstd · g·w − x · rstd³ · Σ(g·w·x) / D`` with both reductions over
    ``g·x`` done as matrix-vector products (``Σ_rows g·x·rstd`` for the weight, ``(g·x)·w`` per
    row): six full passes instead of autograd's ten. On a busy CPU every pass costs a thread
    wake-up, so the pass count, not the bytes, is what the step time follows.
    """

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
    ) -> torch.Tensor:
        x32 = _at_least_fp32(x)
        sum_sq = torch.linalg.vector_norm(x32, dim=-1, keepdim=True).square_()
        rstd = sum_sq.div_(x.shape[-1]).add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        if offset:  # zero-centred weight (Qwen3.5): the scale is 1 + w, applied in fp32
            return torch.mul(x32, rstd).mul_(_at_least_fp32(weight) + offset).to(x.dtype)
        y = torch.mul(x32, rstd).to(x.dtype)  # the cast is a no-op in fp32
        return y.mul_(weight) if weight.dtype == y.dtype else weight * y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        dim = x.shape[-1]
        grad32, x32 = _at_least_fp32(grad), _at_least_fp32(x)
        weight32 = _at_least_fp32(weight) + ctx.offset if ctx.offset else _at_least_fp32(weight)
        gx_ND = (grad32 * x32).reshape(-1, dim)
        rstd_N = rstd.reshape(-1)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.mv(gx_ND.t(), rstd_N).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            coef = torch.mv(gx_ND, weight32).reshape(rstd.shape).mul_(rstd.pow(3)).div_(dim)
            grad_x = (grad32 * weight32).mul_(rstd).addcmul_(x32, coef, value=-1).to(x.dtype)
        return grad_x, grad_weight, None, None


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension (Zhang & Sennrich, 2019).

    The per-channel scale is ``weight + offset``: ``offset=0`` is the usual norm, ``offset=1``
    the zero-centred one of Qwen3.5 (its checkpoints store ``scale - 1``; the scale is formed
    in fp32, as there).
    """

    def __init__(self, dim: int, *, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps, self.offset)

    def init_weights(self) -> None:
        """Scale of one on every channel (a weight of ``1 - offset``)."""
        nn.init.constant_(self.weight, 1.0 - self.offset)

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
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32, gate32 = _at_least_fp32(x), _at_least_fp32(gate)
        rstd = torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        act = F.silu(gate32) if self.activation == "silu" else torch.sigmoid(gate32)
        return (x32 * rstd * _at_least_fp32(self.weight) * act).to(x.dtype)

    def init_weights(self) -> None:
        """Scale of one on every channel."""
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, activation={self.activation}"
