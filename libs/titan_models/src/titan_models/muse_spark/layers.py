"""Muse Spark's block pieces: gated attention with scaleless QK-norm, the residual gate, and
the MoE that pools the residual stream down before its experts.

Shapes: B batch, S queries, L keys, D model dim, P pooled (MoE) dim, H query heads, K kv
heads, E head dim, T = B·S tokens, R rows of the expert buffer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dist_moe import RouterConfig, TopKRouter

from ..components import (
    AttentionMetadata,
    Init,
    InputScaledRMSNorm,
    LayerKVCache,
    MoEFeedForward,
    Normal,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    attend,
    cached_keys,
    unit_rms,
)
from ..components.init import prefixed


class GatedAttention(nn.Module):
    """Causal GQA: ``wq``/``wk``/``wv`` → scaleless QK-norm (queries × ``qk_scale``) → RoPE
    (unless NoPE) → attention → scaleless per-head output norm → × ``sigmoid(w_gate x)`` →
    ``wo``. Head counts are read off the projections (tensor-parallel by heads as is)."""

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        norm_eps: float,
        qk_scale: float,
        window: int | None,
        rotary: bool,
        own_rope: RotaryEmbedding | None = None,
    ) -> None:
        """``rotary``: rotate q and k (False: a NoPE layer); ``own_rope``: this layer's own
        tables when its base differs from the model's (``None``: the model's)."""
        super().__init__()
        self.head_dim, self.norm_eps, self.qk_scale = head_dim, norm_eps, qk_scale
        self.window, self.rotary, self.own_rope = window, rotary, own_rope
        self.wq = nn.Linear(dim, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.w_gate = nn.Linear(dim, num_heads * head_dim, bias=False)
        self.wo = nn.Linear(num_heads * head_dim, dim, bias=False)

    def forward(
        self,
        x_BSD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kv_cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        E, eps = self.head_dim, self.norm_eps
        q_BSHE = unit_rms(self.wq(x_BSD).view(B, S, -1, E), eps=eps) * self.qk_scale
        k_BSKE = unit_rms(self.wk(x_BSD).view(B, S, -1, E), eps=eps)
        v_BSKE = self.wv(x_BSD).view(B, S, -1, E)
        if self.rotary:
            if self.own_rope is not None:
                rope = self.own_rope(meta.positions, q_BSHE.dtype)
            q_BSHE, k_BSKE = apply_rotary(q_BSHE, rope), apply_rotary(k_BSKE, rope)
        k_BLKE, v_BLKE = cached_keys(kv_cache, meta, k_BSKE, v_BSKE)
        o_BSHE = attend(q_BSHE, k_BLKE, v_BLKE, meta, window=self.window, scale=E**-0.5)
        o_BSX = unit_rms(o_BSHE, eps=eps).reshape(B, S, -1)
        return self.wo(o_BSX * torch.sigmoid(self.w_gate(x_BSD)))

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        """Normal ``std`` for q, k, v and the gate, ``out_std`` for the residual output ``wo``."""
        inits: dict[str, Init] = {f"{n}.weight": Normal(std) for n in ("wq", "wk", "wv", "w_gate")}
        return inits | {"wo.weight": Normal(out_std)}


class ResidualGate(nn.Module):
    """``α ⊙ residual + β ⊙ update`` with ``β = sigmoid(g / T)`` and ``α = √max(sigmoid(−g / T)
    · (1 + β), 10⁻³)`` per channel: a learned mix that keeps the stream's scale (α² + β² ≈ 1
    near g = 0). ``g`` stays fp32 (a cast model keeps it so)."""

    def __init__(self, dim: int, *, temperature: float) -> None:
        super().__init__()
        self.temperature = temperature
        self.gate = nn.Parameter(torch.zeros(dim))

    def forward(self, residual: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        w = self.gate.float() / self.temperature
        beta = torch.sigmoid(w)
        alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + beta), min=1e-3))
        return (alpha * residual + beta * update).to(residual.dtype)

    def param_init(self, *, std: float, out_std: float = 0.0) -> dict[str, Init]:
        """N(0, std²), as the reference."""
        return {"gate": Normal(std)}


class _NormedExperts:
    """The routed experts with the shared post-expert norm on each expert's output, before
    the routing weights: what a dispatcher calls (``split_weights`` passes through for the
    chunked symmetric-memory dispatcher). The norm's weight is not an expert weight: it stays
    replicated under expert parallelism, its gradient data-parallel like the router's."""

    def __init__(self, experts: Any, norm: InputScaledRMSNorm) -> None:
        self.experts, self.norm = experts, norm

    def split_weights(self, sizes: list[int]) -> Any:
        return self.experts.split_weights(sizes)

    def __call__(
        self, x_RP: torch.Tensor, group_ends: torch.Tensor, weights: Any = None
    ) -> torch.Tensor:
        y_RP = self.experts(x_RP, group_ends, weights)
        # Rows past the last group are slack whose values grouped GEMM leaves undefined: zero
        # them so no NaN reaches the norm's weight gradient (0 · NaN is NaN).
        rows = torch.arange(y_RP.shape[0], device=y_RP.device)
        valid = (rows < group_ends[-1])[:, None] if group_ends.numel() else rows[:, None] < 0
        return self.norm(torch.where(valid, y_RP, torch.zeros((), dtype=y_RP.dtype)))


