"""Qwen3-VL parallelism plan (pure data): the Qwen3 decoder's, plus the vision tower."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..plan import ModelPlan, PipelineUnit, dense_decoder_plan
from .config import Qwen3VLConfig
from .model import Qwen3VL


def with_vision_tower(plan: ModelPlan, model_cls: type[nn.Module], config) -> ModelPlan:
    """``plan`` of the decoder extended to the tower of a Qwen3-VL config (dense or MoE) or
    any config whose ``vision`` tower is built of ``VisionBlock``s under ``visual.blocks``:

    - tensor parallel (``config.vision.tensor_parallel``): each block's ``wqkv`` (whole heads
      per rank: its rows are head-major) and MLP ``w1`` column-wise, ``wo`` and ``w2``
      row-wise; patch embedding, position grid, norms and mergers replicated. Otherwise the
      whole tower is replicated.
    - pipeline: the tower and the text layers that take DeepStack features go with the
      embedding into the first unit (the first stage computes the image tokens and adds them
      where they are needed; nothing image-shaped crosses a stage).
    - remat: every vision block is a unit too.
    """
    with torch.device("meta"):
        model = model_cls(config)
    deep = len(getattr(config.vision, "deepstack_layers", ()))
    first = ("tok_embeddings", "visual", *(f"layers.{i}" for i in range(deep)))
    params = {id(p): p.numel() for top in first for p in model.get_submodule(top).parameters()}
    units = (
        PipelineUnit(name="tok_embeddings", modules=first, num_params=sum(params.values())),
        *(u for u in plan.pipeline_units if u.name not in first),
    )
    tp = plan.tensor_parallel
    if config.vision.tensor_parallel:
        blocks = "visual.blocks.*."
        tp = dataclasses.replace(
            tp,
            colwise=(*tp.colwise, f"{blocks}attention.wqkv", f"{blocks}feed_forward.w1"),
            rowwise=(*tp.rowwise, f"{blocks}attention.wo", f"{blocks}feed_forward.w2"),
        )
    return dataclasses.replace(
        plan,
        tensor_parallel=tp,
        pipeline_units=units,
        remat_units=(*plan.remat_units, "visual.blocks.*"),
    )


def plan(config: Qwen3VLConfig) -> ModelPlan:
    """Qwen3's plan (TP by heads, QK-norms replicated) plus the tower (``with_vision_tower``)."""
    return with_vision_tower(dense_decoder_plan(Qwen3VL, config, qk_norm=True), Qwen3VL, config)
