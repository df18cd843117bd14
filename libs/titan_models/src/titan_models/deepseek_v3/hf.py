"""DeepSeek-V3 ↔ ``DeepseekV3ForCausalLM`` checkpoints (the Hub's DeepSeek-V3 layout).

- MLA: ``self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}, kv_a_proj_with_mqa,
  kv_a_layernorm, kv_b_proj, o_proj`` ↔ ``attention.{wq | wq_a, q_norm, wq_b}, wkv_a, kv_norm,
  wkv_b, wo``. With ``rope_interleave`` (the Hub default) the rope rows of ``q_(b_)proj`` and
  ``kv_a_proj_with_mqa`` hold each rotation pair side by side; ours hold the rotate-half layout,
  so those rows are permuted on the way in and back on the way out (attention scores are
  unchanged: queries and keys move together).
- MoE: router ``mlp.gate.weight`` + ``e_score_correction_bias`` (our ``expert_bias`` buffer),
  per-expert ``mlp.experts.<e>.*`` ↔ row ``e`` of our stacked experts, ``mlp.shared_experts``.
- MTP module k is HF layer ``num_hidden_layers + k``: its block keys, ``enorm``, ``hnorm``,
  ``eh_proj``, ``shared_head.norm``, and copies of the embedding and head (``embed_tokens``,
  ``shared_head.head``), written on save, shared with ours on load. transformers itself drops
  these layers and writes ``num_nextn_predict_layers`` without them: such a checkpoint loads
  with as many MTP modules as it holds.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

import torch

from ..hf_adapter import (
    MLP_KEY_MAP,
    MOE_KEY_MAP,
    STACK_KEY_MAP,
    HFAdapter,
    HFTensor,
    check_supported,
    required,
    rope_from_hf,
    rope_to_hf,
)
from .config import DeepSeekV3Config

MLA_KEY_MAP: tuple[tuple[str, str], ...] = (
    ("layers.{}.attention.wq.weight", "model.layers.{}.self_attn.q_proj.weight"),
    ("layers.{}.attention.wq_a.weight", "model.layers.{}.self_attn.q_a_proj.weight"),
    ("layers.{}.attention.q_norm.weight", "model.layers.{}.self_attn.q_a_layernorm.weight"),
    ("layers.{}.attention.wq_b.weight", "model.layers.{}.self_attn.q_b_proj.weight"),
    ("layers.{}.attention.wkv_a.weight", "model.layers.{}.self_attn.kv_a_proj_with_mqa.weight"),
    ("layers.{}.attention.kv_norm.weight", "model.layers.{}.self_attn.kv_a_layernorm.weight"),
    ("layers.{}.attention.wkv_b.weight", "model.layers.{}.self_attn.kv_b_proj.weight"),
    ("layers.{}.attention.wo.weight", "model.layers.{}.self_attn.o_proj.weight"),
)
"""``MultiHeadLatentAttention`` ↔ HF's MLA ``self_attn``."""

_MTP_OWN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
_ROTATED = re.compile(r"layers\.\d+\.attention\.(wq|wq_b|wkv_a)\.weight")


def _rope_rows(rows: int, group: int, nope: int, rope: int) -> torch.Tensor:
    """Row order that turns interleaved rope rows (pairs side by side) into rotate-half ones,
    in each of ``rows // group`` groups of ``nope`` plain rows followed by ``rope`` rope rows."""
    within = torch.cat(
        [torch.arange(nope), nope + torch.arange(0, rope, 2), nope + torch.arange(1, rope, 2)]
    )
    return (torch.arange(0, rows, group)[:, None] + within).flatten()


def _permuted(ht: HFTensor, order: torch.Tensor) -> HFTensor:
    inverse = torch.argsort(order)
    return HFTensor(
        ht.key,
        ht.ours,
        to_hf=lambda w: w[inverse.to(w.device)],
        from_hf=lambda w: w[order.to(w.device)],
    )


