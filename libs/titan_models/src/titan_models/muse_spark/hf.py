"""Muse Spark Open ↔ the public ``meta-models/Muse-Spark-Open-816B-A42B`` layout
(``model_type: muse_spark``; transformers' ``MuseSparkForConditionalGeneration`` reads it).

- Text under ``model.language_model.``: ``embed_tokens``, ``norm``, and per layer
  ``input_layernorm → attention_norm``, ``self_attn.{q,k,v,o}_proj → attention.w{q,k,v,o}``,
  ``self_attn.gate_proj → attention.w_gate``, ``post_attention_residual_gate.gate →
  attention_residual.gate``, ``pre_feedforward_layernorm → ffn_norm``,
  ``post_feedforward_layernorm → post_ffn_norm``, ``post_feedforward_residual_gate.gate →
  ffn_residual.gate`` (the QK, output and post-attention norms have no weights);
  ``lm_head.weight`` at the top.
- Dense layers ``mlp.{gate,up,down}_proj → feed_forward.w{1,3,2}``. Sparse layers
  ``mlp.gate.{weight, e_score_correction_bias} → feed_forward.router.{gate.weight,
  expert_bias}``, ``mlp.{pre_expert_proj, pre_expert_norm, post_expert_proj} →
  feed_forward.{pool, pool_norm, unpool}``, ``mlp.experts.post_expert_norm →
  feed_forward.expert_norm``, and the experts fused as transformers holds them:
  ``mlp.experts.gate_up_proj`` (E, 2I, P: each expert's gate rows then its up rows),
  ``mlp.experts.down_proj`` (E, P, I) ↔ our ``w_gate``/``w_up``/``w_down``.
- Vision tower, adapter and projection as Muse Glimmer's (``muse_glimmer.hf.VISION_KEY_MAP``:
  ``model.vision_tower.*``, ``model.vision_adapter.fc{1,2}``, ``model.vision_projection``).
- Audio tower ``model.audio_tower.``: ``layers.<i>.patch_embedder.{proj, norm}`` ↔
  ``audio.stages.<i>.patch_embed.{proj, norm}``; ``layers.<i>.conv_blocks.<j>.{conv, norm,
  mlp.fc1, mlp.fc2}`` ↔ ``audio.stages.<i>.blocks.<j>.{conv, norm, feed_forward.w1,
  feed_forward.w2}``; ``norm``, ``proj``, ``post_proj_norm`` ↔ ``audio.{norm, projection,
  out_norm}``. Nothing is permuted.
- Config: ``text_config``, ``vision_config`` (``model_type: muse_spark_vision``),
  ``audio_config``, ``out_hidden_size`` (the tower width × merge²), ``projector_hidden_size``,
  the media token ids. A config of ours without a tower (``vision`` / ``audio`` ``None``)
  skips that tower's tensors on load, and ``to_hf`` writes the public tower's config with
  no weights for it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, cast

import torch

from ..components import RopeConfig, TransformerConfig
from ..hf_adapter import (
    FUSED_EXPERTS,
    HFAdapter,
    HFTensor,
    check_supported,
    required,
    rope_from_hf,
    rope_to_hf,
)
from ..muse_glimmer.hf import VISION_KEY_MAP, vision_config_from_hf, vision_config_to_hf
from .config import MLP_LAYER_TYPES, MuseSparkAudioConfig, MuseSparkConfig

TEXT = "model.language_model."
_L = TEXT + "layers.{}."
_VISION_KEYS = r"model\.(vision_tower|vision_adapter|vision_projection)\..*"
_AUDIO_KEYS = r"model\.audio_tower\..*"
_A = "model.audio_tower."
LAYER_TYPES = ("full_attention", "sliding_attention")

KEY_MAP: tuple[tuple[str, str], ...] = (
    ("tok_embeddings.weight", TEXT + "embed_tokens.weight"),
    ("norm.weight", TEXT + "norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("layers.{}.attention_norm.weight", _L + "input_layernorm.weight"),
    *(
        (f"layers.{{}}.attention.{ours}.weight", f"{_L}self_attn.{hf}.weight")
        for ours, hf in (
            ("wq", "q_proj"),
            ("wk", "k_proj"),
            ("wv", "v_proj"),
            ("wo", "o_proj"),
            ("w_gate", "gate_proj"),
        )
    ),
    ("layers.{}.attention_residual.gate", _L + "post_attention_residual_gate.gate"),
    ("layers.{}.ffn_norm.weight", _L + "pre_feedforward_layernorm.weight"),
    ("layers.{}.post_ffn_norm.weight", _L + "post_feedforward_layernorm.weight"),
    ("layers.{}.ffn_residual.gate", _L + "post_feedforward_residual_gate.gate"),
    ("layers.{}.feed_forward.w1.weight", _L + "mlp.gate_proj.weight"),
    ("layers.{}.feed_forward.w3.weight", _L + "mlp.up_proj.weight"),
    ("layers.{}.feed_forward.w2.weight", _L + "mlp.down_proj.weight"),
    ("layers.{}.feed_forward.router.gate.weight", _L + "mlp.gate.weight"),
    ("layers.{}.feed_forward.router.expert_bias", _L + "mlp.gate.e_score_correction_bias"),
    ("layers.{}.feed_forward.pool.weight", _L + "mlp.pre_expert_proj.weight"),
    ("layers.{}.feed_forward.pool_norm.weight", _L + "mlp.pre_expert_norm.weight"),
    ("layers.{}.feed_forward.unpool.weight", _L + "mlp.post_expert_proj.weight"),
    ("layers.{}.feed_forward.expert_norm.weight", _L + "mlp.experts.post_expert_norm.weight"),
    # Per-expert templates; read and written fused (``FUSED_EXPERTS``), the public layout.
    ("layers.{}.feed_forward.experts.w_gate", _L + "mlp.experts.{e}.gate_proj.weight"),
    ("layers.{}.feed_forward.experts.w_up", _L + "mlp.experts.{e}.up_proj.weight"),
    ("layers.{}.feed_forward.experts.w_down", _L + "mlp.experts.{e}.down_proj.weight"),
)
"""Our names ↔ ``MuseSparkForConditionalGeneration``'s text names."""

