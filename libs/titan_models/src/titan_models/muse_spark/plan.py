"""Muse Spark parallelism plan (pure data)."""

from __future__ import annotations

import dataclasses

import torch

from ..plan import ModelPlan, PipelineUnit, decoder_plan
from .config import MuseSparkConfig
from .model import MuseSpark, media_towers


def plan(config: MuseSparkConfig) -> ModelPlan:
    """Attention by heads: ``wq``, ``wk``, ``wv`` and the output gate ``w_gate`` column-wise,
    ``wo`` row-wise (the QK and output norms have no weights and act per head); the dense
    blocks' SwiGLU as Llama; every pooled MoE (router, pooling projections and norms, experts)
    expert-parallel and unsharded over TP; the residual gates and post-norms act on the
    replicated stream. Every axis is supported: FSDP, TP, PP (one unit per block), EP and CP
    (sliding windows and NoPE layers through the context-parallel backend). The towers are
    replicated over TP and go with the embedding into the first pipeline unit (the first
    stage makes the media tokens); every vision block is a remat unit."""
    c = config
    dense = any(c.is_dense(i) for i in range(c.num_layers))
    attention = tuple(f"layers.*.attention.{n}" for n in ("wq", "wk", "wv", "w_gate"))
    base = decoder_plan(
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
    return _with_towers(base, config)


def _with_towers(base: ModelPlan, config: MuseSparkConfig) -> ModelPlan:
    with torch.device("meta"):
        towers = media_towers(config)
    if not towers:
        return base
    embed = base.pipeline_units[0]
    params = sum(p.numel() for tower in towers.values() for p in tower.parameters())
    first = PipelineUnit(
        name=embed.name, modules=(*embed.modules, *towers), num_params=embed.num_params + params
    )
    remat = ("visual.blocks.*",) if "visual" in towers else ()
    return dataclasses.replace(
        base,
        pipeline_units=(first, *base.pipeline_units[1:]),
        remat_units=(*base.remat_units, *remat),
    )