class PooledMoE(MoEFeedForward):
    """Route on the full-width stream (logits × ``router_scale``), pool it to ``P`` (``pool`` →
    zero-centred RMSNorm), run the routed SwiGLU experts at width ``P``, each expert's output
    through the shared input-scaled ``expert_norm``, combine with the routing weights, and
    project back up (``unpool``). A ``dist_moe.MoE``: ``expert_parallel`` splits its experts.
    Balanced by the router's aux-loss-free bias and, with ``seq_aux_loss_coef``, dist_moe's
    sequence balance loss (attached to the output as ``dist_moe.MoE`` does)."""

    def __init__(
        self,
        *,
        dim: int,
        pooled_dim: int,
        hidden_dim: int,
        router: RouterConfig,
        router_scale: float,
        norm_eps: float,
        post_norm_eps: float,
    ) -> None:
        super().__init__(dim=pooled_dim, hidden_dim=hidden_dim, router=router)
        self.router = TopKRouter(dim, router)  # routes the full-width stream
        self.router_scale = router_scale
        self.pool = nn.Linear(dim, pooled_dim, bias=False)
        self.pool_norm = RMSNorm(pooled_dim, eps=norm_eps, offset=1.0)
        self.expert_norm = InputScaledRMSNorm(pooled_dim, eps=post_norm_eps)
        self.unpool = nn.Linear(pooled_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, *, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(B, S, D) → (B, S, D)."""
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        # m · (x Wᵀ) = (m · x) Wᵀ: the scale on the router's input is the reference's scale
        # of its logits, gradients included.
        route = self.router(x_TD * self.router_scale, seq_len=shape[1] if x.dim() == 3 else None)
        p_TP = self.pool_norm(self.pool(x_TD))
        out_TP = self.dispatcher.forward_experts(
            _NormedExperts(self.experts, self.expert_norm),
            p_TP,
            route.indices,
            route.weights,
            route.counts,
        )
        if route.aux_loss is not None:
            self.aux_loss = route.aux_loss.detach()
            out_TP = _CarryAuxLoss.apply(out_TP, route.aux_loss)
        return self.unpool(out_TP).reshape(shape)

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        """``MoEFeedForward``'s, plus N(0, std²) for ``pool``, N(0, out_std²) for ``unpool``
        (into the residual branch), both norms at scale one."""
        inits = super().param_init(std=std, out_std=out_std)
        inits |= {"pool.weight": Normal(std), "unpool.weight": Normal(out_std)}
        inits |= prefixed("pool_norm", self.pool_norm.param_init())
        return inits | prefixed("expert_norm", self.expert_norm.param_init())


class _CarryAuxLoss(torch.autograd.Function):
    """Forward: ``out`` unchanged; backward: ``aux`` gets gradient one, as if it had been added
    to the loss (the DeepSeek-V2 way of training a balance loss)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)
