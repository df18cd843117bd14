"""Qwen3-VL ↔ ``Qwen3VLForConditionalGeneration`` checkpoints (and the tower for Qwen3-VL-MoE).

- Text: the Qwen3 names under ``model.language_model.`` (``lm_head`` stays at the top).
- Tower (``model.visual.``): ``patch_embed.proj`` is a Conv3d there, ``(D, C, T, P, P)``; ours
  is the same weight as a ``(D, C·T·P·P)`` matrix. ``attn.qkv`` holds the q, k, v rows of all
  heads in turn, ``(3, H, E)``; ours holds each head's together, ``(H, 3, E)`` (whole heads
  per tensor-parallel rank): rows are permuted on the way in and back on the way out.
  ``norm1/norm2/attn.proj/mlp.linear_fc1/2`` ↔ ``attention_norm/ffn_norm/attention.wo/
  feed_forward.w1/w2``; ``merger.linear_fc1/2`` ↔ ``merger.w1/w2``;
  ``deepstack_merger_list`` ↔ ``deepstack_mergers``.
- Config: ``text_config`` holds the decoder (M-RoPE sections in its ``rope_parameters`` /
  ``rope_scaling``), ``vision_config`` the tower, the special token ids and
  ``tie_word_embeddings`` sit at the top.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..hf_adapter import (
    DENSE_KEY_MAP,
    DenseHFAdapter,
    HFTensor,
    check_supported,
    required,
    rope_from_hf,
)
from .config import Qwen3VLConfig, Qwen3VLVisionConfig

TEXT_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."


def text_key_map(key_map: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """A decoder key map with HF's text keys moved under ``model.language_model.``."""
    return tuple(
        (ours, hf.replace("model.", TEXT_PREFIX, 1) if hf.startswith("model.") else hf)
        for ours, hf in key_map
    )


_V = VISION_PREFIX
VISION_KEY_MAP: tuple[tuple[str, str], ...] = (
    ("visual.patch_embed.proj.weight", f"{_V}patch_embed.proj.weight"),
    ("visual.patch_embed.proj.bias", f"{_V}patch_embed.proj.bias"),
    ("visual.pos_embed.weight", f"{_V}pos_embed.weight"),
    *(
        (f"visual.blocks.{{}}.{ours}.{p}", f"{_V}blocks.{{}}.{hf}.{p}")
        for ours, hf in (
            ("attention_norm", "norm1"),
            ("ffn_norm", "norm2"),
            ("attention.wqkv", "attn.qkv"),
            ("attention.wo", "attn.proj"),
            ("feed_forward.w1", "mlp.linear_fc1"),
            ("feed_forward.w2", "mlp.linear_fc2"),
        )
        for p in ("weight", "bias")
    ),
    *(
        (f"visual.{ours}.{sub}.{p}", f"{_V}{hf}.{hf_sub}.{p}")
        for ours, hf in (("merger", "merger"), ("deepstack_mergers.{}", "deepstack_merger_list.{}"))
        for sub, hf_sub in (("norm", "norm"), ("w1", "linear_fc1"), ("w2", "linear_fc2"))
        for p in ("weight", "bias")
    ),
)
"""``Qwen3VLVisionTower`` ↔ HF's ``model.visual``."""


def vision_tensors(
    fqn: str, tensors: list[HFTensor], hf_config: Mapping[str, Any]
) -> list[HFTensor]:
    """The tower's layout changes: the Conv3d patch weight and the head-major ``wqkv``."""
    vision = hf_config["vision_config"]
    if fqn == "visual.patch_embed.proj.weight":
        c, t, p = vision.get("in_channels", 3), vision["temporal_patch_size"], vision["patch_size"]
        return [
            HFTensor(
                ht.key,
                ht.ours,
                to_hf=lambda w: w.reshape(w.shape[0], c, t, p, p),
                from_hf=lambda w: w.reshape(w.shape[0], -1),
            )
            for ht in tensors
        ]
    if fqn.startswith("visual.blocks.") and ".attention.wqkv." in fqn:
        heads = vision["num_heads"]

        def swap(w: torch.Tensor, first: int, second: int) -> torch.Tensor:
            # (first, second, E, ...) rows → (second, first, E, ...) rows
            rest = w.shape[1:]
            grouped = w.reshape(first, second, -1, *rest)
            return grouped.transpose(0, 1).reshape(w.shape)

        return [
            HFTensor(
                ht.key,
                ht.ours,
                to_hf=lambda w: swap(w, heads, 3),
                from_hf=lambda w: swap(w, 3, heads),
            )
            for ht in tensors
        ]
    return tensors


