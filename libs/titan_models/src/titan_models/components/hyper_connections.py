"""Manifold-constrained hyper-connections (mHC; Xie et al. 2026, DeepSeek-V4 §2.2).

The residual stream is widened to ``N`` parallel streams ``h (B, S, N, D)``. Around each
sub-layer ``F`` (attention or FFN) one ``HyperConnection`` computes, from all streams of a
token, three mixing weights:

- ``pre (N)``: collapses the streams into the sub-layer's input ``x = Σ_j pre_j · h_j``;
- ``post (N)``: expands the sub-layer's output back onto the streams;
- ``comb (N, N)``: mixes the streams themselves, projected onto the doubly stochastic
  matrices (the Birkhoff polytope) by Sinkhorn-Knopp iterations, so the residual map stays
  non-expansive in depth.

and the block's update is ``h'_k = post_k · F(x) + Σ_j comb_jk · h_j``. The weights come from
one linear map of the RMS-normalised, flattened streams (``fn``), with a learned offset
(``base``) and one learned gain per kind (``scale``):

``pre = σ(s_pre·a + b_pre) + ε``, ``post = 2σ(s_post·a' + b_post)``,
``comb = Sinkhorn(softmax(s_comb·A + B) + ε)``.

The final ``HyperHead`` collapses the streams once more (its own ``pre``) before the last norm.
Everything is computed in fp32 (the streams' mixing weights are tiny and sensitive), then cast
back to the streams' dtype.

Shapes: B batch, S sequence, N streams (``hc_mult``), D model dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .init import ONES, Constant, Init, Normal


def sinkhorn_knopp(m_BSNN: torch.Tensor, *, iters: int, eps: float) -> torch.Tensor:
    """Alternately normalise columns and rows of positive matrices ``m`` (``iters`` column
    steps, ``iters - 1`` row steps between them, column first), each sum offset by ``eps``:
    the DeepSeek-V4 projection onto (nearly) doubly stochastic matrices."""
    m_BSNN = m_BSNN / (m_BSNN.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m_BSNN = m_BSNN / (m_BSNN.sum(dim=-1, keepdim=True) + eps)
        m_BSNN = m_BSNN / (m_BSNN.sum(dim=-2, keepdim=True) + eps)
    return m_BSNN


class HyperConnection(nn.Module):
    """The mixing weights around one sub-layer (see the module docstring); ``forward`` returns
    ``(post, comb, collapsed input)`` and ``merge`` applies the update."""

    def __init__(
        self, dim: int, num_streams: int, *, sinkhorn_iters: int, eps: float, norm_eps: float
    ) -> None:
        """``eps``: the floor added to ``pre``, ``comb`` and the Sinkhorn sums (HF
        ``hc_eps``); ``norm_eps``: the RMS normalisation of the flattened streams."""
        super().__init__()
        n = num_streams
        self.num_streams, self.sinkhorn_iters = n, sinkhorn_iters
        self.eps, self.norm_eps = eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * dim))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, h_BSND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``post (B, S, N)``, ``comb (B, S, N, N)`` (fp32) and the collapsed input
        ``(B, S, D)`` in the streams' dtype."""
        B, S, N, D = h_BSND.shape
        flat_BSX = F.rms_norm(h_BSND.reshape(B, S, N * D).float(), (N * D,), eps=self.norm_eps)
        mix_BSY = F.linear(flat_BSX, self.fn.float())
        pre, post, comb = mix_BSY.split([N, N, N * N], dim=-1)
        base_pre, base_post, base_comb = self.base.float().split([N, N, N * N])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre_BSN = torch.sigmoid(pre * s_pre + base_pre) + self.eps
        post_BSN = 2 * torch.sigmoid(post * s_post + base_post)
        comb_BSNN = (comb * s_comb + base_comb).view(B, S, N, N).softmax(-1) + self.eps
        comb_BSNN = sinkhorn_knopp(comb_BSNN, iters=self.sinkhorn_iters, eps=self.eps)
        x_BSD = (pre_BSN[..., None] * h_BSND).sum(dim=2).to(h_BSND.dtype)
        return post_BSN, comb_BSNN, x_BSD

    @staticmethod
    def merge(
        h_BSND: torch.Tensor, out_BSD: torch.Tensor, post_BSN: torch.Tensor, comb_BSNN: torch.Tensor
    ) -> torch.Tensor:
        """``h'_k = post_k · out + Σ_j comb_jk · h_j``."""
        dtype = h_BSND.dtype
        mixed_BSND = comb_BSNN.to(dtype).transpose(-1, -2) @ h_BSND
        return post_BSN.to(dtype)[..., None] * out_BSD[..., None, :] + mixed_BSND

    def param_init(self, *, std: float, out_std: float = 0.0) -> dict[str, Init]:
        """``fn`` N(0, std²), ``base`` 0, ``scale`` 1: at init every stream weighs the same
        (``pre = ½``, ``post = 1``, ``comb`` uniform), as transformers initialises it."""
        return {"fn": Normal(std), "base": Constant(0.0), "scale": ONES}


class HyperHead(nn.Module):
    """The last collapse of the ``N`` streams into one ``(B, S, D)`` (its own ``pre``)."""

    def __init__(self, dim: int, num_streams: int, *, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.num_streams, self.eps, self.norm_eps = num_streams, eps, norm_eps
        self.fn = nn.Parameter(torch.empty(num_streams, num_streams * dim))
        self.base = nn.Parameter(torch.empty(num_streams))
        self.scale = nn.Parameter(torch.empty(1))

    def forward(self, h_BSND: torch.Tensor) -> torch.Tensor:
        B, S, N, D = h_BSND.shape
        flat_BSX = F.rms_norm(h_BSND.reshape(B, S, N * D).float(), (N * D,), eps=self.norm_eps)
        mix_BSN = F.linear(flat_BSX, self.fn.float())
        pre_BSN = torch.sigmoid(mix_BSN * self.scale.float() + self.base.float()) + self.eps
        return (pre_BSN[..., None] * h_BSND).sum(dim=2).to(h_BSND.dtype)

    def param_init(self, *, std: float, out_std: float = 0.0) -> dict[str, Init]:
        """As ``HyperConnection``: ``fn`` N(0, std²), ``base`` 0, ``scale`` 1."""
        return {"fn": Normal(std), "base": Constant(0.0), "scale": ONES}


__all__ = ["HyperConnection", "HyperHead", "sinkhorn_knopp"]
