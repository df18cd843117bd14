"""Qwen3-VL configuration and flavours (hyper-parameters of the public HF checkpoints).

A Qwen3-VL config is the text decoder's (``Qwen3Config``; ``Qwen3MoeConfig`` for the MoE
models) plus the vision tower (``vision``), the multimodal RoPE sections and the special
token ids. ``dim`` is also the width the tower's mergers project to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..components import RopeConfig
from ..components.vision.encoder import vision_activation
from ..qwen3 import Qwen3Config


@dataclass(kw_only=True, slots=True)
class Qwen3VLVisionConfig:
    """The Qwen3-VL vision tower: a ViT with 2-D RoPE and learned positions resampled to each
    image, a 2×2 patch merger into the text width, and DeepStack mergers on chosen layers."""

    dim: int
    """Width of the tower (HF ``hidden_size``)."""
    num_layers: int
    """Vision blocks (HF ``depth``)."""
    num_heads: int
    """Attention heads per block."""
    ffn_hidden_dim: int
    """Hidden width of the MLP (HF ``intermediate_size``)."""
    patch_size: int = 16
    """Pixels per patch side."""
    temporal_patch_size: int = 2
    """Frames per patch (a still image is repeated to fill them)."""
    spatial_merge_size: int = 2
    """Patches per side merged into one language-model token."""
    in_channels: int = 3
    """Image channels."""
    num_position_embeddings: int = 2304
    """Learned positions, a square grid (48 × 48) resampled to each image's patch grid."""
    deepstack_layers: tuple[int, ...] = (8, 16, 24)
    """Vision blocks whose outputs are merged and added after text layers 0, 1, ... (HF
    ``deepstack_visual_indexes``)."""
    activation: str = "gelu_pytorch_tanh"
    """MLP activation (HF ``hidden_act``)."""
    rope_theta: float = 10_000.0
    """Base of the 2-D rotary frequencies."""
    norm_eps: float = 1e-6
    """Epsilon of every LayerNorm of the tower."""
    tensor_parallel: bool = False
    """Shard the blocks' attention heads and MLPs over the tensor-parallel group; by default
    the tower is replicated on every tensor-parallel rank (it is small next to the decoder)."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field in (
            "dim",
            "num_layers",
            "num_heads",
            "ffn_hidden_dim",
            "patch_size",
            "temporal_patch_size",
            "spatial_merge_size",
            "in_channels",
            "num_position_embeddings",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}.{field} must be an int >= 1, got {value!r}")
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 4:
            raise ValueError(
                f"{name}.dim={self.dim} must be num_heads={self.num_heads} heads of a width "
                "divisible by 4 (2-D rotary positions)"
            )
        side = round(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(
                f"{name}.num_position_embeddings={self.num_position_embeddings} must be a square"
            )
        self.deepstack_layers = tuple(self.deepstack_layers)
        bad = [i for i in self.deepstack_layers if not 0 <= i < self.num_layers]
        if bad or len(set(self.deepstack_layers)) != len(self.deepstack_layers):
            raise ValueError(
                f"{name}.deepstack_layers={self.deepstack_layers} must be distinct block "
                f"indices in [0, {self.num_layers})"
            )
        vision_activation(self.activation)

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch, ``C·T·P·P``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def check_vision_language_fields(config: Any) -> None:
    """``ValueError`` naming the first vision-language field of ``config`` out of range."""
    name = type(config).__name__
    if not isinstance(config.vision, Qwen3VLVisionConfig):
        raise ValueError(
            f"{name}.vision must be a Qwen3VLVisionConfig, got {type(config.vision).__name__}"
        )
    config.mrope_section = tuple(config.mrope_section)
    if len(config.mrope_section) != 3 or sum(config.mrope_section) != config.head_dim // 2:
        raise ValueError(
            f"{name}.mrope_section={config.mrope_section} must be three counts (time, height, "
            f"width) summing to head_dim / 2 = {config.head_dim // 2}"
        )
    # Only the image placeholder is embedded; the others are markers the data writes as text.
    for field in (
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
    ):
        value = getattr(config, field)
        high = config.vocab_size if field == "image_token_id" else None
        if (
            not isinstance(value, int)
            or isinstance(value, bool)
            or value < 0
            or (high is not None and value >= high)
        ):
            allowed = f"[0, vocab_size={high})" if high is not None else ">= 0"
            raise ValueError(f"{name}.{field}={value!r} must be a token id {allowed}")
    if len(config.vision.deepstack_layers) > config.num_layers:
        raise ValueError(
            f"{name}: {len(config.vision.deepstack_layers)} DeepStack layers need as many text "
            f"layers, the model has num_layers={config.num_layers}"
        )


def vision_matmul_params(config: Any) -> tuple[int, int]:
    """Matmul weights of the tower per patch and per merged token: ``(patch embedding +
    blocks, every merger)``."""
    v = config.vision
    blocks = v.num_layers * (4 * v.dim * v.dim + 2 * v.dim * v.ffn_hidden_dim)
    block = v.dim * v.spatial_merge_size**2
    merger = block * block + block * config.dim
    return v.patch_dim * v.dim + blocks, merger * (1 + len(v.deepstack_layers))


def vision_flops(config: Any, grids: Sequence[Sequence[int]]) -> int:
    """Forward + backward FLOPs of the vision tower on images of patch grids ``grids``:
    ``6·N`` per patch and merged token (``N`` = its matmul weights) plus bidirectional
    attention, ``12·L·D·n²`` per frame of ``n = h·w`` patches (no causal discount: a patch
    sees its whole image)."""
    v = config.vision
    per_patch, per_merged = vision_matmul_params(config)
    patches = sum(int(t) * int(h) * int(w) for t, h, w in grids)
    merged = patches // v.spatial_merge_size**2
    attention = sum(int(t) * (int(h) * int(w)) ** 2 for t, h, w in grids)
    return 6 * (per_patch * patches + per_merged * merged) + 12 * v.num_layers * v.dim * attention


@dataclass(kw_only=True)
class VisionLanguageFields:
    """The fields and tower FLOPs a Qwen3-VL config adds to its text decoder's (dense or MoE):
    a slot-free base, so both slotted config classes share it."""

    __slots__ = ()

    vision: Qwen3VLVisionConfig
    """The vision tower."""
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    """Rotary frequencies per position axis (time, height, width); sum = head_dim / 2."""
    mrope_interleaved: bool = True
    """Deal the frequencies to the axes round-robin (Qwen3-VL) instead of in runs."""
    image_token_id: int = 151_655
    """Placeholder token of one merged image token (``<|image_pad|>``)."""
    video_token_id: int = 151_656
    """Placeholder of a video token (``<|video_pad|>``; videos are not modelled yet)."""
    vision_start_token_id: int = 151_652
    """``<|vision_start|>``, before an image's placeholders."""
    vision_end_token_id: int = 151_653
    """``<|vision_end|>``, after them."""

    def vision_flops(self, grids: Sequence[Sequence[int]]) -> int:
        """Forward + backward FLOPs of the vision tower (``titan_models.vision_flops``)."""
        return vision_flops(self, grids)


