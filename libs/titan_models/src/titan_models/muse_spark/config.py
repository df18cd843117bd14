"""Muse Spark Open configuration and flavours (hyper-parameters of the public HF config).

The text decoder's fields, then the towers: ``vision`` (Muse Glimmer's tower and adapter,
the same architecture) and ``audio`` (a causal convolutional pyramid over the waveform),
with the media placeholder ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..components import RopeConfig, TransformerConfig
from ..components.moe import check_moe_fields
from ..components.vision.encoder import vision_activation
from ..muse_glimmer.config import DEBUG_VISION as GLIMMER_DEBUG_VISION
from ..muse_glimmer.config import MuseGlimmerVisionConfig, tower_flops, vision_global_layers

MLP_LAYER_TYPES = ("dense", "sparse")


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(kw_only=True, slots=True)
class MuseSparkAudioConfig:
    """The audio tower: stages that each fold ``patch_sizes[i]`` steps into one (a linear
    patch embedding and an RMSNorm) and run ``depths[i]`` residual blocks of a causal
    depthwise convolution, an RMSNorm and a GELU MLP; then an RMSNorm, a projection to the
    text width and an RMSNorm. One token per ``prod(patch_sizes)`` waveform samples."""

    patch_sizes: tuple[int, ...] = (16, 6, 5, 4)
    """Steps each stage folds into one (the first stage's are waveform samples)."""
    hidden_sizes: tuple[int, ...] = (256, 512, 1024, 2048)
    """Width of each stage."""
    depths: tuple[int, ...] = (2, 2, 2, 2)
    """Convolution blocks of each stage."""
    mlp_ratio: float = 4.0
    """A block's MLP hidden width is ``int(width · mlp_ratio)``."""
    conv_kernel_size: int = 7
    """Taps of the causal depthwise convolutions."""
    activation: str = "gelu"
    """MLP activation (HF ``hidden_act``)."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm of the tower (HF ``rms_norm_eps``)."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        self.patch_sizes = tuple(self.patch_sizes)
        self.hidden_sizes = tuple(self.hidden_sizes)
        self.depths = tuple(self.depths)
        lists = (self.patch_sizes, self.hidden_sizes, self.depths)
        if not self.depths or len({len(x) for x in lists}) != 1:
            raise ValueError(
                f"{name}.patch_sizes, hidden_sizes and depths need one entry per stage, got "
                f"{list(self.patch_sizes)}, {list(self.hidden_sizes)}, {list(self.depths)}"
            )
        for field in ("patch_sizes", "hidden_sizes", "depths"):
            if not all(_positive_int(v) for v in getattr(self, field)):
                raise ValueError(f"{name}.{field} must hold ints >= 1, got {getattr(self, field)}")
        if not _positive_int(self.conv_kernel_size):
            raise ValueError(f"{name}.conv_kernel_size must be an int >= 1")
        if not self.mlp_ratio > 0 or not self.norm_eps > 0:
            raise ValueError(
                f"{name}.mlp_ratio and norm_eps must be > 0, got {self.mlp_ratio!r}, "
                f"{self.norm_eps!r}"
            )
        vision_activation(self.activation)

    @property
    def samples_per_token(self) -> int:
        """Waveform samples behind one audio token (1920: 80 ms at 24 kHz, released)."""
        return math.prod(self.patch_sizes)


@dataclass(kw_only=True, slots=True)
class MuseSparkConfig(TransformerConfig):
    """Muse Spark Open: GQA with scaleless QK-norm and a sigmoid output gate, RoPE with a
    base per layer (NoPE on every 4th layer counted back from the last), sliding-window
    attention on the RoPE layers, post-sub-layer norms and temperature residual gates, a
    dense SwiGLU or a pooled MoE per layer, and a scaled, soft-capped output head; images
    through ``vision``, waveforms through ``audio`` (each optional).

    ``rope.theta`` is the base of every RoPE layer unless ``layer_rope_theta`` says otherwise;
    ``sliding_window`` applies to the RoPE layers (``sliding_window_layers=None``) or to the
    layers listed there.
    """

    norm_eps: float = 1e-5
    """Epsilon of the pre-norms, QK-norm, output and embedding norms and the pooled MoE input
    norm (HF ``rms_norm_eps``)."""
    post_norm_eps: float = 1e-8
    """Epsilon of the post-attention, post-feed-forward and post-expert norms."""
    sliding_window: int | None = 2048
    """Window of the sliding layers (a query sees itself and ``W - 1`` tokens before it)."""
    qk_scale_factor: float = 5.4730064863875
    """Queries are multiplied by this after the scaleless QK-norm (on top of ``1/√E``)."""
    output_multiplier: float = 0.1767766952966369
    """Scale of the raw logits before the soft cap, and of the router logits."""
    logit_softcap: float = 20.0
    """Final logits are ``cap · tanh(logits / cap)`` (HF ``final_logit_softcapping``)."""
    layer_rope_theta: tuple[float, ...] = ()
    """RoPE base per layer, 0 for NoPE; empty: ``rope.theta`` except every 4th layer counted
    back from the last, which is NoPE."""
    mlp_layer_types: tuple[str, ...] = ()
    """``dense`` (SwiGLU of ``ffn_hidden_dim``) or ``sparse`` (pooled MoE) per layer, in any
    order; empty: every layer sparse."""
    residual_gate_temperature: float = 0.3
    """A residual gate's logit is its parameter divided by this."""
    num_experts: int = 256
    """Routed experts per MoE layer."""
    num_experts_per_tok: int = 8
    """Experts each token is routed to (top-k)."""
    moe_dim: int = 4096
    """Width the MoE block pools the residual stream down to before the routed experts (and
    projects back up from after them): the experts' model width (HF ``moe_hidden_size``)."""
    moe_hidden_dim: int = 4096
    """Hidden width of one routed expert (HF ``moe_intermediate_size``)."""
    route_scale: float = 1.0
    """Routing weights are multiplied by this after renormalisation (HF
    ``routed_scaling_factor``)."""
    bias_update_rate: float = 1e-3
    """Aux-loss-free balancing step of the router's selection bias (0: fixed bias)."""
    aux_loss_coef: float = 0.0
    """Weight of dist_moe's sequence-wise balance loss in training (0: none, as HF)."""
    vision: MuseGlimmerVisionConfig | None = None
    """The vision tower (Muse Glimmer's architecture); ``None``: text only, no tower."""
    projector_hidden_dim: int = 4096
    """Width of the vision adapter (HF ``projector_hidden_size``)."""
    audio: MuseSparkAudioConfig | None = None
    """The audio tower; ``None``: no audio tower."""
    image_token_id: int = 200_092
    """Placeholder of one merged image token (``<|patch|>``)."""
    video_token_id: int = 200_091
    """Placeholder of a video token (embedded as token 0; videos are not modelled yet)."""
    audio_token_id: int = 200_038
    """Placeholder of one audio token (``<|audio|>``)."""
    vision_start_token_id: int | None = None
    """``<|image_start|>`` before an image's placeholders: a tokenizer id, not in the HF
    config (``None``: unknown; the app's image-text data path needs it)."""
    vision_end_token_id: int | None = None
    """``<|image_end|>`` after them."""

    def __post_init__(self) -> None:
        TransformerConfig.__post_init__(self)
        check_moe_fields(self)
        name = type(self).__name__
        self.layer_rope_theta = tuple(self.layer_rope_theta)
        self.mlp_layer_types = tuple(self.mlp_layer_types)
        thetas = self.layer_rope_theta
        if thetas and (len(thetas) != self.num_layers or any(not t >= 0 for t in thetas)):
            raise ValueError(
                f"{name}.layer_rope_theta={list(thetas)} must give a base >= 0 (0: NoPE) for "
                f"each of the num_layers={self.num_layers} layers (or be empty)"
            )
        kinds = self.mlp_layer_types
        if kinds and (
            len(kinds) != self.num_layers or any(k not in MLP_LAYER_TYPES for k in kinds)
        ):
            raise ValueError(
                f"{name}.mlp_layer_types={list(kinds)} must name 'dense' or 'sparse' for each "
                f"of the num_layers={self.num_layers} layers (or be empty)"
            )
        for field in ("post_norm_eps", "qk_scale_factor", "output_multiplier", "logit_softcap"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{name}.{field} must be > 0, got {getattr(self, field)!r}")
        if not self.residual_gate_temperature > 0:
            raise ValueError(
                f"{name}.residual_gate_temperature must be > 0, got "
                f"{self.residual_gate_temperature!r}"
            )
        if not isinstance(self.moe_dim, int) or isinstance(self.moe_dim, bool) or self.moe_dim < 1:
            raise ValueError(f"{name}.moe_dim must be an int >= 1, got {self.moe_dim!r}")
        if not self.route_scale > 0 or not self.bias_update_rate >= 0:
            raise ValueError(
                f"{name}.route_scale must be > 0 and bias_update_rate >= 0, got "
                f"{self.route_scale!r} and {self.bias_update_rate!r}"
            )
        self._check_towers()

    def _check_towers(self) -> None:
        name = type(self).__name__
        for field, cls in (("vision", MuseGlimmerVisionConfig), ("audio", MuseSparkAudioConfig)):
            value = getattr(self, field)
            if value is not None and not isinstance(value, cls):
                raise ValueError(
                    f"{name}.{field} must be a {cls.__name__} or None, got {type(value).__name__}"
                )
        if not _positive_int(self.projector_hidden_dim):
            raise ValueError(
                f"{name}.projector_hidden_dim must be an int >= 1, got {self.projector_hidden_dim!r}"
            )
        # Placeholders embed as token 0 (any id will do); the start / end ids are embedded.
        for field in ("image_token_id", "video_token_id", "audio_token_id"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}.{field} must be a token id >= 0, got {value!r}")
        for field in ("vision_start_token_id", "vision_end_token_id"):
            value = getattr(self, field)
            if value is not None and (
                not isinstance(value, int)
                or isinstance(value, bool)
                or not 0 <= value < self.vocab_size
            ):
                raise ValueError(
                    f"{name}.{field}={value!r} must be a token id in [0, vocab_size="
                    f"{self.vocab_size}) or None"
                )

    def rope_theta(self, layer: int) -> float:
        """RoPE base of ``layer``; 0 for a NoPE layer."""
        if self.layer_rope_theta:
            return float(self.layer_rope_theta[layer])
        return 0.0 if (self.num_layers - 1 - layer) % 4 == 0 else self.rope.theta

    def is_dense(self, layer: int) -> bool:
        """Whether block ``layer`` has a dense SwiGLU (else a pooled MoE)."""
        return bool(self.mlp_layer_types) and self.mlp_layer_types[layer] == "dense"

    def layer_window(self, index: int) -> int | None:
        """Sliding window of layer ``index``: the RoPE layers' unless ``sliding_window_layers``
        lists the sliding ones (NoPE layers attend to the whole prefix)."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is not None:
            return self.sliding_window if index in self.sliding_window_layers else None
        return self.sliding_window if self.rope_theta(index) else None

    def attention_params(self) -> int:
        """Weights of one attention layer: q, k, v, the output gate and the output."""
        c = self
        return c.dim * (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim + (
            c.num_heads * c.head_dim * c.dim
        )

    def matmul_params(self) -> int:
        """Active weights per token: attention, dense SwiGLUs or (router + pooling + top-k
        experts), head."""
        c = self
        dense = 3 * c.dim * c.ffn_hidden_dim
        moe = c.dim * c.num_experts + 2 * c.dim * c.moe_dim
        moe += c.num_experts_per_tok * 3 * c.moe_dim * c.moe_hidden_dim
        num_dense = sum(c.is_dense(i) for i in range(c.num_layers))
        ffns = num_dense * dense + (c.num_layers - num_dense) * moe
        return c.num_layers * c.attention_params() + ffns + c.dim * c.vocab_size

    def vision_flops(self, grids) -> int:
        """Forward + backward FLOPs of the vision tower and adapter on images of patch grids
        ``grids`` (Muse Glimmer's tower: ``muse_glimmer.config.tower_flops``)."""
        if self.vision is None:
            raise ValueError(f"{type(self).__name__}.vision is None: the model reads no images")
        return tower_flops(self.vision, self.projector_hidden_dim, self.dim, grids)


DEBUG_AUDIO = MuseSparkAudioConfig(
    patch_sizes=(4, 2), hidden_sizes=(16, 32), depths=(1, 1), conv_kernel_size=3
)
"""Tiny audio tower of the debug flavour: one token per 8 samples."""

SPARK_VISION = MuseGlimmerVisionConfig(
    dim=1536,
    num_layers=50,
    num_heads=16,
    ffn_hidden_dim=8960,
    global_layers=vision_global_layers(50),
)
"""The vision tower of the public checkpoint (transformers' defaults)."""

MUSE_SPARK_FLAVORS: dict[str, MuseSparkConfig] = {
    # Tiny: 4 layers (NoPE and full attention at 3, windows of 64 on 0-2), a dense block
    # among MoE blocks, 8 experts top-2 pooled from 128 to 64 wide; 2-block vision tower,
    # 2-stage audio tower.
    "debug": MuseSparkConfig(
        vocab_size=2048,
        dim=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        ffn_hidden_dim=256,
        rope=RopeConfig(theta=500_000.0),
        max_seq_len=2048,
        sliding_window=64,
        mlp_layer_types=("sparse", "dense", "sparse", "sparse"),
        num_experts=8,
        num_experts_per_tok=2,
        moe_dim=64,
        moe_hidden_dim=128,
        output_multiplier=2**0.5,  # 1/sqrt(dim / 256), as the released config
        vision=GLIMMER_DEBUG_VISION,  # the same tower architecture, the same tiny shape
        projector_hidden_dim=96,
        audio=DEBUG_AUDIO,
        # the app's byte tokenizer has 264 ids: placeholders and image start / end above 258
        image_token_id=259,
        vision_start_token_id=260,
        vision_end_token_id=261,
        video_token_id=262,
        audio_token_id=263,
    ),
    # meta-models/Muse-Spark-Open-816B-A42B: 62 layers, NoPE and full attention on
    # every 4th from the last, 256 experts top-8 pooled from 8192 to 4096 wide; Muse
    # Glimmer's 50-block vision tower and a 4-stage audio pyramid (transformers' defaults).
    "816B": MuseSparkConfig(
        vocab_size=202_048,
        dim=8192,
        num_layers=62,
        num_heads=128,
        num_kv_heads=16,
        head_dim=64,
        ffn_hidden_dim=16_384,
        rope=RopeConfig(theta=500_000.0),
        max_seq_len=1_048_576,
        vision=SPARK_VISION,
        audio=MuseSparkAudioConfig(),
        vision_start_token_id=200_080,  # the Llama 4 tokenizer's, as Muse Glimmer's
        vision_end_token_id=200_081,
    ),
}
