"""Qwen3-VL-MoE configuration and flavours (hyper-parameters of the public HF checkpoints)."""

from __future__ import annotations

from dataclasses import dataclass

from ..components import RopeConfig
from ..qwen3_moe import Qwen3MoeConfig
from ..qwen3_vl.config import (
    DEBUG_TOKENS,
    DEBUG_VISION,
    Qwen3VLVisionConfig,
    VisionLanguageFields,
    check_vision_language_fields,
)


@dataclass(kw_only=True, slots=True)
class Qwen3VLMoeConfig(Qwen3MoeConfig, VisionLanguageFields):
    """Qwen3-VL-MoE: the Qwen3-MoE decoder (every block a routed MoE, top-k renormalised)
    with the Qwen3-VL vision tower, DeepStack and interleaved M-RoPE."""

    def __post_init__(self) -> None:
        Qwen3MoeConfig.__post_init__(self)
        check_vision_language_fields(self)


_VISION = dict(dim=1152, num_layers=27, num_heads=16, ffn_hidden_dim=4304)

QWEN3_VL_MOE_FLAVORS: dict[str, Qwen3VLMoeConfig] = {
    # Tiny: 8 experts, top-2, the debug tower.
    "debug": Qwen3VLMoeConfig(
        vocab_size=264,
        dim=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        ffn_hidden_dim=384,
        num_experts=8,
        num_experts_per_tok=2,
        moe_hidden_dim=64,
        rope=RopeConfig(theta=10_000.0),
        max_seq_len=2048,
        vision=DEBUG_VISION,
        mrope_section=(6, 5, 5),
        **DEBUG_TOKENS,
    ),
    # Qwen/Qwen3-VL-30B-A3B-Instruct
    "30B-A3B": Qwen3VLMoeConfig(
        vocab_size=151_936,
        dim=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        ffn_hidden_dim=6144,
        num_experts=128,
        num_experts_per_tok=8,
        moe_hidden_dim=768,
        rope=RopeConfig(theta=5_000_000.0),
        max_seq_len=262_144,
        vision=Qwen3VLVisionConfig(**_VISION, deepstack_layers=(8, 16, 24)),
    ),
    # Qwen/Qwen3-VL-235B-A22B-Instruct
    "235B-A22B": Qwen3VLMoeConfig(
        vocab_size=151_936,
        dim=4096,
        num_layers=94,
        num_heads=64,
        num_kv_heads=4,
        head_dim=128,
        ffn_hidden_dim=12288,
        num_experts=128,
        num_experts_per_tok=8,
        moe_hidden_dim=1536,
        rope=RopeConfig(theta=5_000_000.0),
        max_seq_len=262_144,
        vision=Qwen3VLVisionConfig(**_VISION, deepstack_layers=(8, 16, 24)),
    ),
}