AUDIO_KEY_MAP: tuple[tuple[str, str], ...] = (
    *(
        (f"audio.stages.{{}}.patch_embed.{p}", f"{_A}layers.{{}}.patch_embedder.{p}")
        for p in ("proj.weight", "proj.bias", "norm.weight")
    ),
    *(
        (f"audio.stages.{{}}.blocks.{{}}.{ours}", f"{_A}layers.{{}}.conv_blocks.{{}}.{hf}")
        for ours, hf in (
            ("conv.weight", "conv.weight"),
            ("conv.bias", "conv.bias"),
            ("norm.weight", "norm.weight"),
            ("feed_forward.w1.weight", "mlp.fc1.weight"),
            ("feed_forward.w1.bias", "mlp.fc1.bias"),
            ("feed_forward.w2.weight", "mlp.fc2.weight"),
            ("feed_forward.w2.bias", "mlp.fc2.bias"),
        )
    ),
    ("audio.norm.weight", _A + "norm.weight"),
    ("audio.projection.weight", _A + "proj.weight"),
    ("audio.projection.bias", _A + "proj.bias"),
    ("audio.out_norm.weight", _A + "post_proj_norm.weight"),
)
"""The audio tower ↔ ``model.audio_tower``."""

_TOKEN_FIELDS = ("image_token_id", "video_token_id", "audio_token_id")
_TOKENIZER_FIELDS = ("vision_start_token_id", "vision_end_token_id")
"""Ids of the tokenizer, not of transformers' config: written as extra fields, read if there."""


def _refuse(field: str, got: Any, expected: str) -> ValueError:
    return ValueError(f"HF config field {field}={got!r} is not supported (expected {expected})")


