"""The short causal depthwise convolution (+ SiLU) applied to q, k and v of linear attention.

Each channel sees its own last ``W`` inputs (``W`` = kernel size, 4 in Qwen3.5 and Kimi
Linear). Packed documents: inputs of an earlier document count as zeros. Decoding: the last
``W - 1`` inputs of each row are the layer's conv state in the KV cache.

Shapes: B batch, S sequence, C channels, W kernel size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..init import Init, Uniform


class ShortConvolution(nn.Module):
    """``silu(depthwise causal conv(x))``; ``weight`` is ``(C, 1, W)`` as HF's ``nn.Conv1d``."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"conv kernel_size must be >= 1, got {kernel_size}")
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))

    @property
    def kernel_size(self) -> int:
        return self.weight.shape[-1]

    def forward(
        self,
        x_BSC: torch.Tensor,
        *,
        segments_BS: torch.Tensor | None = None,
        state_BCW: torch.Tensor | None = None,
        lengths_B: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Outputs ``(B, S, C)``.

        Args:
            segments_BS: document index of each token (``document_segments``): a window
                never reaches into an earlier document.
            state_BCW: the ``W - 1`` inputs before this step (a KV cache's conv state); it is
                overwritten with the ``W - 1`` inputs ending at each row's last real token
                (``lengths_B``, all ``S`` by default).
        """
        W = self.kernel_size
        weight_CW = self.weight[:, 0]
        if state_BCW is not None:
            x_ext = torch.cat([state_BCW.transpose(1, 2).to(x_BSC.dtype), x_BSC], dim=1)
            if W > 1:
                S = x_BSC.shape[1]
                ends_B = lengths_B if lengths_B is not None else torch.full_like(x_BSC[:, 0, 0], S)
                index_BW = ends_B.long()[:, None] + torch.arange(W - 1, device=x_BSC.device)
                kept = torch.gather(x_ext, 1, index_BW[..., None].expand(-1, -1, x_ext.shape[2]))
                state_BCW.copy_(kept.transpose(1, 2))
            y = F.conv1d(x_ext.transpose(1, 2), weight_CW[:, None], groups=x_ext.shape[2])
            return F.silu(y.transpose(1, 2))
        if segments_BS is None:
            y = F.conv1d(x_BSC.transpose(1, 2), self.weight, padding=W - 1, groups=x_BSC.shape[2])
            return F.silu(y[..., : x_BSC.shape[1]].transpose(1, 2))
        # Windows (B, S, C, W) with the inputs of other documents zeroed.
        windows = F.pad(x_BSC, (0, 0, W - 1, 0)).unfold(1, W, 1)
        seg = F.pad(segments_BS, (W - 1, 0), value=-1).unfold(1, W, 1)  # (B, S, W)
        same = (seg == segments_BS[..., None]).to(x_BSC.dtype)
        return F.silu(torch.einsum("bscw,bsw,cw->bsc", windows, same, weight_CW))

    def param_init(self, *, std: float = 0.0, out_std: float = 0.0) -> dict[str, Init]:
        """U(-1/√W, 1/√W): ``nn.Conv1d``'s own default for a depthwise kernel (fan-in ``W``),
        which HF's Gated DeltaNet and KDA keep."""
        bound = 1 / math.sqrt(self.kernel_size)
        return {"weight": Uniform(-bound, bound)}

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, kernel_size={self.kernel_size}"
