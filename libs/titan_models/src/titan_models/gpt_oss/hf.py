"""gpt-oss ↔ ``GptOssForCausalLM`` checkpoints (transformers' layout, bf16/fp32 weights).

- Attention: ``self_attn.{q,k,v,o}_proj.{weight,bias}`` ↔ ``attention.w{q,k,v,o}``;
  ``self_attn.sinks`` (H,) ↔ ``attention.sinks.weight`` (H, 1).
- Router: ``mlp.router.{weight,bias}`` ↔ ``feed_forward.router.gate.{weight,bias}``.
- Experts, stored fused and transposed: ``mlp.experts.gate_up_proj`` (E, D, 2I) holds each
  expert's gate and up columns *interleaved* (gate = ``[..., 0::2]``, up = ``[..., 1::2]``),
  ``gate_up_proj_bias`` (E, 2I) likewise, ``down_proj`` (E, I, D), ``down_proj_bias`` (E, D)
  ↔ our ``w_gate`` / ``w_up`` (E, I, D), ``w_down`` (E, D, I), ``b_gate`` / ``b_up`` (E, I),
  ``b_down`` (E, D). Saving assembles the fused tensors from their parts.
- The published checkpoints quantise the experts to MXFP4 (``*_blocks`` / ``*_scales`` uint8
  tensors, ``quantization_config.quant_method = "mxfp4"``): refused with an error saying how
  to dequantise them with transformers first.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from ..hf_adapter import (
    GQA_KEY_MAP,
    STACK_KEY_MAP,
    DenseHFAdapter,
    HFTensor,
    check_supported,
    required,
)
from .config import GptOssConfig

_BIAS_KEY_MAP = tuple(
    (f"layers.{{}}.attention.{ours}.bias", f"model.layers.{{}}.self_attn.{hf}.bias")
    for ours, hf in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))
)
_ROUTER_KEY_MAP = (
    ("layers.{}.feed_forward.router.gate.weight", "model.layers.{}.mlp.router.weight"),
    ("layers.{}.feed_forward.router.gate.bias", "model.layers.{}.mlp.router.bias"),
    ("layers.{}.feed_forward.router.expert_bias", ""),  # no selection bias in gpt-oss
)
_EXPERTS = re.compile(
    r"layers\.(\d+)\.feed_forward\.experts\.(w_gate|w_up|w_down|b_gate|b_up|b_down)"
)
_SINKS = re.compile(r"layers\.(\d+)\.attention\.sinks\.weight")

MXFP4_HELP = (
    "gpt-oss checkpoints with MXFP4 experts are not loaded (training needs full-precision "
    "weights). Dequantise once with transformers and save: "
    "GptOssForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True), "
    "dtype=torch.bfloat16).save_pretrained(out)"
)


class GptOssHFAdapter(DenseHFAdapter[GptOssConfig]):
    """``model_type: gpt_oss`` with bf16/fp32 (dequantised) experts."""

    model_types = ("gpt_oss",)
    architecture = "GptOssForCausalLM"
    config_cls = GptOssConfig
    default_max_position_embeddings = 131_072
    default_rms_norm_eps = 1e-5
    key_map = STACK_KEY_MAP + GQA_KEY_MAP + _BIAS_KEY_MAP + _ROUTER_KEY_MAP

    def config_from_hf(self, hf: Mapping[str, Any]) -> GptOssConfig:
        quant = hf.get("quantization_config")
        if quant is not None:
            method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
            raise ValueError(
                f"HF config field quantization_config (quant_method={method!r}) is not "
                f"supported. {MXFP4_HELP}"
            )
        check_supported(hf, sliding_window=True, allowed={"attention_bias": (True,)})
        if hf.get("attention_bias") is False:
            raise ValueError(
                "HF config field attention_bias=False is not supported (gpt-oss attention has "
                "biases; supported: True)"
            )
        return self.config_cls(**self.config_fields_from_hf(hf), **self.windows_from_hf(hf))

    def config_fields_from_hf(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        fields = super().config_fields_from_hf(hf)
        return {
            **fields,
            "num_experts": hf.get("num_local_experts") or required(hf, "num_experts"),
            "num_experts_per_tok": required(hf, "num_experts_per_tok"),
            "moe_hidden_dim": fields["ffn_hidden_dim"],
            "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
            "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
            "aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
        }

    def windows_from_hf(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        num_layers = required(hf, "num_hidden_layers")
        types = hf.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        ]
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown or len(types) != num_layers:
            raise ValueError(
                f"HF config field layer_types={types!r} is not supported (one of "
                "'sliding_attention', 'full_attention' per layer)"
            )
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if not layers:
            return {}
        window = required(hf, "sliding_window")
        if len(layers) == num_layers:
            return {"sliding_window": window}
        return {"sliding_window": window, "sliding_window_layers": layers}

    def windows_to_hf(self, config: GptOssConfig) -> dict[str, Any]:
        L = config.num_layers
        return {
            "sliding_window": config.sliding_window,
            "layer_types": [
                "sliding_attention" if config.layer_window(i) is not None else "full_attention"
                for i in range(L)
            ],
        }

    def config_to_hf(self, config: GptOssConfig) -> dict[str, Any]:
        return {
            **super().config_to_hf(config),
            "attention_bias": True,
            "intermediate_size": config.moe_hidden_dim,
            "num_local_experts": config.num_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
            "swiglu_alpha": config.swiglu_alpha,
            "swiglu_limit": config.swiglu_limit,
            "router_aux_loss_coef": config.aux_loss_coef,
        }

    def hf_tensors(
        self, fqn: str, param: torch.Tensor, hf_config: Mapping[str, Any]
    ) -> list[HFTensor]:
        sinks = _SINKS.fullmatch(fqn)
        if sinks:
            key = f"model.layers.{sinks[1]}.self_attn.sinks"
            return [
                HFTensor(
                    key,
                    param,
                    to_hf=lambda w: w.reshape(-1),
                    from_hf=lambda t: t.reshape(-1, 1),
                )
            ]
        experts = _EXPERTS.fullmatch(fqn)
        if experts is None:
            return super().hf_tensors(fqn, param, hf_config)
        stem = f"model.layers.{experts[1]}.mlp.experts"
        name = experts[2]
        if name == "w_down":  # ours (E, D, I), HF (E, I, D)
            return [
                HFTensor(
                    f"{stem}.down_proj",
                    param,
                    to_hf=lambda w: w.transpose(1, 2),
                    from_hf=lambda t: t.transpose(1, 2),
                )
            ]
        if name == "b_down":
            return [HFTensor(f"{stem}.down_proj_bias", param)]
        half = 0 if name in ("w_gate", "b_gate") else 1  # gate columns even, up columns odd
        if name in ("w_gate", "w_up"):  # ours (E, I, D), HF (E, D, 2I)
            E, H, D = param.shape  # H: the expert hidden width
            return [
                HFTensor(
                    f"{stem}.gate_up_proj",
                    param,
                    from_hf=lambda t, h=half: t[:, :, h::2].transpose(1, 2),
                    shape=(E, D, 2 * H),
                    put=lambda full, w, h=half: full[:, :, h::2].copy_(w.transpose(1, 2)),
                )
            ]
        E, H = param.shape  # b_gate / b_up, HF (E, 2I)
        return [
            HFTensor(
                f"{stem}.gate_up_proj_bias",
                param,
                from_hf=lambda t, h=half: t[:, h::2],
                shape=(E, 2 * H),
                put=lambda full, b, h=half: full[:, h::2].copy_(b),
            )
        ]
