"""Kimi K2.5 ↔ the public ``moonshotai/Kimi-K2.5`` checkpoint layout (``model_type:
kimi_k25``; transformers' ``Kimi_K25ForConditionalGeneration`` reads it).

- Text: DeepSeek-V3's names (``DeepSeekV3HFAdapter``) under ``language_model.``
  (``language_model.model.layers.<i>...``, ``language_model.lm_head.weight``); the HF config
  of the decoder is ``text_config`` (``model_type`` ``kimi_k2`` or ``deepseek_v3``).
- Tower ``vision_tower.``: ``patch_embed.proj`` is a Conv2d there, ``(D, C, P, P)``; ours the
  same weight as a ``(D, C·P·P)`` matrix. ``patch_embed.pos_emb.weight`` ``(H, W, D)`` as is.
  ``encoder.blocks.<i>.{norm0, norm1, wqkv, wo, mlp.fc0, mlp.fc1}`` ↔ ``visual.blocks.<i>.
  {attention_norm, ffn_norm, attention.wqkv, attention.wo, feed_forward.w1, w2}``;
  ``encoder.final_layernorm`` ↔ ``visual.final_norm``.
- ``wqkv`` there holds the q, k, v rows of all heads in turn, ``(3, H, E)``, and MoonViT's
  rotary embedding turns adjacent pairs of q / k rows (pair ``2i`` by the column, ``2i + 1``
  by the row, frequency ``i``). Ours holds each head's q, k, v together, ``(H, 3, E)`` (whole
  heads per tensor-parallel rank), and rotates halves, the first ``E/4`` frequencies by the
  row and the next by the column: rows are permuted on the way in and back on the way out
  (attention scores unchanged).
- Projector ``mm_projector.{pre_norm, proj.0, proj.2}`` ↔ ``visual.merger.{norm, w1, w2}``.
- Config: ``text_config``, ``vision_config`` (transformers' names, or the original
  ``vt_*`` / ``init_pos_emb_*`` / ``mm_hidden_size`` / ``projector_ln_eps`` /
  ``media_placeholder_token_id`` spelling; its projector and merge types checked),
  ``projection_layer_norm_eps``, the media token ids;
  ``tie_word_embeddings`` at the top (default ``True`` as transformers), else in
  ``text_config``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

import torch

from ..deepseek_v3.hf import DeepSeekV3HFAdapter
from ..hf_adapter import HFTensor, required
from .config import KimiK25Config, KimiK25VisionConfig

TEXT = "language_model."
_V = "vision_tower."

VISION_KEY_MAP: tuple[tuple[str, str], ...] = (
    ("visual.patch_embed.proj.weight", f"{_V}patch_embed.proj.weight"),
    ("visual.patch_embed.proj.bias", f"{_V}patch_embed.proj.bias"),
    ("visual.pos_embed.weight", f"{_V}patch_embed.pos_emb.weight"),
    *(
        (f"visual.blocks.{{}}.{ours}.{p}", f"{_V}encoder.blocks.{{}}.{hf}.{p}")
        for ours, hf in (
            ("attention_norm", "norm0"),
            ("ffn_norm", "norm1"),
            ("attention.wqkv", "wqkv"),
            ("attention.wo", "wo"),
            ("feed_forward.w1", "mlp.fc0"),
            ("feed_forward.w2", "mlp.fc1"),
        )
        for p in ("weight", "bias")
    ),
    *((f"visual.final_norm.{p}", f"{_V}encoder.final_layernorm.{p}") for p in ("weight", "bias")),
    *(
        (f"visual.merger.{ours}.{p}", f"mm_projector.{hf}.{p}")
        for ours, hf in (("norm", "pre_norm"), ("w1", "proj.0"), ("w2", "proj.2"))
        for p in ("weight", "bias")
    ),
)
"""``KimiK25VisionTower`` ↔ the public ``vision_tower`` and ``mm_projector``."""

_VISION_FIELDS = {  # ours: (transformers' name, the original checkpoint's name)
    "dim": ("hidden_size", "vt_hidden_size"),
    "num_layers": ("num_hidden_layers", "vt_num_hidden_layers"),
    "num_heads": ("num_attention_heads", "vt_num_attention_heads"),
    "ffn_hidden_dim": ("intermediate_size", "vt_intermediate_size"),
    "patch_size": ("patch_size", "patch_size"),
    "pos_emb_height": ("pos_emb_height", "init_pos_emb_height"),
    "pos_emb_width": ("pos_emb_width", "init_pos_emb_width"),
    "pos_emb_time": ("pos_emb_time", "init_pos_emb_time"),
}
_FIXED_VISION_FIELDS = {  # what MoonViT-400M + its projector are; anything else is refused
    "pos_emb_type": ("divided_fixed",),
    "pos_emb_interpolation_mode": ("bicubic",),
    "merge_type": ("sd2_tpool",),
    "mm_projector_type": ("patchmerger",),
    "projector_hidden_act": ("gelu",),
    "norm_type": ("layernorm",),
    "attn_bias": (True,),
    "linear_bias": (True,),
    "patch_embed_proj_bias": (True,),
}
_TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def qkv_rows(heads: int, head_dim: int) -> torch.Tensor:
    """Row order taking the public ``wqkv`` (``(3, H, E)``, interleaved rotary pairs) to ours
    (``(H, 3, E)``, rotate-half, row frequencies then column ones): ours[r] = theirs[order[r]]."""
    d, quarter = head_dim // 2, head_dim // 4
    m = torch.arange(d)
    pair = torch.where(m < quarter, 2 * m + 1, 2 * (m - quarter))  # the pair our frequency m is
    rotary = torch.cat([2 * pair, 2 * pair + 1])  # real parts, then imaginary parts
    plain = torch.arange(head_dim)
    part = torch.arange(3)[:, None, None] * heads * head_dim  # q, k, v blocks of theirs
    within = torch.stack([rotary, rotary, plain])[:, None, :]  # (3, 1, E): q, k rotate, v not
    theirs = part + torch.arange(heads)[None, :, None] * head_dim + within  # (3, H, E)
    return theirs.transpose(0, 1).flatten()  # ours is (H, 3, E)


def vision_config_from_hf(vision: Mapping[str, Any]) -> KimiK25VisionConfig:
    """Our tower config of an HF ``vision_config`` (either spelling)."""
    fields = {}
    for ours, names in _VISION_FIELDS.items():
        value = next((vision[n] for n in names if vision.get(n) is not None), None)
        if value is None:
            raise ValueError(f"HF vision_config field {names[0]} is missing")
        fields[ours] = value
    kernel = list(vision.get("merge_kernel_size") or (2, 2))
    if len(kernel) != 2 or kernel[0] != kernel[1]:
        raise ValueError(
            f"HF vision_config field merge_kernel_size={kernel} is not supported (a square "
            "kernel [m, m])"
        )
    rope = dict(vision.get("rope_parameters") or {})
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(
            f"HF vision_config field rope_parameters.rope_type={rope['rope_type']!r} is not "
            "supported (supported: 'axial')"
        )
    for name, allowed in _FIXED_VISION_FIELDS.items():  # the original config's spelling
        if name in vision and vision[name] not in allowed:
            raise ValueError(
                f"HF vision_config field {name}={vision[name]!r} is not supported (supported: "
                f"{', '.join(map(repr, allowed))})"
            )
    return KimiK25VisionConfig(
        **fields,
        spatial_merge_size=int(kernel[0]),
        activation=vision.get("hidden_act", vision.get("activation_func", "gelu_pytorch_tanh")),
        rope_theta=float(rope.get("rope_theta", 10_000.0)),
    )


def vision_config_to_hf(v: KimiK25VisionConfig) -> dict[str, Any]:
    """The HF ``vision_config`` (transformers' names) of our tower config."""
    return {
        "model_type": "kimi_k25_vision",
        "hidden_size": v.dim,
        "num_hidden_layers": v.num_layers,
        "num_attention_heads": v.num_heads,
        "intermediate_size": v.ffn_hidden_dim,
        "hidden_act": v.activation,
        "patch_size": v.patch_size,
        "pos_emb_height": v.pos_emb_height,
        "pos_emb_width": v.pos_emb_width,
        "pos_emb_time": v.pos_emb_time,
        "merge_kernel_size": [v.spatial_merge_size, v.spatial_merge_size],
        "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
    }


class KimiK25HFAdapter(DeepSeekV3HFAdapter):
    """``model_type: kimi_k25``: the DeepSeek-V3 adapter on ``text_config`` / ``language_model.``
    plus the tower."""

    model_types = ("kimi_k25",)
    architecture = "KimiK25ForConditionalGeneration"
    key_map = DeepSeekV3HFAdapter.key_map + VISION_KEY_MAP

    def config_from_hf(self, hf: Mapping[str, Any]) -> KimiK25Config:
        """Our config for an HF ``config.json``; ``ValueError`` naming any field we do not model."""
        text = dict(required(hf, "text_config"))
        vision = dict(required(hf, "vision_config"))
        if text.get("model_type", "deepseek_v3") not in ("deepseek_v3", "kimi_k2"):
            raise ValueError(
                f"HF text_config field model_type={text['model_type']!r} is not supported "
                "(supported: 'deepseek_v3', 'kimi_k2')"
            )
        if hf.get("tie_word_embeddings") is not None:
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
        text.setdefault("tie_word_embeddings", True)  # transformers' Kimi_K25Config default
        tower = vision_config_from_hf(vision)
        width = hf.get("projection_hidden_size") or vision.get("mm_hidden_size") or tower.dim
        if width != tower.dim:
            raise ValueError(
                f"HF config field projection_hidden_size={width!r} must equal vision_config "
                f"hidden_size={tower.dim} (the projector's norm runs on tower features)"
            )
        base = super().config_from_hf(text)
        fields = {name: getattr(base, name) for name in base.field_names()}
        tokens = {name: hf[name] for name in _TOKEN_FIELDS if hf.get(name) is not None}
        if "image_token_id" not in tokens and vision.get("media_placeholder_token_id") is not None:
            tokens["image_token_id"] = vision["media_placeholder_token_id"]
        return KimiK25Config(
            **fields,
            vision=tower,
            projection_norm_eps=float(
                hf.get("projection_layer_norm_eps", vision.get("projector_ln_eps", 1e-5))
            ),
            **tokens,
        )

    def config_to_hf(  # pyrefly: ignore[bad-override]  # the Kimi family's configs only
        self, config: KimiK25Config
    ) -> dict[str, Any]:
        """The nested HF ``config.json`` (the decoder as ``kimi_k2`` in ``text_config``)."""
        text = super().config_to_hf(config)
        text["model_type"] = "kimi_k2"
        text["architectures"] = ["DeepseekV3ForCausalLM"]
        return {
            "architectures": [self.architecture],
            "model_type": self.model_types[0],
            "text_config": text,
            "vision_config": vision_config_to_hf(config.vision),
            "projection_hidden_size": config.vision.dim,
            "projection_layer_norm_eps": config.projection_norm_eps,
            **{name: getattr(config, name) for name in _TOKEN_FIELDS},
            "tie_word_embeddings": config.tie_embeddings,
        }

    def adapt_to_checkpoint(self, hf: Mapping[str, Any], keys: Collection[str]) -> dict[str, Any]:
        """DeepSeek-V3's adaptation (MTP layers held, fused experts) on ``text_config``."""
        hf = dict(hf)
        text_keys = [k[len(TEXT) :] for k in keys if k.startswith(TEXT)]
        hf["text_config"] = super().adapt_to_checkpoint(required(hf, "text_config"), text_keys)
        return hf

    def is_ignored(  # pyrefly: ignore[bad-override]  # the Kimi family's configs only
        self, key: str, config: KimiK25Config
    ) -> bool:
        if config.tie_embeddings and key == f"{TEXT}lm_head.weight":
            return True
        return super().is_ignored(key, config)

    def hf_tensors(
        self, fqn: str, param: torch.Tensor, hf_config: Mapping[str, Any]
    ) -> list[HFTensor]:
        if not fqn.startswith("visual."):
            text = super().hf_tensors(fqn, param, hf_config["text_config"])
            return [dataclasses.replace(ht, key=TEXT + ht.key) for ht in text]
        tensors = super(DeepSeekV3HFAdapter, self).hf_tensors(fqn, param, hf_config)
        if fqn == "visual.patch_embed.proj.weight":
            vision = vision_config_from_hf(hf_config["vision_config"])
            c, p = vision.in_channels, vision.patch_size
            return [
                dataclasses.replace(
                    ht,
                    to_hf=lambda w: w.reshape(w.shape[0], c, p, p),
                    from_hf=lambda w: w.reshape(w.shape[0], -1),
                )
                for ht in tensors
            ]
        if ".attention.wqkv." in fqn:
            vision = vision_config_from_hf(hf_config["vision_config"])
            order = qkv_rows(vision.num_heads, vision.head_dim)
            inverse = torch.argsort(order)
            return [
                dataclasses.replace(
                    ht,
                    to_hf=lambda w: w[inverse.to(w.device)],
                    from_hf=lambda w: w[order.to(w.device)],
                )
                for ht in tensors
            ]
        return tensors
