"""Qwen3 dense ↔ ``Qwen3ForCausalLM`` checkpoints (one-to-one names, rotate-half layout)."""

from __future__ import annotations

from typing import Any

from ..hf_adapter import DenseHFAdapter
from .config import Qwen3Config


class Qwen3HFAdapter(DenseHFAdapter):
    """``model_type: qwen3``; sliding-window attention is refused."""

    model_types = ("qwen3",)
    architecture = "Qwen3ForCausalLM"
    config_cls = Qwen3Config
    default_max_position_embeddings = 32768

    def config_to_hf(self, config: Qwen3Config) -> dict[str, Any]:
        return {
            **super().config_to_hf(config),
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": config.num_layers,
        }
