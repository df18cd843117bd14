"""Kimi K2.5 configuration and flavours (hyper-parameters of the public HF checkpoints).

A Kimi K2.5 config is the DeepSeek-V3 decoder's (``DeepSeekV3Config``) plus the MoonViT
tower (``vision``), the projector's norm epsilon and the media token ids. ``dim`` is also
the width the projector maps the merged image tokens to. Kimi K2.6 and K2.7 share the
architecture (and the ``kimi_k25`` HF model type).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..components import RopeConfig, YarnRopeScaling
from ..components.vision.encoder import vision_activation
from ..deepseek_v3 import DeepSeekV3Config


@dataclass(kw_only=True, slots=True)
class KimiK25VisionConfig:
    """MoonViT: a ViT over native-resolution patches with a learned ``pos_emb_height ×
    pos_emb_width`` position grid (bicubically resampled to each image, plus a sinusoidal
    term per video frame), 2-D RoPE, a final LayerNorm, temporal mean pooling and a 2 × 2
    merge into the projector."""

    dim: int
    """Width of the tower (HF ``hidden_size``)."""
    num_layers: int
    """Vision blocks (HF ``num_hidden_layers``)."""
    num_heads: int
    """Attention heads per block."""
    ffn_hidden_dim: int
    """Hidden width of the MLP (HF ``intermediate_size``)."""
    patch_size: int = 14
    """Pixels per patch side."""
    pos_emb_height: int = 64
    """Rows of the learned position grid."""
    pos_emb_width: int = 64
    """Columns of the learned position grid."""
    pos_emb_time: int = 4
    """Frames of the sinusoidal time table (a clip may have at most this many)."""
    spatial_merge_size: int = 2
    """Patches per side merged into one language-model token (HF ``merge_kernel_size``)."""
    in_channels: int = 3
    """Image channels."""
    activation: str = "gelu_pytorch_tanh"
    """MLP activation (HF ``hidden_act``)."""
    rope_theta: float = 10_000.0
    """Base of the 2-D rotary frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of the blocks' and the final LayerNorm."""
    tensor_parallel: bool = False
    """Shard the blocks' heads and MLPs over the tensor-parallel group; by default the tower
    is replicated on every tensor-parallel rank (it is small next to the decoder)."""

    temporal_patch_size: int = 1
    """Frames per patch: MoonViT embeds every frame on its own (always 1; read by the image
    processor of the data path)."""

    patch_order: ClassVar[str] = "raster"
    """The tower reads each image's patches row by row (the Kimi K2.5 image processor's)."""
    image_mean: ClassVar[tuple[float, float, float]] = (0.5, 0.5, 0.5)
    """Per-channel mean the Kimi K2.5 image processor normalises with."""
    image_std: ClassVar[tuple[float, float, float]] = (0.5, 0.5, 0.5)
    """Per-channel standard deviation the Kimi K2.5 image processor normalises with."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field in (
            "dim",
            "num_layers",
            "num_heads",
            "ffn_hidden_dim",
            "patch_size",
            "pos_emb_height",
            "pos_emb_width",
            "pos_emb_time",
            "spatial_merge_size",
            "in_channels",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}.{field} must be an int >= 1, got {value!r}")
        if self.temporal_patch_size != 1:
            raise ValueError(
                f"{name}.temporal_patch_size={self.temporal_patch_size} must be 1 (MoonViT "
                "embeds each frame separately)"
            )
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 4:
            raise ValueError(
                f"{name}.dim={self.dim} must be num_heads={self.num_heads} heads of a width "
                "divisible by 4 (2-D rotary positions)"
            )
        if self.dim % 2:
            raise ValueError(f"{name}.dim={self.dim} must be even (sinusoidal time table)")
        if not self.norm_eps > 0:
            raise ValueError(f"{name}.norm_eps must be > 0, got {self.norm_eps!r}")
        vision_activation(self.activation)

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch, ``C·P·P``."""
        return self.in_channels * self.patch_size**2


