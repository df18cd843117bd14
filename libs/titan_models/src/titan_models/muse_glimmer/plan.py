"""Muse Glimmer parallelism plan (pure data): a dense decoder's, plus the vision tower."""

from __future__ import annotations

import dataclasses

import torch

from ..plan import ModelPlan, PipelineUnit, decoder_plan
from .config import MuseGlimmerConfig
from .model import MuseGlimmer
from .vision import MuseGlimmerVisionTower


def plan(config: MuseGlimmerConfig) -> ModelPlan:
    """Megatron TP by heads (q / k / v / gate and the MLP's gate / up column-wise, ``wo`` and
    ``w2`` row-wise; the QK-norm has no weight, so nothing is replicated), the post-norms on
    the residual stream with the pre-norms; one pipeline unit per block, the tower with the
    embedding in the first (the first stage makes the image tokens); every block and every
    vision block a remat unit; context parallel on text (the app refuses images under CP).
    The tower is replicated over TP; there are no experts (EP is refused by
    ``with_capabilities``: no MoE layers)."""
    base = decoder_plan(
        MuseGlimmer,
        config,
        colwise=(
            "layers.*.attention.wq",
            "layers.*.attention.wk",
            "layers.*.attention.wv",
            "layers.*.attention.wg",
            "layers.*.feed_forward.w1",
            "layers.*.feed_forward.w3",
        ),
        rowwise=("layers.*.attention.wo", "layers.*.feed_forward.w2"),
        replicated=(),
        sequence_parallel=("layers.*.post_attention_norm", "layers.*.post_ffn_norm"),
    )
    first = ("tok_embeddings", "visual")
    embed = base.pipeline_units[0]
    with torch.device("meta"):
        tower = MuseGlimmerVisionTower(
            config.vision,
            out_dim=config.dim,
            projector_dim=config.projector_hidden_dim,
            norm_eps=config.norm_eps,
        )
    visual = sum(p.numel() for p in tower.parameters())
    units = (
        PipelineUnit(name=embed.name, modules=first, num_params=embed.num_params + visual),
        *base.pipeline_units[1:],
    )
    return dataclasses.replace(
        base, pipeline_units=units, remat_units=(*base.remat_units, "visual.blocks.*")
    )
