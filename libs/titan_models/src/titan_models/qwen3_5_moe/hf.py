"""Qwen3.5-MoE ↔ Hugging Face checkpoints (``qwen3_5_moe_text``, and the published
vision-language ``qwen3_5_moe`` with its text weights under ``model.language_model.``).

Token mixers as ``qwen3_5.hf``; the MoE: router ``mlp.gate.weight``, per-expert
``mlp.experts.<e>.{gate,up,down}_proj`` on disk (fused ``gate_up_proj`` / ``down_proj`` load
too) ↔ row ``e`` of our stacked experts, ``mlp.shared_expert.*`` ↔ ``shared_experts.w_*`` and
``mlp.shared_expert_gate`` ↔ ``shared_experts.gate``. HF has no selection bias: ours stays 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..hf_adapter import GQA_KEY_MAP, MOE_KEY_MAP, STACK_KEY_MAP, required
from ..qwen3_5.hf import Qwen3_5HFAdapter
from .config import Qwen3_5MoeConfig

_NO_BIAS = "layers.{}.feed_forward.router.expert_bias"
_SHARED_GATE = (
    "layers.{}.feed_forward.shared_experts.gate.weight",
    "model.layers.{}.mlp.shared_expert_gate.weight",
)


class Qwen3_5MoeHFAdapter(Qwen3_5HFAdapter[Qwen3_5MoeConfig]):
    """``model_type: qwen3_5_moe_text`` (and the published ``qwen3_5_moe``)."""

    model_types = ("qwen3_5_moe_text", "qwen3_5_moe")
    architecture = "Qwen3_5MoeForCausalLM"
    config_cls = Qwen3_5MoeConfig
    key_map = (
        STACK_KEY_MAP
        + GQA_KEY_MAP
        + tuple(
            (ours, "" if ours == _NO_BIAS else hf.replace("shared_experts.", "shared_expert."))
            for ours, hf in MOE_KEY_MAP
        )
        + (_SHARED_GATE,)
    )

    def config_fields_from_hf(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        shared = required(hf, "shared_expert_intermediate_size")
        return {
            **super().config_fields_from_hf({**hf, "intermediate_size": shared}),
            "num_experts": hf.get("num_experts") or required(hf, "num_local_experts"),
            "num_experts_per_tok": required(hf, "num_experts_per_tok"),
            "moe_hidden_dim": required(hf, "moe_intermediate_size"),
            "aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
        }

    def config_to_hf(self, config: Qwen3_5MoeConfig) -> dict[str, Any]:
        out = super().config_to_hf(config)
        del out["intermediate_size"]
        return {
            **out,
            "num_experts": config.num_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
            "moe_intermediate_size": config.moe_hidden_dim,
            "shared_expert_intermediate_size": config.ffn_hidden_dim,
            "router_aux_loss_coef": config.aux_loss_coef,
        }
