"""Kimi Linear ↔ Hugging Face checkpoints (``model_type: kimi_linear``).

Both config spellings load: the published one (``linear_attn_config`` with 1-indexed
``full_attn_layers`` / ``kda_layers``, ``first_k_dense_replace``) and the one transformers
writes (``layer_types``, ``mlp_layer_types``, ``linear_num_heads``, ...); ``to_hf`` writes both.

- MLA: ``self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}, kv_a_proj_with_mqa,
  kv_a_layernorm, kv_b_proj, o_proj`` as DeepSeek-V3 but with no rope rows to permute (NoPE).
- KDA: ``self_attn.{q,k,v}_proj → wq, wk, wv``, ``{q,k,v}_conv1d → conv_{q,k,v}``,
  ``f_a_proj, f_b_proj → wf_a, wf_b``, ``dt_bias``, ``A_log`` (stored ``(1, 1, H, 1)``, ours
  ``(H,)``), ``b_proj → wb``, ``g_a_proj, g_b_proj → wg_a, wg_b``, ``o_norm → norm``,
  ``o_proj → wo``.
- MoE: ``block_sparse_moe.gate.{weight, e_score_correction_bias}``, per-expert
  ``block_sparse_moe.experts.<e>.{w1, w3, w2}`` (gate, up, down) ↔ row ``e`` of our stacked
  experts, ``block_sparse_moe.shared_experts.*``; the dense first blocks ``mlp.*`` (transformers
  writes them as ``block_sparse_moe.*``: that loads too).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from ..components.linear_attention.layer_types import LAYER_TYPES, resolved_layer_types
from ..deepseek_v3.hf import MLA_KEY_MAP
from ..hf_adapter import (
    MLP_KEY_MAP,
    STACK_KEY_MAP,
    HFAdapter,
    HFTensor,
    check_supported,
    required,
)
from .config import KimiLinearConfig

DENSE_AS_MOE = "_titan_dense_as_block_sparse_moe"
"""Key ``adapt_to_checkpoint`` sets when the dense blocks are stored as ``block_sparse_moe``."""

_ATTN = "model.layers.{}.self_attn."
_MOE = "model.layers.{}.block_sparse_moe."
KDA_KEY_MAP: tuple[tuple[str, str], ...] = (
    ("layers.{}.attention.wk.weight", _ATTN + "k_proj.weight"),
    ("layers.{}.attention.wv.weight", _ATTN + "v_proj.weight"),
    ("layers.{}.attention.conv_q.weight", _ATTN + "q_conv1d.weight"),
    ("layers.{}.attention.conv_k.weight", _ATTN + "k_conv1d.weight"),
    ("layers.{}.attention.conv_v.weight", _ATTN + "v_conv1d.weight"),
    ("layers.{}.attention.wf_a.weight", _ATTN + "f_a_proj.weight"),
    ("layers.{}.attention.wf_b.weight", _ATTN + "f_b_proj.weight"),
    ("layers.{}.attention.dt_bias", _ATTN + "dt_bias"),
    ("layers.{}.attention.A_log", _ATTN + "A_log"),
    ("layers.{}.attention.wb.weight", _ATTN + "b_proj.weight"),
    ("layers.{}.attention.wg_a.weight", _ATTN + "g_a_proj.weight"),
    ("layers.{}.attention.wg_b.weight", _ATTN + "g_b_proj.weight"),
    ("layers.{}.attention.norm.weight", _ATTN + "o_norm.weight"),
)
"""``KimiDeltaAttention`` ↔ HF's KDA ``self_attn`` (``wq``/``wo`` are MLA's ``q_proj``/``o_proj``)."""

KIMI_MOE_KEY_MAP: tuple[tuple[str, str], ...] = (
    ("layers.{}.feed_forward.router.gate.weight", _MOE + "gate.weight"),
    ("layers.{}.feed_forward.router.expert_bias", _MOE + "gate.e_score_correction_bias"),
    ("layers.{}.feed_forward.experts.w_gate", _MOE + "experts.{e}.w1.weight"),
    ("layers.{}.feed_forward.experts.w_up", _MOE + "experts.{e}.w3.weight"),
    ("layers.{}.feed_forward.experts.w_down", _MOE + "experts.{e}.w2.weight"),
    (
        "layers.{}.feed_forward.shared_experts.w_gate.weight",
        _MOE + "shared_experts.gate_proj.weight",
    ),
    ("layers.{}.feed_forward.shared_experts.w_up.weight", _MOE + "shared_experts.up_proj.weight"),
    (
        "layers.{}.feed_forward.shared_experts.w_down.weight",
        _MOE + "shared_experts.down_proj.weight",
    ),
)
"""``dist_moe.MoE`` ↔ Kimi's ``block_sparse_moe`` (Mixtral-style ``w1``/``w3``/``w2`` experts)."""


