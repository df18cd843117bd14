"""Multi-head latent attention (DeepSeek-V2/V3, DeepSeek-AI 2024) through ``attend``.

Keys and values are compressed into one latent per token (``kv_lora_rank`` wide) plus one
rope key shared by every head (``qk_rope_head_dim`` wide); those two are all the KV cache holds.
Queries are optionally compressed too (``q_lora_rank`` > 0). A head's query/key is its
``qk_nope_head_dim`` content part followed by the rotated ``qk_rope_head_dim`` part.

With a KV cache (decoding) attention runs in latent space ("weight absorption"): ``wkv_b``'s key
half is folded into the queries and its value half applied after attention, so each step reads
the cached latents once instead of re-expanding every cached token into per-head keys/values.

Shapes: B batch, S queries, L keys, D model dim, H heads (local ones under tensor parallelism,
read off the projections at run time), C kv latent, R rope dim, N nope dim, V value dim,
E = N + R (q/k head), F = N + V (``wkv_b`` rows per head), X = C + R (latent-space q/k),
G = H·E, I = the input of ``wq``/``wq_b``.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import cached_keys
from .attention_metadata import AttentionMetadata
from .backends import attend
from .init import Init, Normal, prefixed
from .kv_cache import LayerKVCache
from .norm import RMSNorm
from .rope import apply_rotary


class MultiHeadLatentAttention(nn.Module):
    """``x → q (direct or via the q latent) ; x → (kv latent, rope key) → per-head k, v``."""

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        latent_norm_eps: float,
        softmax_scale: float,
        window: int | None = None,
        rotary: bool = True,
    ) -> None:
        """``q_lora_rank=0``: queries straight from ``x`` (``wq``), as DeepSeek-V2-Lite;
        ``window``: sliding window of this layer (``attend``); ``rotary=False``: the "rope"
        parts carry no position either (Kimi Linear's NoPE MLA)."""
        super().__init__()
        self.window = window
        self.rotary = rotary
        self.backend: str | None = None
        """This layer's attention backend instead of the run's (``None``: the run's)."""
        self.kv_lora_rank = kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.softmax_scale = softmax_scale
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank:
            self.wq = None
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, eps=latent_norm_eps)
            self.wq_b = nn.Linear(q_lora_rank, num_heads * qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(dim, num_heads * qk_head_dim, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, eps=latent_norm_eps)
        self.wkv_b = nn.Linear(
            kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False
        )
        self.wo = nn.Linear(num_heads * v_head_dim, dim, bias=False)

    def forward(
        self,
        x_BSD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kv_cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        """``meta``: the batch's masks and positions (``build_attention_metadata``)."""
        B, S, _ = x_BSD.shape
        if self.wq is not None:
            q_BSG = self.wq(x_BSD)
        else:  # low-rank queries
            assert self.wq_a is not None and self.q_norm is not None and self.wq_b is not None
            q_BSG = self.wq_b(self.q_norm(self.wq_a(x_BSD)))
        q_BSHE = q_BSG.view(B, S, -1, self.nope_dim + self.rope_dim)
        q_nope_BSHN, q_rope_BSHR = q_BSHE.split([self.nope_dim, self.rope_dim], dim=-1)

        latent_BSC, k_rope_BSR = self.wkv_a(x_BSD).split([self.kv_lora_rank, self.rope_dim], -1)
        latent_BSC = self.kv_norm(latent_BSC)
        k_rope_BS1R = k_rope_BSR.unsqueeze(2)
        if self.rotary:
            q_rope_BSHR = apply_rotary(q_rope_BSHR, rope)
            k_rope_BS1R = apply_rotary(k_rope_BS1R, rope)
        if kv_cache is not None:
            # The cache holds the latent and the rope key only.
            latent_BL1C, k_rope_BL1R = cached_keys(
                kv_cache, meta, latent_BSC.unsqueeze(2), k_rope_BS1R
            )
            o_BSHV = self._absorbed(q_nope_BSHN, q_rope_BSHR, latent_BL1C, k_rope_BL1R, meta)
            return self.wo(o_BSHV.reshape(B, S, -1))

        kv_BSHF = self.wkv_b(latent_BSC).view(B, S, -1, self.nope_dim + self.v_dim)
        k_nope_BSHN, v_BSHV = kv_BSHF.split([self.nope_dim, self.v_dim], dim=-1)
        H = k_nope_BSHN.shape[2]
        k_BSHE = torch.cat([k_nope_BSHN, k_rope_BS1R.expand(B, S, H, self.rope_dim)], dim=-1)
        q_BSHE = torch.cat([q_nope_BSHN, q_rope_BSHR], dim=-1)
        o_BSHV = self._attend(q_BSHE, k_BSHE, v_BSHV, meta)
        return self.wo(o_BSHV.reshape(B, S, -1))

    def _attend(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        return attend(
            q, k, v, meta, window=self.window, scale=self.softmax_scale, backend=self.backend
        )

    def _absorbed(
        self,
        q_nope_BSHN: torch.Tensor,
        q_rope_BSHR: torch.Tensor,
        latent_BL1C: torch.Tensor,
        k_rope_BL1R: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Attention in latent space (DeepSeek-V2 §2.1.2's weight absorption): the key
        up-projection folds into the query, the value up-projection into the output, so the
        cached latents are attended to directly, one shared "head" for all query heads."""
        wkv_b_HFC = self.wkv_b.weight.view(-1, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk_HNC, w_uv_HVC = wkv_b_HFC.split([self.nope_dim, self.v_dim], dim=1)
        q_latent_BSHC = torch.einsum("bshn,hnc->bshc", q_nope_BSHN, w_uk_HNC)
        q_BSHX = torch.cat([q_latent_BSHC, q_rope_BSHR], dim=-1)
        k_BL1X = torch.cat([latent_BL1C, k_rope_BL1R], dim=-1)
        o_BSHC = self._attend(q_BSHX, k_BL1X, latent_BL1C, meta)
        return torch.einsum("bshc,hvc->bshv", o_BSHC, w_uv_HVC)

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        """Normal ``std`` for the projections into the heads/latents, ``out_std`` for ``wo``."""
        inits: dict[str, Init] = {
            f"{name}.weight": Normal(std)
            for name in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b")
            if getattr(self, name) is not None
        }
        inits["wo.weight"] = Normal(out_std)
        for name in ("q_norm", "kv_norm"):
            if getattr(self, name) is not None:
                inits |= prefixed(name, getattr(self, name).param_init())
        return inits
