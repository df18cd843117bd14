"""Qwen3.5 parallelism plan (pure data)."""

from __future__ import annotations

from typing import TypedDict

from ..components.linear_attention.layer_types import resolved_layer_types
from ..plan import ModelPlan, decoder_plan
from .config import Qwen3_5Config
from .model import Qwen3_5

GATED_DELTANET_TP = {
    "colwise": ("wq", "wk", "wv", "wz", "wb", "wa"),
    "rowwise": ("wo",),
    "replicated": ("norm",),
    "head_sharded": ("conv_q.weight", "conv_k.weight", "conv_v.weight", "dt_bias", "A_log"),
}
"""Gated DeltaNet by heads: projections column-wise (q/k by key heads, the rest by value
heads), ``wo`` row-wise, the shared output norm replicated, per-head vectors and conv filters
split with their heads."""


class MixerTP(TypedDict):
    """``decoder_plan``'s TP pattern arguments for the token mixers (and dense MLP)."""

    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    replicated: tuple[str, ...]
    head_sharded: tuple[str, ...]


def mixer_tp(config: Qwen3_5Config, *, moe: bool) -> MixerTP:
    """TP patterns of the token mixers present (gated attention as Qwen3, Gated DeltaNet),
    plus the dense SwiGLU unless ``moe``."""
    types = set(resolved_layer_types(config))
    out = {"colwise": [], "rowwise": [], "replicated": [], "head_sharded": []}
    if "full_attention" in types:
        out["colwise"] += ["wq", "wk", "wv"]
        out["rowwise"] += ["wo"]
        out["replicated"] += ["q_norm", "k_norm"]
    if "linear_attention" in types:
        for field, names in GATED_DELTANET_TP.items():
            out[field] += [n for n in names if n not in out[field]]
    patterns = {f: tuple(f"layers.*.attention.{n}" for n in names) for f, names in out.items()}
    if not moe:
        patterns["colwise"] += ("layers.*.feed_forward.w1", "layers.*.feed_forward.w3")
        patterns["rowwise"] += ("layers.*.feed_forward.w2",)
    return MixerTP(
        colwise=patterns["colwise"],
        rowwise=patterns["rowwise"],
        replicated=patterns["replicated"],
        head_sharded=patterns["head_sharded"],
    )


def plan(config: Qwen3_5Config) -> ModelPlan:
    """Attention as Qwen3 (TP by heads, QK-norms replicated; ``wq`` shards the query and gate
    rows of a head together), Gated DeltaNet by heads (``GATED_DELTANET_TP``), SwiGLU as Llama."""
    return decoder_plan(Qwen3_5, config, **mixer_tp(config, moe=False))