class DeepSeekV3HFAdapter(HFAdapter[DeepSeekV3Config]):
    """``model_type: deepseek_v3`` with ``noaux_tc`` (sigmoid, group-limited) routing."""

    model_types = ("deepseek_v3",)
    architecture = "DeepseekV3ForCausalLM"
    key_map = STACK_KEY_MAP + MLA_KEY_MAP + MLP_KEY_MAP + MOE_KEY_MAP

    def adapt_to_checkpoint(self, hf: Mapping[str, Any], keys: Collection[str]) -> dict[str, Any]:
        """As the base; and count only the MTP layers whose weights the checkpoint holds."""
        hf = super().adapt_to_checkpoint(hf, keys)
        layers = hf.get("num_hidden_layers")
        declared = _mtp_count(hf)
        if isinstance(layers, int) and declared:
            present = {int(m[1]) for k in keys if (m := re.match(r"model\.layers\.(\d+)\.", k))}
            held = 0
            while held < declared and layers + held in present:
                held += 1
            hf["num_nextn_predict_layers"] = held
            hf.pop("num_mtp_layers", None)
        return hf

    def config_from_hf(self, hf: Mapping[str, Any]) -> DeepSeekV3Config:
        """Our config; ``ValueError`` naming a routing method or feature we do not model."""
        check_supported(hf)
        for name, allowed in (
            ("topk_method", ("noaux_tc",)),
            ("scoring_func", ("sigmoid",)),
            ("moe_layer_freq", (1,)),
        ):
            if name in hf and hf[name] not in allowed:
                raise ValueError(
                    f"HF config field {name}={hf[name]!r} is not supported (supported: "
                    f"{', '.join(map(repr, allowed))})"
                )
        heads = required(hf, "num_attention_heads")
        kv_heads = hf.get("num_key_value_heads") or heads
        if kv_heads != heads:
            raise ValueError(
                f"HF config field num_key_value_heads={kv_heads!r} is not supported (MLA: must "
                f"equal num_attention_heads={heads})"
            )
        nope, rope = required(hf, "qk_nope_head_dim"), required(hf, "qk_rope_head_dim")
        max_pos = hf.get("max_position_embeddings") or 4096
        return DeepSeekV3Config(
            vocab_size=required(hf, "vocab_size"),
            dim=required(hf, "hidden_size"),
            num_layers=required(hf, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=nope + rope,
            ffn_hidden_dim=required(hf, "intermediate_size"),
            rope=rope_from_hf(hf, max_position_embeddings=max_pos),
            max_seq_len=max_pos,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=hf.get("initializer_range", 0.02),
            q_lora_rank=hf.get("q_lora_rank") or 0,
            kv_lora_rank=required(hf, "kv_lora_rank"),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=required(hf, "v_head_dim"),
            num_experts=hf.get("n_routed_experts") or required(hf, "num_local_experts"),
            num_experts_per_tok=required(hf, "num_experts_per_tok"),
            moe_hidden_dim=required(hf, "moe_intermediate_size"),
            num_shared_experts=hf.get("n_shared_experts") or 0,
            first_k_dense=hf.get("first_k_dense_replace") or 0,
            num_expert_groups=hf.get("n_group") or 1,
            topk_groups=hf.get("topk_group") or 1,
            route_scale=float(hf.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            num_mtp_modules=_mtp_count(hf),
        )

    def config_to_hf(self, config: DeepSeekV3Config) -> dict[str, Any]:
        c = config
        if c.sliding_window is not None:
            raise ValueError(
                f"DeepSeekV3Config.sliding_window={c.sliding_window} cannot be written as an HF "
                "deepseek_v3 checkpoint (no sliding window there)"
            )
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
            "n_shared_experts": c.num_shared_experts,
            "n_routed_experts": c.num_experts,
            "num_experts_per_tok": c.num_experts_per_tok,
            "routed_scaling_factor": c.route_scale,
            "kv_lora_rank": c.kv_lora_rank,
            "q_lora_rank": c.q_lora_rank or None,
            "qk_rope_head_dim": c.qk_rope_head_dim,
            "qk_nope_head_dim": c.qk_nope_head_dim,
            "v_head_dim": c.v_head_dim,
            "head_dim": c.qk_rope_head_dim,  # what transformers stores (the rotary width)
            "n_group": c.num_expert_groups,
            "topk_group": c.topk_groups,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": c.norm_topk_prob,
            "first_k_dense_replace": c.first_k_dense,
            "moe_layer_freq": 1,
            "num_nextn_predict_layers": c.num_mtp_modules,
            "hidden_act": "silu",
            "max_position_embeddings": c.max_seq_len,
            "rms_norm_eps": c.norm_eps,
            "initializer_range": c.init_std,
            **rope_to_hf(c.rope),
            "rope_interleave": True,
            "tie_word_embeddings": c.tie_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
        }

    def hf_tensors(
        self, fqn: str, param: torch.Tensor, hf_config: Mapping[str, Any]
    ) -> list[HFTensor]:
        layers = hf_config["num_hidden_layers"]
        mtp = re.fullmatch(r"mtp\.(\d+)\.(.+)", fqn)
        if mtp:
            layer, rest = layers + int(mtp[1]), mtp[2]
            if rest in _MTP_OWN:
                return [HFTensor(f"model.layers.{layer}.{_MTP_OWN[rest]}", param)]
            fqn = f"layers.{layer}.{rest}"  # the MTP block is named like a trunk block
        tensors = super().hf_tensors(fqn, param, hf_config)
        copies = {"tok_embeddings.weight": "embed_tokens", "output.weight": "shared_head.head"}
        if fqn in copies:
            tensors += [
                HFTensor(f"model.layers.{layers + k}.{copies[fqn]}.weight", param)
                for k in range(_mtp_count(hf_config))
            ]
        rotated = _ROTATED.fullmatch(fqn)
        if rotated and hf_config.get("rope_interleave", True):
            nope, rope = hf_config["qk_nope_head_dim"], hf_config["qk_rope_head_dim"]
            if rotated[1] == "wkv_a":  # one group: the kv latent, then the shared rope key
                nope = hf_config["kv_lora_rank"]
            order = _rope_rows(param.shape[0], nope + rope, nope, rope)
            tensors = [_permuted(ht, order) for ht in tensors]
        return tensors


def _mtp_count(hf: Mapping[str, Any]) -> int:
    return int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0)
