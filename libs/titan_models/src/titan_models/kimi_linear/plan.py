"""Kimi Linear parallelism plan (pure data)."""

from __future__ import annotations

from ..components.linear_attention.layer_types import resolved_layer_types
from ..plan import ModelPlan, decoder_plan
from .config import KimiLinearConfig
from .model import KimiLinear


def plan(config: KimiLinearConfig) -> ModelPlan:
    """MLA by heads as DeepSeek-V3 (``wq``/``wq_b``, ``wkv_b`` column-wise, ``wo`` row-wise,
    latents replicated); KDA by heads: ``wq``, ``wk``, ``wv``, ``wf_b``, ``wb``, ``wg_b``
    column-wise, ``wo`` row-wise, the low-rank gate inputs ``wf_a``/``wg_a`` and the output norm
    replicated, ``dt_bias``/``A_log``/conv filters split with their heads; the dense blocks'
    SwiGLU as Llama; every MoE block expert-parallel."""
    c = config
    types = set(resolved_layer_types(c))
    col, row, rep, heads = [], [], [], []
    if "full_attention" in types:
        col += ["wq_b", "wkv_b"] if c.q_lora_rank else ["wq", "wkv_b"]
        row += ["wo"]
        rep += ["wq_a", "q_norm", "wkv_a", "kv_norm"] if c.q_lora_rank else ["wkv_a", "kv_norm"]
    if "linear_attention" in types:
        col += [n for n in ("wq", "wk", "wv", "wf_b", "wb", "wg_b") if n not in col]
        row += [n for n in ("wo",) if n not in row]
        rep += ["wf_a", "wg_a", "norm"]
        heads += ["conv_q.weight", "conv_k.weight", "conv_v.weight", "dt_bias", "A_log"]

    def each(names: list[str]) -> tuple[str, ...]:
        return tuple(f"layers.*.attention.{n}" for n in names)

    dense = any(c.is_dense(i) for i in range(c.num_layers))
    return decoder_plan(
        KimiLinear,
        config,
        colwise=(
            *each(col),
            *(("layers.*.feed_forward.w1", "layers.*.feed_forward.w3") if dense else ()),
        ),
        rowwise=(*each(row), *(("layers.*.feed_forward.w2",) if dense else ())),
        replicated=each(rep),
        head_sharded=each(heads),
        experts=tuple(f"layers.{i}.feed_forward" for i in range(c.num_layers) if not c.is_dense(i)),
    )
