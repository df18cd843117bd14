"""Qwen3 dense ↔ ``Qwen3ForCausalLM`` checkpoints (one-to-one names, rotate-half layout)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..hf_adapter import DenseHFAdapter, qwen_windows_from_hf, qwen_windows_to_hf
from .config import Qwen3Config


class Qwen3HFAdapter(DenseHFAdapter[Qwen3Config]):
    """``model_type: qwen3``, sliding-window layers included (``use_sliding_window``)."""

    model_types = ("qwen3",)
    architecture = "Qwen3ForCausalLM"
    config_cls = Qwen3Config
    default_max_position_embeddings = 32768

    def windows_from_hf(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        return qwen_windows_from_hf(hf)

    def windows_to_hf(self, config: Qwen3Config) -> dict[str, Any]:
        return qwen_windows_to_hf(config)
