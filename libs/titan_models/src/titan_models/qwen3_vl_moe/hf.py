"""Qwen3-VL-MoE ↔ ``Qwen3VLMoeForConditionalGeneration`` checkpoints.

As Qwen3-VL (``qwen3_vl.hf``) for the tower, the attention and the norms; each MoE layer's
router is ``mlp.gate.weight`` and its experts are two fused tensors:
``mlp.experts.gate_up_proj`` holds every expert's gate then up projection and
``mlp.experts.down_proj`` the down projections. The Hub's checkpoints store them as
``(E, D, 2I)`` and ``(E, I, D)``; ``transformers`` 5 saves its in-memory layout ``(E, 2I, D)`` /
``(E, D, I)``. Both load (told apart by shape, as transformers does); ``to_hf`` writes the
Hub's. Our stacked ``w_gate`` / ``w_up`` ``(E, I, D)`` and ``w_down`` ``(E, D, I)`` are views
into them. Routing: softmax over all experts, top-k, always renormalised.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from safetensors import safe_open

from ..hf_adapter import GQA_KEY_MAP, STACK_KEY_MAP, DenseHFAdapter, HFTensor
from ..qwen3_moe.hf import Qwen3MoeHFAdapter
from ..qwen3_vl.hf import VISION_KEY_MAP, VisionLanguageAdapterMixin, text_key_map
from .config import Qwen3VLMoeConfig

_EXPERTS = "model.language_model.layers.{}.mlp.experts."
_TRANSFORMERS_LAYOUT = "_titan_experts_in_transformers_layout"
"""Set by ``adapt_to_checkpoint`` when the checkpoint's experts are ``(E, 2I, D)``."""

MOE_VL_KEY_MAP: tuple[tuple[str, str], ...] = (
    ("layers.{}.feed_forward.router.gate.weight", "model.language_model.layers.{}.mlp.gate.weight"),
    ("layers.{}.feed_forward.router.expert_bias", ""),
    ("layers.{}.feed_forward.experts.w_gate", _EXPERTS + "gate_up_proj"),
    ("layers.{}.feed_forward.experts.w_up", _EXPERTS + "gate_up_proj"),
    ("layers.{}.feed_forward.experts.w_down", _EXPERTS + "down_proj"),
)


class Qwen3VLMoeHFAdapter(VisionLanguageAdapterMixin, Qwen3MoeHFAdapter[Qwen3VLMoeConfig]):
    """``model_type: qwen3_vl_moe`` (every text layer sparse)."""

    model_types = ("qwen3_vl_moe",)
    architecture = "Qwen3VLMoeForConditionalGeneration"
    config_cls = Qwen3VLMoeConfig
    text_model_type = "qwen3_vl_moe_text"
    vision_model_type = "qwen3_vl_moe_vision"
    default_max_position_embeddings = 128_000
    key_map = text_key_map(STACK_KEY_MAP + GQA_KEY_MAP) + MOE_VL_KEY_MAP + VISION_KEY_MAP

    def config_fields_from_hf(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        # The Qwen3-VL-MoE router always renormalises its top-k (no norm_topk_prob field).
        return {**super().config_fields_from_hf(hf), "norm_topk_prob": True}

    def windows_from_hf(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        return DenseHFAdapter.windows_from_hf(self, hf)

    def windows_to_hf(self, config: Qwen3VLMoeConfig) -> dict[str, Any]:
        return DenseHFAdapter.windows_to_hf(self, config)

    def config_to_hf(self, config: Qwen3VLMoeConfig) -> dict[str, Any]:
        hf = super().config_to_hf(config)
        hf["text_config"].pop("norm_topk_prob", None)  # not a field there: always on
        return hf

    def adapt_to_checkpoint(self, hf: Mapping[str, Any], keys: Any) -> dict[str, Any]:
        """As the base; and which layout the fused experts have (one tensor's shape read)."""
        hf = dict(hf)
        key = next((k for k in keys if k.endswith(".mlp.experts.gate_up_proj")), None)
        if key is not None and isinstance(keys, Mapping):
            with safe_open(keys[key], framework="pt") as f:
                shape = tuple(f.get_slice(key).get_shape())
            text = hf.get("text_config") or {}
            hidden = text.get("hidden_size")
            # transformers' rule: the in-memory shape (E, 2I, D) loads as is, anything else
            # is the Hub's transposed layout.
            hf[_TRANSFORMERS_LAYOUT] = shape[-1] == hidden and shape[-2] == 2 * text.get(
                "moe_intermediate_size", -1
            )
        return hf

    def hf_tensors(
        self, fqn: str, param: torch.Tensor, hf_config: Mapping[str, Any]
    ) -> list[HFTensor]:
        tensors = super().hf_tensors(fqn, param, hf_config)
        projection = fqn.rsplit(".", 1)[-1]
        if ".feed_forward.experts." not in fqn:
            return tensors
        memory = bool(hf_config.get(_TRANSFORMERS_LAYOUT))
        (ht,) = tensors
        E = param.shape[0]
        if projection == "w_down":  # ours (E, D, I)
            _, D, hidden = param.shape
            if memory:
                return [HFTensor(ht.key, param)]
            return [
                HFTensor(
                    ht.key,
                    param,
                    to_hf=lambda w: w.transpose(1, 2),
                    from_hf=lambda w: w.transpose(1, 2),
                )
            ]
        _, hidden, D = param.shape  # w_gate / w_up: (E, I, D)
        half = slice(0, hidden) if projection == "w_gate" else slice(hidden, 2 * hidden)
        if memory:  # (E, 2I, D)
            return [
                HFTensor(
                    ht.key,
                    param,
                    from_hf=lambda w: w[:, half],
                    shape=(E, 2 * hidden, D),
                    put=lambda full, w: full[:, half].copy_(w),
                )
            ]
        return [
            HFTensor(
                ht.key,
                param,
                from_hf=lambda w: w[:, :, half].transpose(1, 2),
                shape=(E, D, 2 * hidden),
                put=lambda full, w: full[:, :, half].copy_(w.transpose(1, 2)),
            )
        ]
