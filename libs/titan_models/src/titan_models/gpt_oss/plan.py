"""gpt-oss parallelism plan (pure data)."""

from __future__ import annotations

from ..plan import ModelPlan, decoder_plan
from .config import GptOssConfig
from .model import GptOss


def plan(config: GptOssConfig) -> ModelPlan:
    """Attention tensor-parallel by heads (q/k/v colwise with their biases, the sinks colwise
    as the ``1 → H`` linear they are stored in, ``wo`` rowwise); every block's MoE an
    expert-parallel unit (biases travel with their experts)."""
    return decoder_plan(
        GptOss,
        config,
        colwise=(
            "layers.*.attention.wq",
            "layers.*.attention.wk",
            "layers.*.attention.wv",
            "layers.*.attention.sinks",
        ),
        rowwise=("layers.*.attention.wo",),
        replicated=(),
        experts=("layers.*.feed_forward",),
    )
