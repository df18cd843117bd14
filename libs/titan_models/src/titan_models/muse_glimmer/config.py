"""Muse Glimmer configuration and flavours (hyper-parameters of the public HF checkpoint).

A Muse Glimmer config is a dense GQA decoder's (``TransformerConfig``) plus what sets it
apart — the per-layer NoPE / sliding-window pattern, the query scale of the scaleless
QK-norm, the post-norm epsilon, the logit multiplier and soft cap — and the vision tower
(``vision``) with its adapter width and the media token ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..components import RopeConfig, TransformerConfig
from ..components.vision.encoder import vision_activation


def every_fourth_from_last(num_layers: int) -> tuple[int, ...]:
    """Layers ``L-1, L-5, L-9, ...`` (ascending): the public config's NoPE / full-attention
    layers (its ``sliding_window_pattern`` ``[w, w, w, 0]`` counted back from the last)."""
    return tuple(i for i in range(num_layers) if (num_layers - 1 - i) % 4 == 0)


def vision_global_layers(num_layers: int) -> tuple[int, ...]:
    """Every 4th vision block and the last: transformers' default full-attention blocks of
    the tower (the others attend inside windows)."""
    return tuple(i for i in range(num_layers) if (i + 1) % 4 == 0 or i == num_layers - 1)


@dataclass(kw_only=True, slots=True)
class MuseGlimmerVisionConfig:
    """The vision tower: a pre-LayerNorm ViT over native-resolution patches (two frames per
    patch), a learned square position table resampled to each image, 2-D RoPE, window
    attention in most blocks, a 2 × 2 pixel shuffle and a two-layer GELU adapter."""

    dim: int
    """Width of the tower (HF ``hidden_size``)."""
    num_layers: int
    """Vision blocks (HF ``num_hidden_layers``)."""
    num_heads: int
    """Attention heads per block."""
    ffn_hidden_dim: int
    """Hidden width of the MLP (HF ``intermediate_size``)."""
    global_layers: tuple[int, ...]
    """Blocks that attend over the whole frame; the others attend inside windows of
    ``pos_emb_size × pos_emb_size`` patches (HF ``layer_types``)."""
    patch_size: int = 14
    """Pixels per patch side."""
    temporal_patch_size: int = 2
    """Frames per patch (a still image is repeated; HF ``patch_temporal``)."""
    pos_emb_size: int = 32
    """Side of the learned square position table, and of an attention window in patches
    (HF ``pos_emb_height`` = ``pos_emb_width``)."""
    spatial_merge_size: int = 2
    """Patches per side shuffled into one language-model token (HF ``merge_size``)."""
    in_channels: int = 3
    """Image channels."""
    activation: str = "gelu"
    """MLP activation (HF ``hidden_act``)."""
    rope_theta: float = 10_000.0
    """Base of the 2-D rotary frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of the LayerNorms before and after the blocks (the blocks' own use 1e-5)."""

    patch_order: ClassVar[str] = "raster"
    """The tower reads each image's patches row by row (the Muse Glimmer image processor's)."""
    patch_layout: ClassVar[str] = "time_channel"
    """Each patch is flattened frame-major, ``(T, C, P, P)`` (Qwen2-VL's is ``(C, T, P, P)``)."""
    image_mean: ClassVar[tuple[float, float, float]] = (0.5, 0.5, 0.5)
    """Per-channel mean the Muse Glimmer image processor normalises with."""
    image_std: ClassVar[tuple[float, float, float]] = (0.5, 0.5, 0.5)
    """Per-channel standard deviation the Muse Glimmer image processor normalises with."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        for field in (
            "dim",
            "num_layers",
            "num_heads",
            "ffn_hidden_dim",
            "patch_size",
            "temporal_patch_size",
            "pos_emb_size",
            "spatial_merge_size",
            "in_channels",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}.{field} must be an int >= 1, got {value!r}")
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 4:
            raise ValueError(
                f"{name}.dim={self.dim} must be num_heads={self.num_heads} heads of a width "
                "divisible by 4 (2-D rotary positions)"
            )
        bad = [i for i in self.global_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"{name}.global_layers has {bad}: block indices lie in [0, {self.num_layers})"
            )
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(
                f"{name}.norm_eps and rope_theta must be > 0, got {self.norm_eps!r}, "
                f"{self.rope_theta!r}"
            )
        vision_activation(self.activation)

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch, ``T·C·P·P``."""
        return self.temporal_patch_size * self.in_channels * self.patch_size**2


@dataclass(kw_only=True, slots=True)
class MuseGlimmerConfig(TransformerConfig):
    """Muse Glimmer: GQA with scaleless QK-norm, a tuned query scale and a sigmoid output
    gate; NoPE on every 4th layer from the last, which attend globally while the others
    slide; gain-centred RMSNorms before and after each sub-layer; a normed token embedding;
    a logit multiplier and tanh soft cap; images through its vision tower."""

    vision: MuseGlimmerVisionConfig
    """The vision tower."""
    nope_layers: tuple[int, ...]
    """Layers without rotary positions (HF ``layer_rope_theta`` of 0)."""
    projector_hidden_dim: int
    """Width of the vision adapter (HF ``projector_hidden_size``)."""
    qk_scale_factor: float = 3.87
    """Multiplier of the normed queries, on top of ``1/sqrt(head_dim)``."""
    post_norm_eps: float = 1e-8
    """Epsilon of the norms after the attention and the MLP (before the residual add)."""
    output_multiplier: float = 0.19611613513818404
    """Scale of the logits before the soft cap."""
    logit_softcap: float = 20.0
    """Logits become ``cap · tanh(multiplier · logits / cap)`` (HF ``final_logit_softcapping``)."""
    image_token_id: int = 200_092
    """Placeholder of one merged image token (``<|patch|>``)."""
    video_token_id: int = 200_091
    """Placeholder of a video token (videos are not modelled yet)."""
    vision_start_token_id: int | None = None
    """``<|image_start|>`` before an image's placeholders: a tokenizer id, not in the HF
    config (``None``: unknown; the image-text data path needs it)."""
    vision_end_token_id: int | None = None
    """``<|image_end|>`` after them."""

    def __post_init__(self) -> None:
        TransformerConfig.__post_init__(self)
        name = type(self).__name__
        if not isinstance(self.vision, MuseGlimmerVisionConfig):
            raise ValueError(
                f"{name}.vision must be a MuseGlimmerVisionConfig, got {type(self.vision).__name__}"
            )
        bad = [i for i in self.nope_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"{name}.nope_layers has {bad}: layer indices lie in [0, {self.num_layers})"
            )
        for field in ("qk_scale_factor", "post_norm_eps", "output_multiplier", "logit_softcap"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{name}.{field} must be > 0, got {getattr(self, field)!r}")
        if not isinstance(self.projector_hidden_dim, int) or self.projector_hidden_dim < 1:
            raise ValueError(
                f"{name}.projector_hidden_dim must be an int >= 1, got {self.projector_hidden_dim!r}"
            )
        for field in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
            value = getattr(self, field)
            if value is None and field != "image_token_id":
                continue
            if (
                not isinstance(value, int)
                or isinstance(value, bool)
                or not 0 <= value < self.vocab_size
            ):
                raise ValueError(
                    f"{name}.{field}={value!r} must be a token id in [0, vocab_size={self.vocab_size})"
                )

    def matmul_params(self) -> int:
        """``TransformerConfig``'s count plus the output gate of every layer."""
        gate = self.num_layers * self.dim * self.num_heads * self.head_dim
        return TransformerConfig.matmul_params(self) + gate

    def vision_flops(self, grids) -> int:
        """Forward + backward FLOPs of the tower and adapter on images of patch grids
        ``grids`` (``tower_flops``)."""
        return tower_flops(self.vision, self.projector_hidden_dim, self.dim, grids)


def tower_flops(v: MuseGlimmerVisionConfig, projector_dim: int, out_dim: int, grids) -> int:
    """Forward + backward FLOPs of a Muse Glimmer tower and its adapter (to ``out_dim``) on
    images of patch grids ``grids``: ``6·N`` per patch and merged token (``N`` its matmul
    weights) plus the bidirectional attention (global blocks over a frame, the others over
    a window)."""
    per_patch = v.patch_dim * v.dim + v.num_layers * (4 * v.dim**2 + 2 * v.dim * v.ffn_hidden_dim)
    block = v.dim * v.spatial_merge_size**2
    p = projector_dim
    per_merged = block * p + p * p + p * out_dim
    patches = sum(int(t) * int(h) * int(w) for t, h, w in grids)
    window = v.pos_emb_size**2
    full = sum(int(t) * (int(h) * int(w)) ** 2 for t, h, w in grids)
    local = sum(int(t) * int(h) * int(w) * min(window, int(h) * int(w)) for t, h, w in grids)
    glob = len(v.global_layers)
    attention = 12 * v.dim * (glob * full + (v.num_layers - glob) * local)
    return 6 * (per_patch * patches + per_merged * patches // v.spatial_merge_size**2) + attention


DEBUG_VISION = MuseGlimmerVisionConfig(
    dim=64,
    num_layers=2,
    num_heads=4,
    ffn_hidden_dim=128,
    global_layers=(1,),
    patch_size=8,
    pos_emb_size=4,
)
"""Tiny tower of the debug flavour: 8-pixel patches, a 4 × 4 table and 4 × 4 windows."""

GLIMMER_VISION = MuseGlimmerVisionConfig(
    dim=1536,
    num_layers=50,
    num_heads=16,
    ffn_hidden_dim=8960,
    global_layers=vision_global_layers(50),
)
"""The tower of the public checkpoint."""

MUSE_GLIMMER_FLAVORS: dict[str, MuseGlimmerConfig] = {
    # Tiny: learns the built-in shapes corpus on 2 CPU cores in minutes. Four layers: NoPE +
    # global on layers 0 and 3 (every 4th from the last), sliding windows of 64 between.
    "debug": MuseGlimmerConfig(
        vocab_size=264,
        dim=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        ffn_hidden_dim=256,
        rope=RopeConfig(theta=10_000.0),
        max_seq_len=2048,
        sliding_window=64,
        sliding_window_layers=(1, 2),
        nope_layers=every_fourth_from_last(4),
        projector_hidden_dim=96,
        output_multiplier=(128 / 256) ** -0.5,
        vision=DEBUG_VISION,
        image_token_id=259,
        vision_start_token_id=260,
        vision_end_token_id=261,
        video_token_id=262,
    ),
    # meta-models/Muse-Glimmer-30B: 52 layers of 6656 wide, 32 query / 2 kv heads of 128,
    # a 202,048-token vocabulary, 2048-token windows, a 50-block 1536-wide tower.
    "30B": MuseGlimmerConfig(
        vocab_size=202_048,
        dim=6656,
        num_layers=52,
        num_heads=32,
        num_kv_heads=2,
        head_dim=128,
        ffn_hidden_dim=19968,
        rope=RopeConfig(theta=10_000.0),
        max_seq_len=131_072,
        sliding_window=2048,
        sliding_window_layers=tuple(i for i in range(52) if i not in every_fourth_from_last(52)),
        nope_layers=every_fourth_from_last(52),
        projector_hidden_dim=4096,
        vision=GLIMMER_VISION,
        vision_start_token_id=200_080,  # the Llama 4 tokenizer's <|image_start|> / <|image_end|>
        vision_end_token_id=200_081,
    ),
}