@dataclass(kw_only=True, slots=True)
class KimiK25Config(DeepSeekV3Config):
    """Kimi K2.5: the DeepSeek-V3 decoder (MLA, sigmoid-routed MoE with a shared expert)
    reading images through MoonViT and a 2-layer GELU projector; image tokens replace the
    placeholder embeddings, text positions stay 1-D."""

    vision: KimiK25VisionConfig
    """The MoonViT tower."""
    projection_norm_eps: float = 1e-5
    """Epsilon of the projector's LayerNorm (HF ``projection_layer_norm_eps``)."""
    image_token_id: int = 163_605
    """Placeholder of one merged image token (``<|media_pad|>``)."""
    video_token_id: int = 163_840
    """Placeholder of a video token (videos are not modelled yet; may equal the vocabulary
    size, as in the public config)."""
    vision_start_token_id: int = 163_602
    """``<|media_begin|>``, before an image's placeholders."""
    vision_end_token_id: int = 163_604
    """``<|media_end|>``, after them."""

    def __post_init__(self) -> None:
        DeepSeekV3Config.__post_init__(self)
        name = type(self).__name__
        if not isinstance(self.vision, KimiK25VisionConfig):
            raise ValueError(
                f"{name}.vision must be a KimiK25VisionConfig, got {type(self.vision).__name__}"
            )
        if not self.projection_norm_eps > 0:
            raise ValueError(
                f"{name}.projection_norm_eps must be > 0, got {self.projection_norm_eps!r}"
            )
        for field in (
            "image_token_id",
            "video_token_id",
            "vision_start_token_id",
            "vision_end_token_id",
        ):
            value = getattr(self, field)
            high = self.vocab_size if field == "image_token_id" else None
            if (
                not isinstance(value, int)
                or isinstance(value, bool)
                or value < 0
                or (high is not None and value >= high)
            ):
                allowed = f"[0, vocab_size={high})" if high is not None else ">= 0"
                raise ValueError(f"{name}.{field}={value!r} must be a token id {allowed}")

    def vision_flops(self, grids) -> int:
        """Forward + backward FLOPs of the tower on images of patch grids ``grids``: ``6·N``
        per patch and merged token (``N`` its matmul weights) plus bidirectional attention,
        ``12·L·D·n²`` per clip of ``n = t·h·w`` patches."""
        v = self.vision
        per_patch = v.patch_dim * v.dim + v.num_layers * (
            4 * v.dim**2 + 2 * v.dim * v.ffn_hidden_dim
        )
        block = v.dim * v.spatial_merge_size**2
        per_merged = block * block + block * self.dim
        patches = sum(int(t) * int(h) * int(w) for t, h, w in grids)
        merged = sum(int(h) * int(w) for _, h, w in grids) // v.spatial_merge_size**2
        attention = sum((int(t) * int(h) * int(w)) ** 2 for t, h, w in grids)
        return (
            6 * (per_patch * patches + per_merged * merged) + 12 * v.num_layers * v.dim * attention
        )


DEBUG_VISION = KimiK25VisionConfig(
    dim=96,
    num_layers=2,
    num_heads=4,
    ffn_hidden_dim=256,
    patch_size=8,
    pos_emb_height=8,
    pos_emb_width=8,
)
"""Tiny tower of the debug flavour: 8-pixel patches, an 8 × 8 learned grid."""

MOONVIT = KimiK25VisionConfig(dim=1152, num_layers=27, num_heads=16, ffn_hidden_dim=4304)
"""MoonViT-400M of the public checkpoints."""

KIMI_K25_FLAVORS: dict[str, KimiK25Config] = {
    # Tiny: learns the built-in shapes corpus on 2 CPU cores in minutes. 8 experts top-2, one
    # dense block, no MTP (as the public model).
    "debug": KimiK25Config(
        vocab_size=264,
        dim=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=4,
        head_dim=48,
        ffn_hidden_dim=256,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_hidden_dim=64,
        num_shared_experts=1,
        first_k_dense=1,
        route_scale=2.827,
        norm_eps=1e-5,
        rope=RopeConfig(theta=50_000.0),
        max_seq_len=2048,
        tie_embeddings=False,
        vision=DEBUG_VISION,
        image_token_id=259,
        vision_start_token_id=260,
        vision_end_token_id=261,
        video_token_id=262,
    ),
    # moonshotai/Kimi-K2.5 (K2.6 / K2.7: same shapes): Kimi K2's 1T-A32B decoder (384 experts
    # top-8, one shared, one dense block, 64 MLA heads) + MoonViT-400M.
    "1T": KimiK25Config(
        vocab_size=163_840,
        dim=7168,
        num_layers=61,
        num_heads=64,
        num_kv_heads=64,
        head_dim=192,
        ffn_hidden_dim=18432,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts=384,
        num_experts_per_tok=8,
        moe_hidden_dim=2048,
        num_shared_experts=1,
        first_k_dense=1,
        route_scale=2.827,
        norm_eps=1e-5,
        rope=RopeConfig(
            theta=50_000.0,
            scaling=YarnRopeScaling(
                factor=64.0,
                original_max_seq_len=4096,
                beta_fast=1.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
        ),
        max_seq_len=262_144,
        vision=MOONVIT,
    ),
}
