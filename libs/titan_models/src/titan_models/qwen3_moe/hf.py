"""Qwen3-MoE ↔ ``Qwen3MoeForCausalLM`` checkpoints.

Attention, norms, embedding and head map one to one (the Qwen3 names); the router gate is
``mlp.gate.weight``; each expert is stored on its own (``mlp.experts.<e>.{gate,up,down}_proj``)
and lands in row ``e`` of our stacked expert weights. HF has no selection bias for Qwen3-MoE:
ours stays zero.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar, cast

from ..hf_adapter import (
    GQA_KEY_MAP,
    MOE_KEY_MAP,
    STACK_KEY_MAP,
    DenseHFAdapter,
    qwen_windows_from_hf,
    qwen_windows_to_hf,
    required,
)
from .config import Qwen3MoeConfig

_NO_BIAS = "layers.{}.feed_forward.router.expert_bias"


_Q = TypeVar("_Q", bound=Qwen3MoeConfig)


class Qwen3MoeHFAdapter(DenseHFAdapter[_Q]):
    """``model_type: qwen3_moe`` with every layer sparse; dense ``mlp_only_layers`` are refused."""

    model_types = ("qwen3_moe",)
    architecture = "Qwen3MoeForCausalLM"
    config_cls = cast("type[_Q]", Qwen3MoeConfig)  # subclasses set their own
    default_max_position_embeddings = 32768
    key_map = (
        STACK_KEY_MAP
        + GQA_KEY_MAP
        + tuple((ours, "" if ours == _NO_BIAS else hf) for ours, hf in MOE_KEY_MAP)
    )

    def config_fields_from_hf(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        if hf.get("mlp_only_layers"):
            raise ValueError(
                f"HF config field mlp_only_layers={hf['mlp_only_layers']!r} is not supported "
                "(dense layers inside Qwen3-MoE are not modelled; supported: [])"
            )
        step = hf.get("decoder_sparse_step", 1)
        if step != 1:
            raise ValueError(
                f"HF config field decoder_sparse_step={step!r} is not supported (supported: 1)"
            )
        if hf.get("shared_expert_intermediate_size"):
            raise ValueError(
                "HF config field shared_expert_intermediate_size="
                f"{hf['shared_expert_intermediate_size']!r} is not supported (Qwen3-MoE has no "
                "shared expert; supported: 0 or absent)"
            )
        return {
            **super().config_fields_from_hf(hf),
            # Hub files spell it num_experts; transformers 5 writes num_local_experts.
            "num_experts": hf.get("num_experts") or required(hf, "num_local_experts"),
            "num_experts_per_tok": required(hf, "num_experts_per_tok"),
            "moe_hidden_dim": required(hf, "moe_intermediate_size"),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
        }

    def windows_from_hf(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        return qwen_windows_from_hf(hf)

    def windows_to_hf(self, config: _Q) -> dict[str, Any]:
        return qwen_windows_to_hf(config)

    def config_to_hf(self, config: _Q) -> dict[str, Any]:
        return {
            **super().config_to_hf(config),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "num_experts": config.num_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
            "moe_intermediate_size": config.moe_hidden_dim,
            "norm_topk_prob": config.norm_topk_prob,
            "router_aux_loss_coef": config.aux_loss_coef,
        }
