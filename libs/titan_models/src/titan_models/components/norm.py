"""RMSNorm through torch's fused ``F.rms_norm``, rounded as Hugging Face rounds."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .init import ONES, Init


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension (Zhang & Sennrich, 2019).

    ``weight * rms_norm(x)``: the statistics and the normalisation in at least fp32 (torch's
    fused kernel, forward and backward), the result cast back to ``x``'s dtype before the
    weight multiplies it, as ``transformers`` does; so bf16 outputs match HF's bit for bit.
    Works on DTensors (tensor-parallel QK-norm over local heads).
    """

    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x if x.dtype in (torch.float32, torch.float64) else x.float()
        return self.weight * F.rms_norm(x32, (x.shape[-1],), eps=self.eps).to(x.dtype)

    def param_init(self, *, std: float = 0.0, out_std: float = 0.0) -> dict[str, Init]:
        """Scale of one on every channel."""
        return {"weight": ONES}

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
