"""DeepSeek-V4 (DeepSeek-AI, 2026): compressed sparse / heavily compressed attention,
manifold-constrained hyper-connections, hash-routed and learned MoE layers.

Single-device code: parallelism is applied from outside, from ``plan.py``. The token embedding
is copied into ``hc_mult`` residual streams ``(B, S, N, D)``; every block mixes them around its
attention and its MoE with a ``HyperConnection`` each; ``norm`` collapses the streams
(``HyperHead``) before the final RMSNorm and the head. Between pipeline stages the streams
travel flattened, ``(B, S, N·D)``.

Every block's FFN is a ``dist_moe.MoE`` with one shared expert and clamped SwiGLUs; the first
layers route by a fixed token-id table (hash routing), so the MoE needs the token ids: a
pipeline stage without the embedding gets them as ``token_ids``.

Not modelled: the multi-token-prediction module (transformers skips it too; its checkpoint
keys are ignored on load), the indexer's training loss (the indexer gets no gradient).

Shapes: B batch, S sequence, N streams, D model dim, V vocabulary.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from dist_moe import RouterConfig, SwiGLU

from ..components import AttentionMetadata, RMSNorm, RotaryEmbedding, Transformer
from ..components.attention import build_attention_metadata
from ..components.compressed_kv_cache import CompressedKVCache, CompressedLayerCache
from ..components.hyper_connections import HyperConnection, HyperHead
from ..components.init import Init, prefixed
from ..components.kv_cache import KVCache
from ..components.moe import MoEFeedForward
from ..components.transformer import check_input_lengths, check_shape
from .attention import DeepSeekV4Attention
from .config import HASH_MOE, DeepSeekV4Config


def router_config(config: DeepSeekV4Config, index: int) -> RouterConfig:
    """dist_moe routing of block ``index``: scores → top-k of scores + selection bias (learned
    layers) or the token's table row (hash layers) → renormalised → ``route_scale``."""
    c = config
    hashed = c.mlp_layer_types[index] == HASH_MOE
    return RouterConfig(
        num_experts=c.num_experts,
        top_k=c.num_experts_per_tok,
        score_func=cast(Any, c.score_func),  # one of SCORE_FUNCS (checked by the config)
        norm_topk_prob=True,
        route_scale=c.route_scale,
        bias_update_rate=0.0 if hashed else c.bias_update_rate,
        seq_aux_loss_coef=0.0 if hashed else c.aux_loss_coef,
        hash_vocab_size=c.vocab_size if hashed else 0,
        logits_dtype=None,  # HF computes the gate in the model dtype
    )


