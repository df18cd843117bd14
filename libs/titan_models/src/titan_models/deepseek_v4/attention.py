"""DeepSeek-V4 attention: one shared K=V head over a sliding window, plus compressed entries
(CSA: the lightning indexer's top-k; HCA: all of them), a learned sink per query head, and a
grouped output projection.

- queries: ``x → wq_a → q_norm → wq_b``, each head RMS-normalised (no weight), RoPE on its
  last ``rope_dim`` channels (interleaved pairs);
- the one K=V head: ``x → wkv → kv_norm``, rotated likewise;
- ``compressed_sparse_attention`` over the window and the entries (keys are their values);
- the output's rotated channels are rotated back to the query's position (``-θ``): a value
  that carried its key's rotation then contributes by relative position only;
- ``wo_a`` (``GroupedLinear``: ``o_groups`` head groups to ``o_lora_rank`` each) then
  ``wo_b`` to the model width.

Sliding-only layers rotate with the plain RoPE (``ropes["main"]``), compressed layers with the
compressed one (``ropes["compress"]``, YaRN), which also rotates their entries.

Shapes: B batch, S queries, D model dim, H heads, E head dim, Q query latent, G groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..components import AttentionMetadata, AttentionSinks, RMSNorm, RotaryEmbedding
from ..components.compressed_attention import (
    EntryLayout,
    KVCompressor,
    LightningIndexer,
    compressed_sparse_attention,
    training_layout,
)
from ..components.compressed_kv_cache import CompressedLayerCache
from ..components.grouped_linear import GroupedLinear
from ..components.init import Constant, Init, Normal, prefixed
from ..components.rope import apply_rotary_tail
from .config import CSA, SLIDING, DeepSeekV4Config


class DeepSeekV4Attention(nn.Module):
    """One layer's attention (see the module docstring); ``kind`` from ``layer_types``."""

    def __init__(self, config: DeepSeekV4Config, index: int, compress_rotary: RotaryEmbedding):
        """``compress_rotary``: the compressed layers' RoPE (shared by every layer's entries)."""
        super().__init__()
        c = config
        H, E = c.num_heads, c.head_dim
        self.kind = c.layer_types[index]
        assert c.sliding_window is not None  # required by DeepSeekV4Config
        self.head_dim, self.window, self.norm_eps = E, c.sliding_window, c.norm_eps
        self.query_chunk = c.attention_query_chunk
        self.wq_a = nn.Linear(c.dim, c.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(c.q_lora_rank, eps=c.norm_eps)
        self.wq_b = nn.Linear(c.q_lora_rank, H * E, bias=False)
        self.wkv = nn.Linear(c.dim, E, bias=False)
        self.kv_norm = RMSNorm(E, eps=c.norm_eps)
        self.wo_a = GroupedLinear(H * E // c.o_groups, c.o_lora_rank, c.o_groups)
        self.wo_b = nn.Linear(c.o_groups * c.o_lora_rank, c.dim, bias=False)
        self.sinks = AttentionSinks(H)
        rate = c.layer_rate(index)
        self.compressor = (
            KVCompressor(
                c.dim,
                E,
                rate,
                overlap=self.kind == CSA,
                rotary=compress_rotary,
                norm_eps=c.norm_eps,
            )
            if rate is not None
            else None
        )
        self.indexer = (  # with a compressor only (the rate is set)
            LightningIndexer(
                c.dim,
                c.q_lora_rank,
                num_heads=c.index_heads,
                head_dim=c.index_head_dim,
                rate=rate if rate is not None else 0,  # CSA layers have a rate
                top_k=c.index_topk,
                rotary=compress_rotary,
                norm_eps=c.norm_eps,
            )
            if self.kind == CSA
            else None
        )

    def forward(
        self,
        x_BSD: torch.Tensor,
        ropes: dict[str, tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        cache: CompressedLayerCache | None = None,
    ) -> torch.Tensor:
        """``ropes``: the batch's ``main`` and ``compress`` tables at the query positions."""
        if meta.context_parallel is not None:
            raise ValueError(
                "DeepSeek-V4's compressed attention does not run under context parallelism "
                "yet (its compressed keys span the shards); set the model's context_parallel "
                "to None"
            )
        B, S, _ = x_BSD.shape
        rope = ropes["main" if self.kind == SLIDING else "compress"]
        q_latent_BSQ = self.q_norm(self.wq_a(x_BSD))
        q_BSHE = self.wq_b(q_latent_BSQ).view(B, S, -1, self.head_dim)
        q_BSHE = apply_rotary_tail(
            F.rms_norm(q_BSHE, (self.head_dim,), eps=self.norm_eps), rope, interleaved=True
        )
        kv_BS1E = apply_rotary_tail(
            self.kv_norm(self.wkv(x_BSD))[:, :, None], rope, interleaved=True
        )

        step = meta.cache
        k_BKLE = None
        if cache is not None:
            k_BKLE, _ = cache.local.update(kv_BS1E, kv_BS1E)
        if k_BKLE is not None and step is not None and step.reads_cache:
            kv_BLE, kv_index = k_BKLE[:, 0], meta.key_slots(self.window)
            q_index, starts = step.slots, None
        else:  # the queries' own tokens, in a band per query chunk
            kv_BLE, kv_index, starts = kv_BS1E[:, :, 0], None, meta.starts
            q_index = torch.arange(S, device=x_BSD.device).expand(B, S)

        sinks = self.sinks(q_BSHE)
        if self.compressor is None:  # a window only: no entry at all
            entries_BCE = kv_BLE.new_zeros(B, 0, self.head_dim)
            visible, selected = torch.zeros(B, S, 0, dtype=torch.bool, device=x_BSD.device), None
        else:
            layout, entries_BCE, index_keys = self._entries(x_BSD, meta, cache)
            if self.indexer is None:
                visible, selected = layout.visible, None
            else:
                assert index_keys is not None  # the indexer's entries
                visible = None
                selected = self.indexer.select(
                    x_BSD, q_latent_BSQ, rope, index_keys, layout.visible
                )
        o_BSHE = compressed_sparse_attention(
            q_BSHE,
            kv_BLE,
            window=self.window,
            q_index=q_index,
            kv_index=kv_index,
            starts=starts,
            entries_BCE=entries_BCE,
            visible_BSC=visible,
            selected_BSK=selected,
            sinks=sinks,
            scale=self.head_dim**-0.5,
            query_chunk=self.query_chunk,
        )
        o_BSHE = apply_rotary_tail(o_BSHE, (rope[0], -rope[1]), interleaved=True)
        o_BSGI = o_BSHE.reshape(B, S, self.wo_a.weight.shape[0] // self.wo_a.out_features, -1)
        return self.wo_b(self.wo_a(o_BSGI).flatten(2))

    def _entries(
        self,
        x_BSD: torch.Tensor,
        meta: AttentionMetadata,
        cache: CompressedLayerCache | None,
    ) -> tuple[EntryLayout, torch.Tensor, torch.Tensor | None]:
        """(layout, the layer's entries, the indexer's entries or None)."""
        compressor, indexer = self.compressor, self.indexer
        assert compressor is not None  # called for compressed layers
        if cache is None:
            layout = meta.prepared(
                ("compressed", compressor.rate), lambda: training_layout(meta, compressor.rate)
            )
            entries = compressor(x_BSD, layout)
            if indexer is None:
                return layout, entries, None
            with torch.no_grad():
                return layout, entries, indexer.compressor(x_BSD, layout)
        step, own = meta.cache, cache.compressor
        assert own is not None and step is not None  # a compressed layer's cache, a cache step
        layout = meta.prepared(("compressed-cache", compressor.rate), lambda: own.layout(step))
        entries = own.update(compressor, x_BSD, layout)
        if indexer is None:
            return layout, entries, None
        assert cache.indexer is not None  # and its indexer's
        return layout, entries, cache.indexer.update(indexer.compressor, x_BSD, layout)

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        """Projections into the heads and latents N(0, std²), the residual output ``wo_b``
        N(0, out_std²); sinks 0 (as transformers); norms 1; compressors and indexer as theirs."""
        inits: dict[str, Init] = {
            f"{n}.weight": Normal(std) for n in ("wq_a", "wq_b", "wkv", "wo_a")
        }
        inits["wo_b.weight"] = Normal(out_std)
        inits["sinks.weight"] = Constant(0.0)
        for name in ("q_norm", "kv_norm"):
            inits |= prefixed(name, getattr(self, name).param_init())
        if self.compressor is not None:
            inits |= prefixed("compressor", self.compressor.param_init(std=std))
        if self.indexer is not None:
            inits |= prefixed("indexer", self.indexer.param_init(std=std))
        return inits


__all__ = ["DeepSeekV4Attention"]
