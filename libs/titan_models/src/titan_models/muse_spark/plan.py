"""Muse Spark parallelism plan (pure data)."""

from __future__ import annotations

from ..plan import ModelPlan, decoder_plan
from .config import MuseSparkConfig
from .model import MuseSpark


def plan(config: MuseSparkConfig) -> ModelPlan:
    """Attention by heads: ``wq``, ``wk``, ``wv`` and the output gate ``w_gate`` column-wise,
    ``wo`` row-wise (the QK and output norms have no weights and act per head); the dense
    blocks' SwiGLU as Llama; every pooled MoE (router, pooling projections and norms, experts)
    expert-parallel and unsharded over TP; the residual gates and post-norms act on the
    replicated stream. Every axis is supported: FSDP, TP, PP (one unit per block), EP and CP
    (sliding windows and NoPE layers through the context-parallel backend)."""
    c = config
    dense = any(c.is_dense(i) for i in range(c.num_layers))
    attention = tuple(f"layers.*.attention.{n}" for n in ("wq", "wk", "wv", "w_gate"))
    return decoder_plan(
        MuseSpark,
        config,
        colwise=(
            *attention,
            *(("layers.*.feed_forward.w1", "layers.*.feed_forward.w3") if dense else ()),
        ),
        rowwise=("layers.*.attention.wo", *(("layers.*.feed_forward.w2",) if dense else ())),
        replicated=(),
        sequence_parallel=("layers.*.post_ffn_norm",),
        experts=tuple(f"layers.{i}.feed_forward" for i in range(c.num_layers) if not c.is_dense(i)),
    )