class DeepSeekV4Block(nn.Module):
    """``h ← post·attn(norm(pre·h)) + combᵀh``, then the same around the MoE (hyper-connected
    residual streams)."""

    def __init__(self, config: DeepSeekV4Config, index: int, compress_rotary: RotaryEmbedding):
        super().__init__()
        c = config
        hc = dict(sinkhorn_iters=c.hc_sinkhorn_iters, eps=c.hc_eps, norm_eps=c.norm_eps)
        self.attn_hc = HyperConnection(c.dim, c.hc_mult, **hc)
        self.attention_norm = RMSNorm(c.dim, eps=c.norm_eps)
        self.attention = DeepSeekV4Attention(c, index, compress_rotary)
        self.ffn_hc = HyperConnection(c.dim, c.hc_mult, **hc)
        self.ffn_norm = RMSNorm(c.dim, eps=c.norm_eps)
        self.feed_forward = MoEFeedForward(
            dim=c.dim,
            hidden_dim=c.moe_hidden_dim,
            router=router_config(c, index),
            shared_hidden_dim=c.num_shared_experts * c.moe_hidden_dim,
            activation=SwiGLU(limit=c.swiglu_limit),
        )

    def forward(
        self,
        h_BSND: torch.Tensor,
        ropes: dict[str, tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        cache: CompressedLayerCache | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        post, comb, x_BSD = self.attn_hc(h_BSND)
        out_BSD = self.attention(self.attention_norm(x_BSD), ropes, meta, cache)
        h_BSND = HyperConnection.merge(h_BSND, out_BSD, post, comb)
        post, comb, x_BSD = self.ffn_hc(h_BSND)
        out_BSD = self.feed_forward(self.ffn_norm(x_BSD), token_ids=token_ids)
        return HyperConnection.merge(h_BSND, out_BSD, post, comb)

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        inits: dict[str, Init] = {}
        for name in (
            "attn_hc",
            "attention_norm",
            "attention",
            "ffn_hc",
            "ffn_norm",
            "feed_forward",
        ):
            inits |= prefixed(name, getattr(self, name).param_init(std=std, out_std=out_std))
        return inits


class HyperHeadNorm(nn.Module):
    """The final norm of a hyper-connected stack: collapse the ``N`` streams (``hc``, a
    ``HyperHead``), then RMSNorm (``weight``). Takes the flattened streams ``(B, S, N·D)``."""

    def __init__(self, dim: int, num_streams: int, *, norm_eps: float, hc_eps: float) -> None:
        super().__init__()
        self.num_streams = num_streams
        self.hc = HyperHead(dim, num_streams, eps=hc_eps, norm_eps=norm_eps)
        self.norm = RMSNorm(dim, eps=norm_eps)

    def forward(self, h_BSX: torch.Tensor) -> torch.Tensor:
        B, S, _ = h_BSX.shape
        return self.norm(self.hc(h_BSX.view(B, S, self.num_streams, -1)))

    def param_init(self, *, std: float = 0.02, out_std: float = 0.0) -> dict[str, Init]:
        return prefixed("hc", self.hc.param_init(std=std)) | prefixed(
            "norm", self.norm.param_init()
        )


class DeepSeekV4(Transformer):
    """DeepSeek-V4 causal LM (see the module docstring)."""

    def __init__(self, config: DeepSeekV4Config) -> None:
        c = config
        compress_rotary = RotaryEmbedding(c.compress_rope, c.rope_dim, interleaved=True)
        blocks = [DeepSeekV4Block(c, i, compress_rotary) for i in range(c.num_layers)]
        head_norm = HyperHeadNorm(c.dim, c.hc_mult, norm_eps=c.norm_eps, hc_eps=c.hc_eps)
        super().__init__(config, blocks, extra_modules={"norm": head_norm})
        # V4 rotates adjacent channel pairs: both tables in the interleaved layout.
        self.rope = RotaryEmbedding(c.rope, c.rope_dim, interleaved=True)
        self.compress_rope = compress_rotary

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,  # a CompressedKVCache (new_kv_cache)
        input_lengths: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``(B, S, V)`` (``Transformer.forward``); ``token_ids``: ``(B, S)`` ids when
        ``tokens`` are a previous pipeline stage's streams ``(B, S, N·D)`` (hash routing)."""
        h, _ = self.run_blocks(
            tokens,
            positions=positions,
            document_ids=document_ids,
            kv_cache=kv_cache,
            input_lengths=input_lengths,
            token_ids=token_ids,
        )
        return self.head(h)

    def run_blocks(  # pyrefly: ignore[bad-override]  # returns main + compress rope tables
        self,
        tokens: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,  # a CompressedKVCache (new_kv_cache)
        input_lengths: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[dict, AttentionMetadata]]:
        """Embedding, stream expansion and blocks: the flattened streams ``(B, S, N·D)``."""
        c = cast(DeepSeekV4Config, self.config)
        B, S = tokens.shape[:2]
        check_shape("positions", positions, (B, S))
        if input_lengths is not None:
            check_input_lengths(input_lengths, B, S, kv_cache)
        if kv_cache is not None and not isinstance(kv_cache, CompressedKVCache):
            raise ValueError("DeepSeek-V4 decodes with its own cache: use model.new_kv_cache()")
        if kv_cache is not None and positions is not None:
            raise ValueError("DeepSeek-V4's cache places tokens by slot: positions must be None")
        if not tokens.is_floating_point():
            token_ids = tokens
        check_shape("token_ids", token_ids, (B, S))
        if token_ids is None and any(c.mlp_layer_types[int(i)] == HASH_MOE for i in self.layers):
            raise ValueError(
                "this stage has hash-routed MoE layers: pass token_ids (B, S) with its hidden "
                "states (they route by token id)"
            )
        meta = build_attention_metadata(
            B,
            S,
            tokens.device,
            positions=positions,
            document_ids=document_ids,
            kv_cache=kv_cache,
            input_lengths=input_lengths,
            backend=c.attention_backend,
            windows=(),  # the attention is its own operator: no backend structures
        )
        if self.tok_embeddings is not None and not tokens.is_floating_point():
            emb_BSD = self.tok_embeddings(tokens)
            h_BSND = emb_BSD[:, :, None].expand(B, S, c.hc_mult, c.dim).contiguous()
        else:
            h_BSND = tokens.view(B, S, c.hc_mult, c.dim)
        ropes = {
            "main": self.rope(meta.positions, h_BSND.dtype),
            "compress": self.compress_rope(meta.positions, h_BSND.dtype),
        }
        for index, layer in self.layers.items():
            cache = kv_cache.compressed[int(index)] if kv_cache is not None else None
            h_BSND = layer(h_BSND, ropes, meta, cache, token_ids)
        if kv_cache is not None:
            kv_cache.end(input_lengths)
        return h_BSND.flatten(2), (ropes, meta)

    def param_inits(self) -> dict[str, Init]:
        """``Transformer.param_inits`` with the stream collapse of ``norm`` drawn like the
        hyper-connections (N(0, std²) map, zero offset, unit gain)."""
        inits = Transformer.param_inits(self)
        if self.norm is not None:
            inits |= prefixed("norm", self.norm.param_init(std=self.config.init_std))
        return inits

    def new_kv_cache(
        self,
        batch_size: int,
        max_seq_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        static: bool = False,
    ) -> CompressedKVCache:
        """A ring of ``W - 1`` raw keys per layer, and per compressor a ring of raw projections
        and its entry buffer (``components.compressed_kv_cache``); no ``static`` mode."""
        if static:
            raise ValueError(
                "DeepSeekV4.new_kv_cache: static=True is not supported (the compressed cache "
                "grows its entries as it goes); use static=False"
            )
        weight = next(self.parameters())
        compressors = {
            int(i): (
                cast(Any, layer).attention.compressor,
                getattr(cast(Any, layer).attention.indexer, "compressor", None),
            )
            for i, layer in self.layers.items()
        }
        return CompressedKVCache(
            compressors=compressors,
            layers=[int(i) for i in self.layers],
            batch_size=batch_size,
            max_seq_len=max_seq_len,
            num_kv_heads=1,
            head_dim=self.config.head_dim,
            dtype=dtype or weight.dtype,
            device=device or weight.device,
            windows={int(i): self.config.sliding_window for i in self.layers},
        )

    def kv_cache_widths(self) -> tuple[int, int, int]:
        """One shared K=V head per layer (stored as key and value in the window ring)."""
        return 1, self.config.head_dim, self.config.head_dim


__all__ = ["DeepSeekV4", "DeepSeekV4Block", "HyperHeadNorm", "router_config"]
