"""Llama 3 ↔ ``LlamaForCausalLM`` checkpoints.

HF's Llama checkpoints already store q/k in the rotate-half layout our RoPE uses (the
conversion from Meta's format permuted them once), so every tensor maps one to one. Mistral
checkpoints are the same architecture with one sliding window on every layer: they load into
this family, and a config with a window is written as one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..hf_adapter import DenseHFAdapter, refuse_sliding_window
from .config import Llama3Config


class Llama3HFAdapter(DenseHFAdapter[Llama3Config]):
    """``model_type: llama`` (any Llama-architecture checkpoint without biases) and
    ``mistral`` (the same with ``sliding_window`` on every layer)."""

    model_types = ("llama", "mistral")
    architecture = "LlamaForCausalLM"
    config_cls = Llama3Config
    default_max_position_embeddings = 2048

    def windows_from_hf(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        if hf.get("model_type") != "mistral":
            refuse_sliding_window(hf)
            return {}
        if any(t != "full_attention" for t in hf.get("layer_types") or ()):
            raise ValueError(
                f"HF config field layer_types={hf['layer_types']!r} is not supported for "
                "mistral (its window applies to every layer; supported: absent)"
            )
        window = hf.get("sliding_window")
        return {} if window is None else {"sliding_window": window}

    def windows_to_hf(self, config: Llama3Config) -> dict[str, Any]:
        if config.sliding_window is None:
            return {}
        if config.sliding_window_layers is not None:
            raise ValueError(
                f"Llama3Config.sliding_window_layers={config.sliding_window_layers} cannot be "
                "written as an HF checkpoint (mistral slides on every layer; supported: None)"
            )
        return {"sliding_window": config.sliding_window}

    def config_to_hf(self, config: Llama3Config) -> dict[str, Any]:
        hf = {**super().config_to_hf(config), "mlp_bias": False, "pretraining_tp": 1}
        if config.sliding_window is not None:
            hf.update(model_type="mistral", architectures=["MistralForCausalLM"])
        return hf
