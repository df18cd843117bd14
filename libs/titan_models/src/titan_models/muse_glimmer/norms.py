"""The scaleless RMSNorm of Muse Glimmer's QK-norm, token embedding and image tokens (its
gain-centred norms are ``components.RMSNorm(offset=1)``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def scaleless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension without a weight, in at least fp32, back in ``x``'s
    dtype."""
    wide = x if x.dtype in (torch.float32, torch.float64) else x.float()
    return F.rms_norm(wide, (x.shape[-1],), eps=eps).to(x.dtype)
