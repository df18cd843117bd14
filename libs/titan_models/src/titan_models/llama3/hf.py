"""Llama 3 ↔ ``LlamaForCausalLM`` checkpoints.

HF's Llama checkpoints already store q/k in the rotate-half layout our RoPE uses (the
conversion from Meta's format permuted them once), so every tensor maps one to one.
"""

from __future__ import annotations

from typing import Any

from ..hf_adapter import DenseHFAdapter
from .config import Llama3Config


class Llama3HFAdapter(DenseHFAdapter):
    """``model_type: llama`` (any Llama-architecture checkpoint without biases)."""

    model_types = ("llama",)
    architecture = "LlamaForCausalLM"
    config_cls = Llama3Config
    default_max_position_embeddings = 2048

    def config_to_hf(self, config: Llama3Config) -> dict[str, Any]:
        return {**super().config_to_hf(config), "mlp_bias": False, "pretraining_tp": 1}