class MuseSparkHFAdapter(HFAdapter[MuseSparkConfig]):
    """``model_type: muse_spark`` (the text model of the multimodal checkpoint)."""

    model_types = ("muse_spark",)
    architecture = "MuseSparkForConditionalGeneration"
    key_map = KEY_MAP + VISION_KEY_MAP + AUDIO_KEY_MAP

    def is_ignored(self, key: str, config: TransformerConfig) -> bool:
        """``HFAdapter``'s, plus the tensors of a tower our config does not build."""
        c = cast(MuseSparkConfig, config)
        if c.vision is None and re.fullmatch(_VISION_KEYS, key):
            return True
        if c.audio is None and re.fullmatch(_AUDIO_KEYS, key):
            return True
        return super().is_ignored(key, config)

    def config_from_hf(self, hf: Mapping[str, Any]) -> MuseSparkConfig:
        """Our config of an HF ``config.json`` (its ``text_config``); ``ValueError`` naming
        any field we do not model."""
        text = required(hf, "text_config")
        if text.get("model_type", "muse_spark_text") != "muse_spark_text":
            raise ValueError(
                f"HF text_config field model_type={text['model_type']!r} is not supported "
                "(supported: 'muse_spark_text')"
            )
        check_supported(text, sliding_window=True)
        if text.get("tie_word_embeddings"):
            raise ValueError(
                "HF text_config field tie_word_embeddings=True is not supported (Muse Spark's "
                "lm_head is its own weight; supported: False)"
            )
        layers = required(text, "num_hidden_layers")
        heads = required(text, "num_attention_heads")
        hidden = required(text, "hidden_size")
        max_pos = text.get("max_position_embeddings") or 1_048_576
        rope = rope_from_hf(text, max_position_embeddings=max_pos)
        thetas = _layer_rope_theta(text, layers, rope)
        window, sliding = _windows(text, layers, thetas)
        return MuseSparkConfig(
            vocab_size=required(text, "vocab_size"),
            dim=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=text.get("num_key_value_heads") or heads,
            head_dim=text.get("head_dim") or hidden // heads,
            ffn_hidden_dim=required(text, "intermediate_size"),
            rope=rope,
            max_seq_len=max_pos,
            norm_eps=float(text.get("rms_norm_eps", 1e-5)),
            post_norm_eps=float(text.get("post_norm_eps", 1e-8)),
            init_std=float(text.get("initializer_range", 0.02)),
            sliding_window=window,
            sliding_window_layers=sliding,
            qk_scale_factor=float(text.get("qk_scale_factor", 5.4730064863875)),
            output_multiplier=float(text.get("output_multiplier", 0.1767766952966369)),
            logit_softcap=float(required(text, "final_logit_softcapping")),
            layer_rope_theta=thetas,
            mlp_layer_types=_mlp_layer_types(text, layers),
            residual_gate_temperature=float(text.get("residual_gate_temperature", 0.3)),
            num_experts=required(text, "num_local_experts"),
            num_experts_per_tok=required(text, "num_experts_per_tok"),
            moe_dim=required(text, "moe_hidden_size"),
            moe_hidden_dim=required(text, "moe_intermediate_size"),
            route_scale=float(text.get("routed_scaling_factor", 1.0)),
            **_towers_from_hf(hf, hidden),
        )

    def config_to_hf(self, config: MuseSparkConfig) -> dict[str, Any]:
        """The nested HF ``config.json``: our model as ``text_config``, the public towers'."""
        c = config
        odd = [i for i in range(c.num_layers) if c.rope_theta(i) not in (0.0, c.rope.theta)]
        if odd:
            raise ValueError(
                f"MuseSparkConfig.layer_rope_theta[{odd[0]}]={c.rope_theta(odd[0])!r} cannot be "
                f"written as an HF muse_spark checkpoint (supported: 0 or rope.theta="
                f"{c.rope.theta!r}: transformers 5.24 rotates every RoPE layer by rope_theta)"
            )
        rope = rope_to_hf(c.rope)
        params = {"rope_type": "default", **(rope["rope_scaling"] or {})}
        text = {
            "model_type": "muse_spark_text",
            "vocab_size": c.vocab_size,
            "hidden_size": c.dim,
            "intermediate_size": c.ffn_hidden_dim,
            "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "max_position_embeddings": c.max_seq_len,
            "initializer_range": c.init_std,
            "rms_norm_eps": c.norm_eps,
            "post_norm_eps": c.post_norm_eps,
            "rope_parameters": {**params, "rope_theta": c.rope.theta},
            "layer_rope_theta": [c.rope_theta(i) for i in range(c.num_layers)],
            "sliding_window": c.sliding_window,
            "layer_types": [
                "sliding_attention" if c.layer_window(i) is not None else "full_attention"
                for i in range(c.num_layers)
            ],
            "mlp_layer_types": [
                "dense" if c.is_dense(i) else "sparse" for i in range(c.num_layers)
            ],
            "final_logit_softcapping": c.logit_softcap,
            "qk_scale_factor": c.qk_scale_factor,
            "output_multiplier": c.output_multiplier,
            "residual_gate_temperature": c.residual_gate_temperature,
            "num_local_experts": c.num_experts,
            "num_experts_per_tok": c.num_experts_per_tok,
            "moe_hidden_size": c.moe_dim,
            "moe_intermediate_size": c.moe_hidden_dim,
            "routed_scaling_factor": c.route_scale,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            # transformers' defaults are the real vocabulary's ids: out of range of a small one.
            "pad_token_id": None,
            "bos_token_id": None,
            "eos_token_id": None,
        }
        return {
            "architectures": [self.architecture],
            "model_type": self.model_types[0],
            "text_config": text,
            **_towers_to_hf(c),
        }

    def hf_tensors(
        self, fqn: str, param: torch.Tensor, hf_config: Mapping[str, Any]
    ) -> list[HFTensor]:
        """Experts always in the fused public layout."""
        if ".experts.w_" in fqn:
            return super().hf_tensors(fqn, param, {**hf_config, FUSED_EXPERTS: True})
        return super().hf_tensors(fqn, param, hf_config)


