"""A small pre-norm transformer stack (attention + SwiGLU MLP, with dropout) for the tests."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_remat as tr


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.RMSNorm(dim)
        self.gate = nn.Linear(dim, 2 * dim, bias=False)
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)
        self.drop = nn.Dropout(dropout)
        self.mlp_region: tr.Policy | None = None
        """When set, the MLP half of forward runs inside ``torch_remat.region(mlp_region)``."""

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        q, k, v = self.qkv(self.norm1(x_BSD)).view(B, S, 3, self.heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x_BSD = x_BSD + self.drop(self.proj(a.transpose(1, 2).reshape(B, S, D)))
        span = contextlib.nullcontext() if self.mlp_region is None else tr.region(self.mlp_region)
        with span:
            h = self.norm2(x_BSD)
            return x_BSD + self.drop(self.down(F.silu(self.gate(h)) * self.up(h)))


class Stack(nn.Module):
    """Embedding, ``layers`` blocks in an nn.ModuleList, final norm and output head."""

    def __init__(
        self,
        *,
        layers: int = 4,
        dim: int = 32,
        heads: int = 4,
        vocab: int = 64,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_Block(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens_BS)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


@pytest.fixture
def make_stack():
    """``make_stack(seed=0, **sizes) -> (model, tokens)``: same seed, same weights and batch."""

    def make(seed: int = 0, batch: int = 2, seq: int = 16, **sizes) -> tuple[Stack, torch.Tensor]:
        torch.manual_seed(seed)
        model = Stack(**sizes)
        tokens = torch.randint(0, model.head.out_features, (batch, seq))
        return model, tokens

    return make
