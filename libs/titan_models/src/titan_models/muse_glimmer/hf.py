"""Muse Glimmer ↔ the public ``meta-models/Muse-Glimmer-30B`` checkpoint layout (``model_type:
muse_glimmer``; transformers' ``MuseGlimmerForConditionalGeneration`` reads it; the public
layout is transformers' own names).

- Text ``model.language_model.``: ``embed_tokens``, ``layers.<i>.{input_layernorm,
  post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm}`` ↔
  ``layers.<i>.{attention_norm, post_attention_norm, ffn_norm, post_ffn_norm}`` (weights
  stored centred, ``scale - 1``, as ours); ``self_attn.{q,k,v,o,gate}_proj`` ↔
  ``attention.{wq,wk,wv,wo,wg}``; ``mlp.{gate,down,up}_proj`` ↔ ``feed_forward.{w1,w2,w3}``;
  ``norm``; ``lm_head`` ↔ ``output``. Nothing is permuted.
- Tower ``model.vision_tower.``: ``patch_embedder.{patch_embedding, position_embedding_table}``
  ↔ ``visual.{patch_embed.proj, pos_embed}``; ``ln_pre`` / ``ln_post`` ↔ ``pre_norm`` /
  ``post_norm``; ``layers.<i>.{norm1, norm2, attn.{q,k,v}_proj, attn.proj, mlp.fc1, mlp.fc2}``
  ↔ ``blocks.<i>.{attention_norm, ffn_norm, attention.{wq,wk,wv}, attention.wo,
  feed_forward.w1, feed_forward.w2}``; ``model.vision_adapter.{fc1, fc2}`` ↔
  ``visual.adapter.{w1, w2}``; ``model.vision_projection`` ↔ ``visual.projection``.
- Config: ``text_config`` (per-layer ``layer_types`` and ``layer_rope_theta``, 0 = NoPE),
  ``vision_config`` (``layer_types`` of ``full_attention`` / ``window_attention``),
  ``out_hidden_size`` (must be the tower width times ``merge_size²``),
  ``projector_hidden_size``, the media token ids; ``tie_word_embeddings`` at the top (the
  one transformers reads; ``text_config``'s is ignored there, so here too). The image start / end ids are the
  tokenizer's, not the config's: ``to_hf`` writes them as extra fields and ``from_hf``
  reads them when present.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..hf_adapter import HFAdapter, check_supported, required, rope_from_hf, rope_to_hf
from .config import (
    MuseGlimmerConfig,
    MuseGlimmerVisionConfig,
    every_fourth_from_last,
    vision_global_layers,
)

_T = "model.language_model."
_V = "model.vision_tower."

TEXT_KEY_MAP: tuple[tuple[str, str], ...] = (
    ("tok_embeddings.weight", f"{_T}embed_tokens.weight"),
    *(
        (f"layers.{{}}.{ours}.weight", f"{_T}layers.{{}}.{hf}.weight")
        for ours, hf in (
            ("attention_norm", "input_layernorm"),
            ("post_attention_norm", "post_attention_layernorm"),
            ("ffn_norm", "pre_feedforward_layernorm"),
            ("post_ffn_norm", "post_feedforward_layernorm"),
            ("attention.wq", "self_attn.q_proj"),
            ("attention.wk", "self_attn.k_proj"),
            ("attention.wv", "self_attn.v_proj"),
            ("attention.wo", "self_attn.o_proj"),
            ("attention.wg", "self_attn.gate_proj"),
            ("feed_forward.w1", "mlp.gate_proj"),
            ("feed_forward.w2", "mlp.down_proj"),
            ("feed_forward.w3", "mlp.up_proj"),
        )
    ),
    ("norm.weight", f"{_T}norm.weight"),
    ("output.weight", "lm_head.weight"),
)
"""The decoder ↔ ``model.language_model`` and ``lm_head``."""

VISION_KEY_MAP: tuple[tuple[str, str], ...] = (
    ("visual.patch_embed.proj.weight", f"{_V}patch_embedder.patch_embedding.weight"),
    ("visual.pos_embed", f"{_V}patch_embedder.position_embedding_table.weight"),
    *(
        (f"visual.{ours}.{p}", f"{_V}{hf}.{p}")
        for ours, hf in (("pre_norm", "ln_pre"), ("post_norm", "ln_post"))
        for p in ("weight", "bias")
    ),
    *(
        (f"visual.blocks.{{}}.{ours}.{p}", f"{_V}layers.{{}}.{hf}.{p}")
        for ours, hf in (
            ("attention_norm", "norm1"),
            ("ffn_norm", "norm2"),
            ("attention.wq", "attn.q_proj"),
            ("attention.wk", "attn.k_proj"),
            ("attention.wv", "attn.v_proj"),
            ("attention.wo", "attn.proj"),
            ("feed_forward.w1", "mlp.fc1"),
            ("feed_forward.w2", "mlp.fc2"),
        )
        for p in ("weight", "bias")
    ),
    ("visual.adapter.w1.weight", "model.vision_adapter.fc1.weight"),
    ("visual.adapter.w2.weight", "model.vision_adapter.fc2.weight"),
    ("visual.projection.weight", "model.vision_projection.weight"),
)
"""The tower, adapter and projection ↔ ``model.vision_tower`` / ``vision_adapter`` /
``vision_projection``."""

_TEXT_FIELDS = {  # HF text_config fields that change the architecture: the values we model
    "hidden_activation": ("silu",),
    "attention_bias": (False,),
    "model_type": ("muse_glimmer_text",),
}
_TOP_FIELDS = {"projector_hidden_act": ("gelu",), "model_type": ("muse_glimmer",)}
_TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def _refuse(field: str, got: Any, expected: str) -> ValueError:
    return ValueError(f"HF config field {field}={got!r} is not supported (expected {expected})")


def _check(hf: Mapping[str, Any], prefix: str, allowed: Mapping[str, tuple[Any, ...]]) -> None:
    for name, values in allowed.items():
        if name in hf and hf[name] not in values:
            raise _refuse(f"{prefix}{name}", hf[name], " or ".join(map(repr, values)))


def _text_layers(text: Mapping[str, Any], theta: float) -> dict[str, Any]:
    """``sliding_window(_layers)`` and ``nope_layers`` of an HF ``text_config``."""
    L = required(text, "num_hidden_layers")
    types = text.get("layer_types") or [
        "full_attention" if i in every_fourth_from_last(L) else "sliding_attention"
        for i in range(L)
    ]
    if len(types) != L or set(types) - {"full_attention", "sliding_attention"}:
        raise _refuse(
            "text_config.layer_types",
            types,
            f"{L} entries of 'full_attention' / 'sliding_attention'",
        )
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = text.get("sliding_window")
    if sliding and window is None:
        raise _refuse("text_config.sliding_window", None, "a window for the sliding layers")
    thetas = text.get("layer_rope_theta")
    if thetas is None:
        thetas = [0 if i in every_fourth_from_last(L) else theta for i in range(L)]
    if len(thetas) != L:
        raise _refuse("text_config.layer_rope_theta", thetas, f"{L} entries")
    for i, value in enumerate(thetas):
        if value and float(value) != theta:  # transformers rotates every RoPE layer by theta
            raise _refuse(
                f"text_config.layer_rope_theta[{i}]", value, f"0 (NoPE) or rope_theta={theta}"
            )
    fields: dict[str, Any] = {"nope_layers": tuple(i for i, v in enumerate(thetas) if not v)}
    if sliding:
        fields["sliding_window"] = window
        fields["sliding_window_layers"] = sliding
    return fields


def vision_config_from_hf(
    vision: Mapping[str, Any], model_type: str = "muse_glimmer_vision"
) -> MuseGlimmerVisionConfig:
    """Our tower config of an HF ``vision_config`` (``model_type``: the one it must name;
    Muse Spark's tower is the same architecture under ``muse_spark_vision``)."""
    _check(vision, "vision_config.", {"model_type": (model_type,)})
    height, width = vision.get("pos_emb_height", 32), vision.get("pos_emb_width", 32)
    if height != width:
        raise _refuse(
            "vision_config.pos_emb_width", width, f"pos_emb_height={height} (a square table)"
        )
    merge = vision.get("merge_size", 2)
    if isinstance(merge, (list, tuple)):
        if len(merge) != 2 or merge[0] != merge[1]:
            raise _refuse("vision_config.merge_size", merge, "an int or a square [m, m]")
        merge = merge[0]
    rope = dict(vision.get("rope_parameters") or {})
    if rope.get("rope_type", "axial") != "axial":
        raise _refuse("vision_config.rope_parameters.rope_type", rope["rope_type"], "'axial'")
    L = required(vision, "num_hidden_layers")
    types = vision.get("layer_types")
    if types is None:
        global_layers = vision_global_layers(L)
    elif len(types) != L or set(types) - {"full_attention", "window_attention"}:
        raise _refuse(
            "vision_config.layer_types",
            types,
            f"{L} entries of 'full_attention' / 'window_attention'",
        )
    else:
        global_layers = tuple(i for i, t in enumerate(types) if t == "full_attention")
    return MuseGlimmerVisionConfig(
        dim=required(vision, "hidden_size"),
        num_layers=L,
        num_heads=required(vision, "num_attention_heads"),
        ffn_hidden_dim=required(vision, "intermediate_size"),
        global_layers=global_layers,
        patch_size=vision.get("patch_size", 14),
        temporal_patch_size=vision.get("patch_temporal", 2),
        pos_emb_size=height,
        spatial_merge_size=merge,
        activation=vision.get("hidden_act", "gelu"),
        rope_theta=float(rope.get("rope_theta", 10_000.0)),
        norm_eps=float(vision.get("layer_norm_eps", 1e-5)),
    )


def vision_config_to_hf(
    v: MuseGlimmerVisionConfig, model_type: str = "muse_glimmer_vision"
) -> dict[str, Any]:
    """The HF ``vision_config`` of our tower config."""
    return {
        "model_type": model_type,
        "hidden_size": v.dim,
        "num_hidden_layers": v.num_layers,
        "num_attention_heads": v.num_heads,
        "intermediate_size": v.ffn_hidden_dim,
        "hidden_act": v.activation,
        "patch_size": v.patch_size,
        "patch_temporal": v.temporal_patch_size,
        "pos_emb_height": v.pos_emb_size,
        "pos_emb_width": v.pos_emb_size,
        "max_position_embeddings": v.pos_emb_size**2,
        "merge_size": v.spatial_merge_size,
        "layer_norm_eps": v.norm_eps,
        "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
        "layer_types": [
            "full_attention" if i in v.global_layers else "window_attention"
            for i in range(v.num_layers)
        ],
    }


class MuseGlimmerHFAdapter(HFAdapter[MuseGlimmerConfig]):
    """``model_type: muse_glimmer``: the decoder under ``model.language_model`` and the tower."""

    model_types = ("muse_glimmer",)
    architecture = "MuseGlimmerForConditionalGeneration"
    key_map = TEXT_KEY_MAP + VISION_KEY_MAP

    def config_from_hf(self, hf: Mapping[str, Any]) -> MuseGlimmerConfig:
        """Our config for an HF ``config.json``; ``ValueError`` naming any field we do not
        model (its path in the file, the value found and what is expected)."""
        _check(hf, "", _TOP_FIELDS)
        text = dict(required(hf, "text_config"))
        _check(text, "text_config.", _TEXT_FIELDS)
        for where, config in (("", hf), ("text_config.", text)):
            if config.get("quantization_config") is not None:
                raise _refuse(f"{where}quantization_config", config["quantization_config"], "None")
        check_supported(text, sliding_window=True)
        tower = vision_config_from_hf(required(hf, "vision_config"))
        merged = tower.dim * tower.spatial_merge_size**2
        if hf.get("out_hidden_size", 6144) != merged:
            raise _refuse(
                "out_hidden_size",
                hf.get("out_hidden_size", 6144),
                f"vision_config.hidden_size x merge_size² = {merged}",
            )
        heads, hidden = required(text, "num_attention_heads"), required(text, "hidden_size")
        max_pos = text.get("max_position_embeddings") or 131_072
        rope = rope_from_hf(text, max_position_embeddings=max_pos)
        if text.get("final_logit_softcapping") is None:
            raise _refuse("text_config.final_logit_softcapping", None, "a cap > 0")
        tokens = {name: hf[name] for name in _TOKEN_FIELDS if hf.get(name) is not None}
        return MuseGlimmerConfig(
            vocab_size=required(text, "vocab_size"),
            dim=hidden,
            num_layers=required(text, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=text.get("num_key_value_heads") or heads,
            head_dim=text.get("head_dim") or hidden // heads,
            ffn_hidden_dim=required(text, "intermediate_size"),
            rope=rope,
            max_seq_len=max_pos,
            norm_eps=float(text.get("rms_norm_eps", 1e-5)),
            # transformers ties the head at the top level only (text_config's flag is unread)
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=text.get("initializer_range", 0.02),
            **_text_layers(text, rope.theta),
            vision=tower,
            projector_hidden_dim=hf.get("projector_hidden_size", 4096),
            qk_scale_factor=float(text.get("qk_scale_factor", 3.87)),
            post_norm_eps=float(text.get("post_norm_eps", 1e-8)),
            output_multiplier=float(text.get("output_multiplier", 0.19611613513818404)),
            logit_softcap=float(text["final_logit_softcapping"]),
            **tokens,
        )

    def config_to_hf(self, config: MuseGlimmerConfig) -> dict[str, Any]:
        """The nested HF ``config.json`` (transformers 5 spelling)."""
        L = config.num_layers
        legacy = rope_to_hf(config.rope)
        text = {
            "model_type": "muse_glimmer_text",
            "vocab_size": config.vocab_size,
            "hidden_size": config.dim,
            "intermediate_size": config.ffn_hidden_dim,
            "num_hidden_layers": L,
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads,
            "head_dim": config.head_dim,
            "hidden_activation": "silu",
            "max_position_embeddings": config.max_seq_len,
            "rms_norm_eps": config.norm_eps,
            "initializer_range": config.init_std,
            "tie_word_embeddings": config.tie_embeddings,
            "rope_parameters": {
                "rope_theta": config.rope.theta,
                **(legacy["rope_scaling"] or {"rope_type": "default"}),
            },
            "attention_bias": False,
            "attention_dropout": 0.0,
            "sliding_window": config.sliding_window,
            "layer_types": [
                "full_attention" if config.layer_window(i) is None else "sliding_attention"
                for i in range(L)
            ],
            "layer_rope_theta": [
                0 if i in config.nope_layers else config.rope.theta for i in range(L)
            ],
            "final_logit_softcapping": config.logit_softcap,
            "qk_scale_factor": config.qk_scale_factor,
            "output_multiplier": config.output_multiplier,
            "post_norm_eps": config.post_norm_eps,
        }
        return {
            "architectures": [self.architecture],
            "model_type": self.model_types[0],
            "text_config": text,
            "vision_config": vision_config_to_hf(config.vision),
            "out_hidden_size": config.vision.dim * config.vision.spatial_merge_size**2,
            "projector_hidden_size": config.projector_hidden_dim,
            "projector_hidden_act": "gelu",
            **{name: getattr(config, name) for name in _TOKEN_FIELDS},
            "tie_word_embeddings": config.tie_embeddings,
        }