def vision_config_from_hf(vision: Mapping[str, Any]) -> Qwen3VLVisionConfig:
    """Our tower config of an HF ``vision_config``."""

    def single(name: str) -> int:
        value = required(vision, name)
        if isinstance(value, (list, tuple)):  # (t, h, w)-style entries must agree
            if len(set(value)) != 1:
                raise ValueError(f"HF vision_config field {name}={value!r} is not supported")
            value = value[0]
        return int(value)

    rope = dict(vision.get("rope_parameters") or {})
    if rope.get("rope_type", "axial") not in ("axial", "default"):
        raise ValueError(
            f"HF vision_config field rope_parameters.rope_type={rope['rope_type']!r} is not "
            "supported (supported: 'axial')"
        )
    return Qwen3VLVisionConfig(
        dim=required(vision, "hidden_size"),
        num_layers=required(vision, "depth"),
        num_heads=required(vision, "num_heads"),
        ffn_hidden_dim=required(vision, "intermediate_size"),
        patch_size=single("patch_size"),
        temporal_patch_size=single("temporal_patch_size"),
        spatial_merge_size=required(vision, "spatial_merge_size"),
        in_channels=vision.get("in_channels", 3),
        num_position_embeddings=required(vision, "num_position_embeddings"),
        deepstack_layers=tuple(vision.get("deepstack_visual_indexes") or ()),
        activation=vision.get("hidden_act", "gelu_pytorch_tanh"),
        rope_theta=float(rope.get("rope_theta", 10_000.0)),
    )


def vision_config_to_hf(v: Qwen3VLVisionConfig, *, out_dim: int, model_type: str) -> dict:
    """The HF ``vision_config`` of our tower config."""
    return {
        "model_type": model_type,
        "depth": v.num_layers,
        "hidden_size": v.dim,
        "hidden_act": v.activation,
        "intermediate_size": v.ffn_hidden_dim,
        "num_heads": v.num_heads,
        "in_channels": v.in_channels,
        "patch_size": v.patch_size,
        "spatial_merge_size": v.spatial_merge_size,
        "temporal_patch_size": v.temporal_patch_size,
        "out_hidden_size": out_dim,
        "num_position_embeddings": v.num_position_embeddings,
        "deepstack_visual_indexes": list(v.deepstack_layers),
        "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
    }


_TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


if TYPE_CHECKING:  # the mixin goes before a text adapter: type-check it as one
    _TextAdapter = DenseHFAdapter[Any]
else:
    _TextAdapter = object


class VisionLanguageAdapterMixin(_TextAdapter):
    """Nested ``text_config`` / ``vision_config`` around a text adapter (dense or MoE)."""

    vision_model_type: str
    text_model_type: str

    def config_from_hf(self, hf: Mapping[str, Any]) -> Any:  # the text config + vision fields
        """Our config for an HF ``config.json``; ``ValueError`` naming any field we do not model."""
        text = dict(required(hf, "text_config"))
        vision = dict(required(hf, "vision_config"))
        check_supported(text, sliding_window=True)
        if vision.get("out_hidden_size", text.get("hidden_size")) != text.get("hidden_size"):
            raise ValueError(
                f"HF vision_config field out_hidden_size={vision['out_hidden_size']!r} must equal "
                f"text_config hidden_size={text.get('hidden_size')!r}"
            )
        if "tie_word_embeddings" in hf:
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
        field = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"
        rope = dict(text.get(field) or {})
        fields = self.config_fields_from_hf(text)
        fields["rope"] = rope_from_hf(
            {**text, field: {k: v for k, v in rope.items() if not k.startswith("mrope")}},
            max_position_embeddings=fields["max_seq_len"],
        )
        tokens = {name: hf[name] for name in _TOKEN_FIELDS if hf.get(name) is not None}
        return self.config_cls(
            **fields,
            **self.windows_from_hf(text),
            vision=vision_config_from_hf(vision),
            mrope_section=tuple(rope.get("mrope_section") or (24, 20, 20)),
            mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
            **tokens,
        )

    def config_to_hf(self, config: Any) -> dict[str, Any]:  # a VisionLanguageFields config
        """The nested HF ``config.json`` (``rope_theta`` + ``rope_scaling`` with the M-RoPE
        sections, as the Hub's checkpoints spell them)."""
        text = super().config_to_hf(config)
        if text.pop("rope_scaling", None) is not None:
            raise ValueError(
                f"{type(config).__name__}.rope.scaling cannot be written as an HF "
                f"{self.model_types[0]!r} checkpoint (M-RoPE takes plain frequencies)"
            )
        text.pop("architectures")
        tie = text.pop("tie_word_embeddings")
        text["model_type"] = self.text_model_type
        text["rope_scaling"] = {
            "rope_type": "default",
            "mrope_section": list(config.mrope_section),
            "mrope_interleaved": config.mrope_interleaved,
        }
        return {
            "architectures": [self.architecture],
            "model_type": self.model_types[0],
            "text_config": text,
            "vision_config": vision_config_to_hf(
                config.vision, out_dim=config.dim, model_type=self.vision_model_type
            ),
            **{name: getattr(config, name) for name in _TOKEN_FIELDS},
            "tie_word_embeddings": tie,
        }

    def hf_tensors(
        self, fqn: str, param: torch.Tensor, hf_config: Mapping[str, Any]
    ) -> list[HFTensor]:
        return vision_tensors(fqn, super().hf_tensors(fqn, param, hf_config), hf_config)


class Qwen3VLHFAdapter(VisionLanguageAdapterMixin, DenseHFAdapter[Qwen3VLConfig]):
    """``model_type: qwen3_vl``."""

    model_types = ("qwen3_vl",)
    architecture = "Qwen3VLForConditionalGeneration"
    config_cls = Qwen3VLConfig
    text_model_type = "qwen3_vl_text"
    vision_model_type = "qwen3_vl_vision"
    default_max_position_embeddings = 128_000
    key_map = text_key_map(DENSE_KEY_MAP) + VISION_KEY_MAP
