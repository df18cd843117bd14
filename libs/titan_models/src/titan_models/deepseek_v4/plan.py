"""DeepSeek-V4 parallelism plan (pure data)."""

from __future__ import annotations

import dataclasses

from ..plan import ModelPlan, decoder_plan
from .config import HASH_MOE, DeepSeekV4Config
from .model import DeepSeekV4


def plan(config: DeepSeekV4Config) -> ModelPlan:
    """Attention tensor-parallel by heads: ``wq_b`` and the sinks colwise, the grouped
    ``wo_a`` colwise by head groups (its groups follow the local heads), ``wo_b`` rowwise;
    the query latent, the one K=V head, the compressors and the indexers replicated (every
    rank computes what its heads read; as MLA's latents, their gradients need a sum no TP
    style expresses yet). Every block's MoE expert-parallel. Pipeline stages pass the
    ``hc_mult`` streams (``hc_mult · dim`` per token) and, with hash-routed layers, the token
    ids."""
    c = config
    attention = "layers.*.attention"
    replicated = ["wq_a", "q_norm", "wkv", "kv_norm"]
    if any(t != "sliding_attention" for t in c.layer_types):
        replicated += [f"compressor.{n}" for n in ("wkv", "wgate", "norm")]
    if "compressed_sparse_attention" in c.layer_types:
        replicated += ["indexer.wq_b", "indexer.weights_proj"]
        replicated += [f"indexer.compressor.{n}" for n in ("wkv", "wgate", "norm")]
    layout = decoder_plan(
        DeepSeekV4,
        config,
        colwise=(f"{attention}.wq_b", f"{attention}.sinks", f"{attention}.wo_a"),
        rowwise=(f"{attention}.wo_b",),
        replicated=tuple(f"{attention}.{n}" for n in replicated),
        experts=("layers.*.feed_forward",),
        stage_width=c.hc_mult * c.dim,
        stage_inputs=("token_ids",) if HASH_MOE in c.mlp_layer_types else (),
    )
    return dataclasses.replace(layout, context_parallel=False)  # compressed attention
