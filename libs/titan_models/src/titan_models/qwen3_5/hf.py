"""Qwen3.5 ↔ Hugging Face checkpoints.

Two layouts load: what ``AutoModelForCausalLM`` saves (``model_type: qwen3_5_text``, weights
under ``model.``) and the published checkpoints (the vision-language ``qwen3_5`` type: the text
config under ``text_config``, its weights under ``model.language_model.``; the vision tower
``model.visual.*`` and the multi-token-prediction layer ``mtp.*`` are skipped). ``to_hf``
writes the first, which both ``AutoModelForCausalLM`` and ``Qwen3_5ForCausalLM`` read.

Attention layers map one to one (``self_attn.q_proj`` holds query and gate rows per head, as
our ``wq``). A Gated DeltaNet layer's ``linear_attn.in_proj_qkv`` and ``conv1d`` are fused
(q, k, v rows in turn): each is three row ranges, our ``wq``/``wk``/``wv`` and
``conv_q``/``conv_k``/``conv_v``; the rest is ``in_proj_z → wz``, ``in_proj_b → wb``,
``in_proj_a → wa``, ``dt_bias``, ``A_log``, ``norm``, ``out_proj → wo``. Zero-centred norm
weights are stored as they are (our ``RMSNorm`` with ``offset=1`` holds the same numbers).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any, TypeVar, cast

import torch

from ..components.linear_attention.layer_types import LAYER_TYPES, resolved_layer_types
from ..hf_adapter import (
    DENSE_KEY_MAP,
    DenseHFAdapter,
    HFTensor,
    check_supported,
    hf_rows,
    required,
    rope_to_hf,
)
from .config import Qwen3_5Config

TEXT_PREFIX = "_titan_text_prefix"
"""Key ``adapt_to_checkpoint`` sets in a composite checkpoint's (flattened) text config: the
prefix of the text weights, ``model.language_model.``."""

_MIXER = re.compile(r"layers\.(\d+)\.attention\.([A-Za-z_]+)(?:\.weight)?")
_LINEAR_NAMES = {
    "wz": "in_proj_z.weight",
    "wb": "in_proj_b.weight",
    "wa": "in_proj_a.weight",
    "dt_bias": "dt_bias",
    "A_log": "A_log",
    "norm": "norm.weight",
    "wo": "out_proj.weight",
}
_FUSED = {"wq": 0, "wk": 1, "wv": 2, "conv_q": 0, "conv_k": 1, "conv_v": 2}


_Q = TypeVar("_Q", bound=Qwen3_5Config)


class Qwen3_5HFAdapter(DenseHFAdapter[_Q]):
    """``model_type: qwen3_5_text`` (and the published vision-language ``qwen3_5``)."""

    model_types = ("qwen3_5_text", "qwen3_5")
    architecture = "Qwen3_5ForCausalLM"
    config_cls = cast("type[_Q]", Qwen3_5Config)  # subclasses set their own
    default_max_position_embeddings = 32768
    key_map = DENSE_KEY_MAP
    ignored_hf_keys = (*DenseHFAdapter.ignored_hf_keys, r"model\.visual\..*", r"mtp\..*")

    def adapt_to_checkpoint(self, hf: Mapping[str, Any], keys: Collection[str]) -> dict[str, Any]:
        """A composite (vision-language) config becomes its text config, marked with the
        prefix of the text weights; then as the base."""
        if hf.get("model_type") == self.model_types[1]:
            text = dict(hf.get("text_config") or {})
            if "tie_word_embeddings" in hf:
                text["tie_word_embeddings"] = hf["tie_word_embeddings"]
            text["model_type"] = self.model_types[0]
            text[TEXT_PREFIX] = "model.language_model."
            hf = text
        return super().adapt_to_checkpoint(hf, keys)

    def config_from_hf(self, hf: Mapping[str, Any]) -> _Q:
        """Our config; ``ValueError`` naming any field we do not model."""
        return self.config_cls(**self.config_fields_from_hf(hf))

    def config_fields_from_hf(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        params = dict(hf.get("rope_parameters") or {})
        factor = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
        for name in ("mrope_section", "mrope_interleaved"):  # text positions: plain RoPE
            params.pop(name, None)
        text = {**hf, "rope_parameters": params, "partial_rotary_factor": None}
        check_supported(text, layer_types=LAYER_TYPES)
        return {
            **super().config_fields_from_hf(text),
            "partial_rotary_factor": float(factor),
            "layer_types": hf_layer_types(hf),
            "linear_num_key_heads": required(hf, "linear_num_key_heads"),
            "linear_num_value_heads": required(hf, "linear_num_value_heads"),
            "linear_key_head_dim": required(hf, "linear_key_head_dim"),
            "linear_value_head_dim": required(hf, "linear_value_head_dim"),
            "linear_conv_kernel_dim": hf.get("linear_conv_kernel_dim", 4),
        }

    def config_to_hf(self, config: _Q) -> dict[str, Any]:
        out = super().config_to_hf(config)
        rope = rope_to_hf(config.rope)
        del out["rope_theta"], out["rope_scaling"]
        return {
            **out,
            "rope_parameters": {
                **(rope["rope_scaling"] or {"rope_type": "default"}),
                "rope_theta": rope["rope_theta"],
                "partial_rotary_factor": config.partial_rotary_factor,
            },
            "layer_types": list(resolved_layer_types(config)),
            "linear_num_key_heads": config.linear_num_key_heads,
            "linear_num_value_heads": config.linear_num_value_heads,
            "linear_key_head_dim": config.linear_key_head_dim,
            "linear_value_head_dim": config.linear_value_head_dim,
            "linear_conv_kernel_dim": config.linear_conv_kernel_dim,
        }

    def hf_tensors(
        self, fqn: str, param: torch.Tensor, hf_config: Mapping[str, Any]
    ) -> list[HFTensor]:
        mixer = _MIXER.fullmatch(fqn)
        if mixer and hf_layer_types(hf_config)[int(mixer[1])] == "linear_attention":
            tensors = [_linear_attention(int(mixer[1]), mixer[2], param, hf_config)]
        else:
            tensors = super().hf_tensors(fqn, param, hf_config)
        prefix = hf_config.get(TEXT_PREFIX)
        if not prefix:
            return tensors
        return [
            HFTensor(
                prefix + ht.key.removeprefix("model."),
                ht.ours,
                ht.to_hf,
                ht.from_hf,
                ht.shape,
                ht.put,
            )
            if ht.key.startswith("model.")
            else ht
            for ht in tensors
        ]


def hf_layer_types(hf: Mapping[str, Any]) -> tuple[str, ...]:
    """HF ``layer_types``, or its default (attention every ``full_attention_interval``)."""
    layers = required(hf, "num_hidden_layers")
    types = hf.get("layer_types")
    if types is None:
        n = hf.get("full_attention_interval", 4)
        types = [
            "full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(layers)
        ]
    if len(types) != layers:
        raise ValueError(
            f"HF config field layer_types has {len(types)} entries, num_hidden_layers={layers}"
        )
    return tuple(types)


def _linear_attention(
    layer: int, name: str, param: torch.Tensor, hf: Mapping[str, Any]
) -> HFTensor:
    base = f"model.layers.{layer}.linear_attn."
    if name in _LINEAR_NAMES:
        return HFTensor(base + _LINEAR_NAMES[name], param)
    if name not in _FUSED:
        raise ValueError(f"Qwen3_5HFAdapter has no HF name for Gated DeltaNet parameter {name!r}")
    qk = hf["linear_num_key_heads"] * hf["linear_key_head_dim"]
    vv = hf["linear_num_value_heads"] * hf["linear_value_head_dim"]
    start = (0, qk, 2 * qk)[_FUSED[name]]
    fused = "in_proj_qkv.weight" if name.startswith("w") else "conv1d.weight"
    return hf_rows(base + fused, param, 2 * qk + vv, start)