def _towers_from_hf(hf: Mapping[str, Any], text_width: int) -> dict[str, Any]:
    """Our tower fields of the top level of an HF ``config.json``."""
    if hf.get("projector_hidden_act", "gelu") != "gelu":
        raise _refuse("projector_hidden_act", hf["projector_hidden_act"], "'gelu'")
    vision = vision_config_from_hf(required(hf, "vision_config"), "muse_spark_vision")
    merged = vision.dim * vision.spatial_merge_size**2
    if hf.get("out_hidden_size", 6144) != merged:
        raise _refuse(
            "out_hidden_size",
            hf.get("out_hidden_size", 6144),
            f"vision_config.hidden_size x merge_size² = {merged}",
        )
    fields = {name: hf[name] for name in _TOKEN_FIELDS if name in hf}
    fields |= {name: hf[name] for name in _TOKENIZER_FIELDS if hf.get(name) is not None}
    return fields | {
        "vision": vision,
        "projector_hidden_dim": hf.get("projector_hidden_size", 4096),
        "audio": _audio_from_hf(required(hf, "audio_config"), text_width),
    }


def _audio_from_hf(audio: Mapping[str, Any], text_width: int) -> MuseSparkAudioConfig:
    where = "audio_config."
    if audio.get("model_type", "muse_spark_audio") != "muse_spark_audio":
        raise _refuse(where + "model_type", audio["model_type"], "'muse_spark_audio'")
    if audio.get("out_hidden_size", 8192) != text_width:
        raise _refuse(
            where + "out_hidden_size",
            audio.get("out_hidden_size", 8192),
            f"text_config.hidden_size={text_width}",
        )
    defaults = MuseSparkAudioConfig()
    sizes = {
        name: tuple(audio.get(name, getattr(defaults, name)))
        for name in ("patch_sizes", "hidden_sizes", "depths")
    }
    stages = audio.get("num_hidden_layers", 4)
    for name, values in sizes.items():
        if len(values) != stages:
            raise _refuse(where + name, list(values), f"num_hidden_layers={stages} entries")
    return MuseSparkAudioConfig(
        **sizes,
        mlp_ratio=float(audio.get("mlp_ratio", 4.0)),
        conv_kernel_size=audio.get("conv_kernel_size", 7),
        activation=audio.get("hidden_act", "gelu"),
        norm_eps=float(audio.get("rms_norm_eps", 1e-6)),
    )


