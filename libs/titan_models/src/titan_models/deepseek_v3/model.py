"""DeepSeek-V3 (DeepSeek-AI, 2024): MLA, dense-then-MoE blocks, multi-token prediction.

Single-device code: parallelism (experts included) is applied from outside, from ``plan.py``.
The trunk is ``components.Transformer`` (embedding → blocks → norm → head); a block is
``components.TransformerBlock`` with ``MultiHeadLatentAttention`` and either a SwiGLU
(``first_k_dense`` blocks) or ``dist_moe.MoE`` with shared experts and group-limited sigmoid
routing. ``forward(..., return_mtp=True)`` also runs the MTP modules (paper §2.2): module k
mixes the previous depth's hidden state with the embedding of token ``i + k`` and predicts
token ``i + 1 + k`` through the shared output head.

Shapes: B batch, S sequence, D model dim, V vocabulary.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dist_moe import RouterConfig

from ..components import (
    AttentionMetadata,
    FeedForward,
    KVCache,
    RMSNorm,
    Transformer,
    TransformerBlock,
    YarnRopeScaling,
)
from ..components.init import Init, Normal, prefixed
from ..components.mla import MultiHeadLatentAttention
from ..components.moe import MoEFeedForward
from ..components.rope import yarn_mscale
from .config import DeepSeekV3Config


def router_config(config: DeepSeekV3Config) -> RouterConfig:
    """dist_moe routing that reproduces HF ``DeepseekV3TopkRouter`` (``noaux_tc``)."""
    return RouterConfig(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        score_func="sigmoid",
        num_groups=config.num_expert_groups,
        topk_groups=config.topk_groups,
        group_score="top2_sum",
        norm_topk_prob=config.norm_topk_prob,
        route_scale=config.route_scale,
        bias_update_rate=config.bias_update_rate,
        seq_aux_loss_coef=config.aux_loss_coef,
    )


def softmax_scale(config: DeepSeekV3Config) -> float:
    """``1/√(qk head dim)``, times ``mscale²`` under YaRN with ``mscale_all_dim`` (as the
    reference: the rope tables carry ``mscale/mscale_all_dim``, the scores the rest)."""
    scale = config.head_dim**-0.5
    s = config.rope.scaling
    if isinstance(s, YarnRopeScaling) and s.mscale_all_dim:
        scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
    return scale


def _block(config: DeepSeekV3Config, index: int, cls: type[TransformerBlock]) -> TransformerBlock:
    c = config
    if index < c.first_k_dense:
        feed_forward: nn.Module = FeedForward(dim=c.dim, hidden_dim=c.ffn_hidden_dim)
    else:
        feed_forward = MoEFeedForward(
            dim=c.dim,
            hidden_dim=c.moe_hidden_dim,
            router=router_config(c),
            shared_hidden_dim=c.num_shared_experts * c.moe_hidden_dim,
        )
    attention = MultiHeadLatentAttention(
        dim=c.dim,
        num_heads=c.num_heads,
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        latent_norm_eps=c.latent_norm_eps,
        softmax_scale=softmax_scale(c),
        window=c.layer_window(index),
    )
    return cls(dim=c.dim, norm_eps=c.norm_eps, attention=attention, feed_forward=feed_forward)


class MTPModule(TransformerBlock):
    """One multi-token-prediction depth: ``block(eh_proj([enorm(emb); hnorm(h)]))``, and
    ``norm`` before the shared output head (HF's ``shared_head.norm``)."""

    def __init__(
        self, *, dim: int, norm_eps: float, attention: nn.Module, feed_forward: nn.Module
    ) -> None:
        super().__init__(dim=dim, norm_eps=norm_eps, attention=attention, feed_forward=feed_forward)
        self.enorm = RMSNorm(dim, eps=norm_eps)
        self.hnorm = RMSNorm(dim, eps=norm_eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.norm = RMSNorm(dim, eps=norm_eps)

    def forward(  # type: ignore[override]
        self,
        h_BSD: torch.Tensor,
        emb_BSD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The next depth's hidden state from the previous one and the shifted embeddings."""
        x_BSD = self.eh_proj(torch.cat([self.enorm(emb_BSD), self.hnorm(h_BSD)], dim=-1))
        return super().forward(x_BSD, rope, meta)

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        inits = super().param_init(std=std, out_std=out_std)
        for name in ("enorm", "hnorm", "norm"):
            inits |= prefixed(name, getattr(self, name).param_init())
        return inits | {"eh_proj.weight": Normal(std)}


class DeepSeekV3(Transformer):
    """DeepSeek-V3 causal LM; ``mtp`` holds the MTP modules (``None`` when there are none)."""

    def __init__(
        self, config: DeepSeekV3Config, *, extra_modules: dict[str, nn.Module] | None = None
    ) -> None:
        """``extra_modules``: modules of a family built on this decoder (Kimi K2.5's tower)."""
        blocks = [_block(config, i, TransformerBlock) for i in range(config.num_layers)]
        mtp = None
        if config.num_mtp_modules:
            # Built as block number num_layers (>= first_k_dense): an MLA + MoE block.
            mtp = nn.ModuleDict(
                {
                    str(k): _block(config, config.num_layers, MTPModule)
                    for k in range(config.num_mtp_modules)
                }
            )
        self.mtp: nn.ModuleDict | None
        super().__init__(config, blocks, extra_modules={"mtp": mtp, **(extra_modules or {})})

    def forward(  # pyrefly: ignore[bad-override]  # return_mtp=True adds the MTP logits
        self,
        tokens: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        input_lengths: torch.Tensor | None = None,
        return_mtp: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Logits ``(B, S, V)``; with ``return_mtp`` also one ``(B, S, V)`` per MTP module, the
        k-th (k = 1..num_mtp_modules) predicting at position i the token i + 1 + k (train
        them with ``titan_models.mtp_loss``). Other arguments: ``Transformer.forward``."""
        inputs = dict(
            positions=positions,
            document_ids=document_ids,
            kv_cache=kv_cache,
            input_lengths=input_lengths,
        )
        return self.logits_and_mtp(tokens, inputs, return_mtp=return_mtp)

    def logits_and_mtp(
        self, tokens: torch.Tensor, inputs: dict, *, return_mtp: bool
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``forward`` with the keyword arguments of ``run_blocks`` in ``inputs``."""
        if return_mtp and inputs.get("kv_cache") is not None:
            raise ValueError("return_mtp=True cannot be combined with kv_cache (training only)")
        if return_mtp and (
            self.tok_embeddings is None or self.output is None or tokens.is_floating_point()
        ):
            raise ValueError(
                "return_mtp=True needs token ids and a model holding tok_embeddings and output "
                "(MTP is not supported on a pipeline stage)"
            )
        h_BSD, (rope, meta) = self.run_blocks(tokens, **inputs)
        logits_BSV = self.head(h_BSD)
        if not return_mtp:
            return logits_BSV
        mtp_logits = []
        assert self.tok_embeddings is not None and self.output is not None  # the whole model
        for k, module in enumerate((self.mtp or {}).values(), start=1):
            module = cast(MTPModule, module)
            # Token i + k at position i; the k positions past the end get id 0 (their targets
            # fall past the row, so mtp_loss ignores them; causality keeps them from the rest).
            ahead_BS = F.pad(tokens[:, k:], (0, k))
            h_BSD = module(h_BSD, self.tok_embeddings(ahead_BS), rope, meta)
            mtp_logits.append(self.output(module.norm(h_BSD)))
        return logits_BSV, tuple(mtp_logits)

    def kv_cache_widths(self) -> tuple[int, int, int]:
        """A latent cache: per layer and token one ``kv_lora_rank`` latent and one
        ``qk_rope_head_dim`` rope key, not per-head keys and values."""
        config = cast(DeepSeekV3Config, self.config)
        return 1, config.kv_lora_rank, config.qk_rope_head_dim

    def _extra_param_inits(self, *, std: float, out_std: float) -> dict[str, Init]:
        inits: dict[str, Init] = {}
        for index, module in (self.mtp or {}).items():
            mtp_module = cast(MTPModule, module)
            inits |= prefixed(f"mtp.{index}", mtp_module.param_init(std=std, out_std=out_std))
        return inits


__all__ = ["DeepSeekV3", "MTPModule", "router_config", "softmax_scale"]
