"""A small transformer-like debug model for tests, examples and benchmarks (norms are torch's
``nn.RMSNorm``, the fused ``F.rms_norm``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "TinyTransformer", "lm_batch"]


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm = nn.RMSNorm(dim, eps=1e-6)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim, eps=1e-6)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (
            w(h).view(b, s, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, d))
        return x + self.w2(F.gelu(self.w1(self.mlp_norm(x))))


class TinyTransformer(nn.Module):
    """Embedding -> ``n_layers`` pre-norm blocks (attention + GELU MLP) -> norm -> head."""

    def __init__(
        self,
        vocab: int = 37,
        dim: int = 16,
        n_layers: int = 2,
        n_heads: int = 2,
        hidden: int = 42,
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, hidden) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def lm_batch(
    vocab: int, batch: int, seq: int, seed: int, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (inputs, targets) token batch: targets are inputs shifted by one."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return t[:, :-1].to(device), t[:, 1:].to(device)