def _towers_to_hf(c: MuseSparkConfig) -> dict[str, Any]:
    """The top-level tower fields of our config; a tower we do not build is written as the
    public one (transformers' defaults), so transformers can build its model."""
    vision = {"model_type": "muse_spark_vision"}
    out: dict[str, Any] = {"projector_hidden_size": c.projector_hidden_dim}
    if c.vision is not None:
        vision = vision_config_to_hf(c.vision, "muse_spark_vision")
        out["out_hidden_size"] = c.vision.dim * c.vision.spatial_merge_size**2
    audio: dict[str, Any] = {"model_type": "muse_spark_audio", "out_hidden_size": c.dim}
    if c.audio is not None:
        a = c.audio
        audio |= {
            "patch_sizes": list(a.patch_sizes),
            "hidden_sizes": list(a.hidden_sizes),
            "depths": list(a.depths),
            "num_hidden_layers": len(a.depths),
            "mlp_ratio": a.mlp_ratio,
            "conv_kernel_size": a.conv_kernel_size,
            "hidden_act": a.activation,
            "rms_norm_eps": a.norm_eps,
        }
    tokens = {name: getattr(c, name) for name in (*_TOKEN_FIELDS, *_TOKENIZER_FIELDS)}
    return out | {
        "vision_config": vision,
        "audio_config": audio,
        "projector_hidden_act": "gelu",
        **tokens,
    }


def _layer_rope_theta(text: Mapping[str, Any], layers: int, rope: RopeConfig) -> tuple[float, ...]:
    """``layer_rope_theta`` (empty when it is the default pattern). transformers rotates
    every RoPE layer by the global ``rope_theta`` whatever the list says, so any other
    non-zero base would load into a model different from transformers': refused."""
    thetas = text.get("layer_rope_theta")
    if thetas is None:
        return ()
    if len(thetas) != layers:
        raise ValueError(
            f"HF text_config field layer_rope_theta has {len(thetas)} entries, "
            f"num_hidden_layers={layers}"
        )
    for i, t in enumerate(thetas):
        if t not in (0, rope.theta):
            raise ValueError(
                f"HF text_config field layer_rope_theta[{i}]={t!r} is not supported "
                f"(supported: 0 for NoPE or rope_theta={rope.theta!r}: transformers 5.24 "
                "rotates every RoPE layer by rope_theta)"
            )
    default = tuple(0.0 if (layers - 1 - i) % 4 == 0 else rope.theta for i in range(layers))
    found = tuple(float(t) for t in thetas)
    return () if found == default else found


def _windows(
    text: Mapping[str, Any], layers: int, thetas: tuple[float, ...]
) -> tuple[int | None, tuple[int, ...] | None]:
    """``(sliding_window, sliding_window_layers)``: ``None`` layers when the sliding layers
    are exactly the RoPE layers (our default)."""
    types = text.get("layer_types") or [
        "full_attention" if (layers - 1 - i) % 4 == 0 else "sliding_attention"
        for i in range(layers)
    ]
    if len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(
            f"HF text_config field layer_types={list(types)!r} is not supported (one of "
            f"{', '.join(map(repr, LAYER_TYPES))} for each of the num_hidden_layers={layers} "
            "layers)"
        )
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = text.get("sliding_window")
    if not sliding:
        return None, None
    if window is None:
        raise ValueError(
            "HF text_config field sliding_window is missing (layer_types has sliding layers)"
        )
    nope = [thetas[i] == 0 if thetas else (layers - 1 - i) % 4 == 0 for i in range(layers)]
    rope_layers = tuple(i for i in range(layers) if not nope[i])
    return window, None if sliding == rope_layers else sliding


def _mlp_layer_types(text: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    kinds = text.get("mlp_layer_types")
    if kinds is None:
        return ()
    if len(kinds) != layers or any(k not in MLP_LAYER_TYPES for k in kinds):
        raise ValueError(
            f"HF text_config field mlp_layer_types={list(kinds)!r} is not supported "
            f"('dense' or 'sparse' for each of the num_hidden_layers={layers} layers)"
        )
    return () if all(k == "sparse" for k in kinds) else tuple(kinds)


__all__ = ["AUDIO_KEY_MAP", "KEY_MAP", "MuseSparkHFAdapter"]