class KimiLinearHFAdapter(HFAdapter[KimiLinearConfig]):
    """``model_type: kimi_linear`` with sigmoid routing and NoPE MLA."""

    model_types = ("kimi_linear",)
    architecture = "KimiLinearForCausalLM"
    key_map = STACK_KEY_MAP + MLA_KEY_MAP + KDA_KEY_MAP + MLP_KEY_MAP + KIMI_MOE_KEY_MAP

    def adapt_to_checkpoint(self, hf: Mapping[str, Any], keys: Collection[str]) -> dict[str, Any]:
        """Marks dense blocks stored under ``block_sparse_moe`` (how transformers saves them);
        refuses transformers' fused in-memory expert layout."""
        hf = dict(hf)
        if any(k.endswith((".experts.gate_up_proj", ".experts.down_proj")) for k in keys):
            raise ValueError(
                "kimi_linear checkpoints with fused experts (experts.gate_up_proj) are not "
                "supported; save with per-expert keys (save_original_format=True)"
            )
        if any(k.endswith("block_sparse_moe.gate_proj.weight") for k in keys):
            hf[DENSE_AS_MOE] = True
        return hf

    def config_from_hf(self, hf: Mapping[str, Any]) -> KimiLinearConfig:
        """Our config; ``ValueError`` naming any field we do not model."""
        check_supported(hf, layer_types=LAYER_TYPES)
        for name, allowed in (
            ("moe_router_activation_func", ("sigmoid", None)),
            ("mla_use_nope", (True, None)),
            ("moe_layer_freq", (1, None)),
            ("num_nextn_predict_layers", (0, None)),
        ):
            if hf.get(name) not in allowed:
                raise ValueError(
                    f"HF config field {name}={hf[name]!r} is not supported (supported: "
                    f"{allowed[0]!r})"
                )
        layers = required(hf, "num_hidden_layers")
        heads = required(hf, "num_attention_heads")
        kv_heads = hf.get("num_key_value_heads") or heads
        if kv_heads != heads:
            raise ValueError(
                f"HF config field num_key_value_heads={kv_heads!r} is not supported (MLA: must "
                f"equal num_attention_heads={heads})"
            )
        linear = hf.get("linear_attn_config") or {}
        first_dense, mlp_types = _mlp_layer_types(hf, layers)
        nope, rope = required(hf, "qk_nope_head_dim"), required(hf, "qk_rope_head_dim")
        max_pos = hf.get("model_max_length") or hf.get("max_position_embeddings") or 1_048_576
        return KimiLinearConfig(
            vocab_size=required(hf, "vocab_size"),
            dim=required(hf, "hidden_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=nope + rope,
            ffn_hidden_dim=required(hf, "intermediate_size"),
            max_seq_len=max_pos,
            norm_eps=hf.get("rms_norm_eps", 1e-5),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=hf.get("initializer_range", 0.02),
            q_lora_rank=hf.get("q_lora_rank") or 0,
            kv_lora_rank=required(hf, "kv_lora_rank"),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=required(hf, "v_head_dim"),
            num_experts=_first(hf, "num_experts", "num_local_experts", "n_routed_experts"),
            num_experts_per_tok=_first(hf, "num_experts_per_token", "num_experts_per_tok"),
            moe_hidden_dim=required(hf, "moe_intermediate_size"),
            num_shared_experts=_first(hf, "num_shared_experts", "n_shared_experts", default=0),
            first_k_dense=first_dense,
            mlp_layer_types=mlp_types,
            num_expert_groups=_first(hf, "num_expert_group", "n_group", default=1),
            topk_groups=hf.get("topk_group") or 1,
            route_scale=float(hf.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(_first(hf, "moe_renormalize", "norm_topk_prob", default=True)),
            layer_types=_layer_types(hf, layers),
            linear_num_heads=linear.get("num_heads") or required(hf, "linear_num_heads"),
            linear_head_dim=linear.get("head_dim") or required(hf, "linear_head_dim"),
            linear_conv_kernel_dim=linear.get("short_conv_kernel_size")
            or hf.get("linear_conv_kernel_dim", 4),
        )

    def config_to_hf(self, config: KimiLinearConfig) -> dict[str, Any]:
        c = config
        types = resolved_layer_types(c)
        return {
            "architectures": [self.architecture],
            "model_type": self.model_types[0],
            "vocab_size": c.vocab_size,
            "hidden_size": c.dim,
            "intermediate_size": c.ffn_hidden_dim,
            "moe_intermediate_size": c.moe_hidden_dim,
            "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_heads,
            "num_experts": c.num_experts,
            "num_experts_per_token": c.num_experts_per_tok,
            "num_shared_experts": c.num_shared_experts,
            "num_expert_group": c.num_expert_groups,
            "topk_group": c.topk_groups,
            "moe_renormalize": c.norm_topk_prob,
            "routed_scaling_factor": c.route_scale,
            "moe_router_activation_func": "sigmoid",
            "moe_layer_freq": 1,
            **_mlp_layer_types_to_hf(c),
            "kv_lora_rank": c.kv_lora_rank,
            "q_lora_rank": c.q_lora_rank or None,
            "qk_nope_head_dim": c.qk_nope_head_dim,
            "qk_rope_head_dim": c.qk_rope_head_dim,
            "v_head_dim": c.v_head_dim,
            "mla_use_nope": True,
            "layer_types": list(types),
            "linear_num_heads": c.linear_num_heads,
            "linear_head_dim": c.linear_head_dim,
            "linear_conv_kernel_dim": c.linear_conv_kernel_dim,
            "linear_attn_config": {
                "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
                "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
                "num_heads": c.linear_num_heads,
                "head_dim": c.linear_head_dim,
                "short_conv_kernel_size": c.linear_conv_kernel_dim,
            },
            "hidden_act": "silu",
            "model_max_length": c.max_seq_len,
            "rms_norm_eps": c.norm_eps,
            "initializer_range": c.init_std,
            "tie_word_embeddings": c.tie_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            # transformers' defaults are the real vocabulary's ids: out of range of a small one.
            "pad_token_id": None,
            "bos_token_id": None,
            "eos_token_id": None,
        }

    def hf_tensors(
        self, fqn: str, param: torch.Tensor, hf_config: Mapping[str, Any]
    ) -> list[HFTensor]:
        tensors = super().hf_tensors(fqn, param, hf_config)
        if fqn.endswith(".attention.A_log"):
            return [
                HFTensor(
                    ht.key,
                    ht.ours,
                    to_hf=lambda w: w.view(1, 1, -1, 1),
                    from_hf=lambda w: w.reshape(-1),
                )
                for ht in tensors
            ]
        if hf_config.get(DENSE_AS_MOE) and ".feed_forward.w" in fqn:
            return [
                HFTensor(ht.key.replace(".mlp.", ".block_sparse_moe."), ht.ours) for ht in tensors
            ]
        return tensors


def _first(hf: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    """The first of ``names`` the HF config sets (spellings differ between writers)."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    if default is None:
        raise ValueError(f"HF config field {names[0]} is missing")
    return default


def _layer_types(hf: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    types = hf.get("layer_types")
    linear = hf.get("linear_attn_config") or {}
    if types is None and "full_attn_layers" in linear:
        full = set(linear["full_attn_layers"])  # 1-indexed in the published config
        types = ["full_attention" if i + 1 in full else "linear_attention" for i in range(layers)]
    if types is None:  # transformers' default pattern
        types = [
            "full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)
        ]
    if len(types) != layers:
        raise ValueError(
            f"HF config field layer_types has {len(types)} entries, num_hidden_layers={layers}"
        )
    return tuple(types)


def _mlp_layer_types(hf: Mapping[str, Any], layers: int) -> tuple[int, tuple[str, ...]]:
    """``(first_k_dense, mlp_layer_types)``: the leading dense blocks, and the per-layer list
    when the dense blocks are not just a prefix (empty otherwise)."""
    kinds = hf.get("mlp_layer_types")
    if kinds is None:
        return int(hf.get("first_k_dense_replace", 1)), ()
    if len(kinds) != layers or any(k not in ("dense", "sparse") for k in kinds):
        raise ValueError(
            f"HF config field mlp_layer_types={list(kinds)!r} is not supported (supported: "
            f"'dense' or 'sparse' for each of the num_hidden_layers={layers} layers)"
        )
    dense = 0
    while dense < len(kinds) and kinds[dense] == "dense":
        dense += 1
    return dense, () if all(k == "sparse" for k in kinds[dense:]) else tuple(kinds)


def _mlp_layer_types_to_hf(c: KimiLinearConfig) -> dict[str, Any]:
    """``mlp_layer_types`` spelled out, and ``first_k_dense_replace`` (the leading dense
    blocks) as the original config names them."""
    kinds = ["dense" if c.is_dense(i) else "sparse" for i in range(c.num_layers)]
    leading = next((i for i, k in enumerate(kinds) if k != "dense"), len(kinds))
    return {"first_k_dense_replace": leading, "mlp_layer_types": kinds}