@dataclass(kw_only=True, slots=True)
class Qwen3VLConfig(Qwen3Config, VisionLanguageFields):
    """Qwen3-VL dense: the Qwen3 decoder with interleaved M-RoPE, reading images through the
    vision tower (placeholders replaced, DeepStack features added after the first layers)."""

    def __post_init__(self) -> None:
        Qwen3Config.__post_init__(self)
        check_vision_language_fields(self)


_VOCAB = 151_936
_CONTEXT = 262_144
_ROPE = RopeConfig(theta=5_000_000.0)
_VISION_SMALL = dict(dim=1024, num_layers=24, num_heads=16, ffn_hidden_dim=4096)
_VISION_LARGE = dict(dim=1152, num_layers=27, num_heads=16, ffn_hidden_dim=4304)


def _flavor(vision: dict, deepstack: tuple[int, ...], **kw) -> Qwen3VLConfig:
    return Qwen3VLConfig(
        vocab_size=_VOCAB,
        max_seq_len=_CONTEXT,
        head_dim=128,
        rope=_ROPE,
        vision=Qwen3VLVisionConfig(**vision, deepstack_layers=deepstack),
        **kw,
    )


DEBUG_VISION = Qwen3VLVisionConfig(
    dim=96,
    num_layers=3,
    num_heads=4,
    ffn_hidden_dim=256,
    patch_size=8,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=64,
    deepstack_layers=(0, 1),
)
"""Tiny tower of the debug flavours: 8-pixel patches, an 8 × 8 learned grid."""

DEBUG_TOKENS = dict(
    image_token_id=259, vision_start_token_id=260, vision_end_token_id=261, video_token_id=262
)
"""Special ids of the debug flavours: the ids the built-in byte tokenizer leaves free."""

QWEN3_VL_FLAVORS: dict[str, Qwen3VLConfig] = {
    # Tiny: learns the built-in shapes corpus on 2 CPU cores in minutes.
    "debug": Qwen3VLConfig(
        vocab_size=264,
        dim=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        ffn_hidden_dim=384,
        rope=RopeConfig(theta=10_000.0),
        max_seq_len=2048,
        tie_embeddings=True,
        vision=DEBUG_VISION,
        mrope_section=(6, 5, 5),
        **DEBUG_TOKENS,
    ),
    # Qwen/Qwen3-VL-2B-Instruct
    "2B": _flavor(
        _VISION_SMALL,
        (5, 11, 17),
        dim=2048,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        ffn_hidden_dim=6144,
        tie_embeddings=True,
    ),
    # Qwen/Qwen3-VL-4B-Instruct
    "4B": _flavor(
        _VISION_SMALL,
        (5, 11, 17),
        dim=2560,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        ffn_hidden_dim=9728,
        tie_embeddings=True,
    ),
    # Qwen/Qwen3-VL-8B-Instruct
    "8B": _flavor(
        _VISION_LARGE,
        (8, 16, 24),
        dim=4096,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        ffn_hidden_dim=12288,
    ),
    # Qwen/Qwen3-VL-32B-Instruct
    "32B": _flavor(
        _VISION_LARGE,
        (8, 16, 24),
        dim=5120,
        num_layers=64,
        num_heads=64,
        num_kv_heads=8,
        ffn_hidden_dim=25600,
    ),
}
