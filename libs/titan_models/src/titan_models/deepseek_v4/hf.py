"""DeepSeek-V4 ↔ ``DeepseekV4ForCausalLM`` checkpoints.

Key layout: what transformers writes (``save_pretrained``: the reference names under
``model.``, ``head.weight``), and the official release's (the same without ``model.``,
``embed.weight``, ``hc_head_fn``...), recognised by its keys. Ours ↔ theirs:

- embedding / head / final norm: ``embed_tokens`` ↔ ``tok_embeddings``, ``head`` ↔ ``output``,
  ``norm`` ↔ ``norm.norm``, ``hc_head.hc_{fn,base,scale}`` ↔ ``norm.hc.{fn,base,scale}``;
- per block: ``attn_norm`` / ``ffn_norm``; ``hc_{attn,ffn}_{fn,base,scale}`` ↔
  ``{attn,ffn}_hc.{fn,base,scale}``;
- ``attn.{wq_a, q_norm, wq_b, wkv, norm, wo_a, wo_b}`` ↔ ``attention.{wq_a, q_norm, wq_b,
  wkv, kv_norm, wo_a, wo_b}``; ``attn.attn_sink`` (H,) ↔ ``attention.sinks.weight`` (H, 1);
  ``attn.compressor.{wkv, wgate, ape, norm}`` ↔ ``attention.compressor.{wkv, wgate,
  position_bias, norm}``; ``attn.indexer.{wq_b, weights_proj, compressor.*}`` ↔
  ``attention.indexer.*``;
- ``ffn.gate.weight`` ↔ ``router.gate.weight``; ``ffn.gate.bias`` (learned layers) ↔
  ``router.expert_bias``; ``ffn.gate.tid2eid`` (hash layers, int) ↔ ``router.expert_table``;
  ``ffn.experts.<e>.w1 / w3 / w2`` ↔ row ``e`` of ``experts.w_gate / w_up / w_down``;
  ``ffn.shared_experts.w1 / w3 / w2`` ↔ ``shared_experts.w_gate / w_up / w_down``.

Both RoPE layouts are interleaved (pairs of channels), as ours: no permutation. The
multi-token-prediction layers (``num_nextn_predict_layers``, ``mtp.*`` keys) are not modelled:
skipped with a warning, as transformers skips them. FP8 / FP4 tensors are refused by dtype.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Collection, Mapping
from typing import Any

import torch

from ..components import RopeConfig
from ..hf_adapter import HFAdapter, HFTensor, check_supported, required, rope_from_hf, rope_to_hf
from .config import CSA, HASH_MOE, HCA, LAYER_TYPES, MOE, SLIDING, DeepSeekV4Config

_LAYER = "model.layers.{}"
KEY_MAP: tuple[tuple[str, str], ...] = (
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("output.weight", "head.weight"),
    ("norm.norm.weight", "model.norm.weight"),
    ("norm.hc.fn", "model.hc_head.hc_fn"),
    ("norm.hc.base", "model.hc_head.hc_base"),
    ("norm.hc.scale", "model.hc_head.hc_scale"),
    ("layers.{}.attention_norm.weight", f"{_LAYER}.attn_norm.weight"),
    ("layers.{}.ffn_norm.weight", f"{_LAYER}.ffn_norm.weight"),
    *(
        (f"layers.{{}}.{ours}_hc.{part}", f"{_LAYER}.hc_{ours}_{part}")
        for ours in ("attn", "ffn")
        for part in ("fn", "base", "scale")
    ),
    *(
        (f"layers.{{}}.attention.{ours}.weight", f"{_LAYER}.attn.{hf}.weight")
        for ours, hf in (
            ("wq_a", "wq_a"),
            ("q_norm", "q_norm"),
            ("wq_b", "wq_b"),
            ("wkv", "wkv"),
            ("kv_norm", "norm"),
            ("wo_a", "wo_a"),
            ("wo_b", "wo_b"),
        )
    ),
    *(
        (f"layers.{{}}.attention.{where}.{ours}", f"{_LAYER}.attn.{where}.{hf}")
        for where in ("compressor", "indexer.compressor")
        for ours, hf in (
            ("wkv.weight", "wkv.weight"),
            ("wgate.weight", "wgate.weight"),
            ("position_bias", "ape"),
            ("norm.weight", "norm.weight"),
        )
    ),
    ("layers.{}.attention.indexer.wq_b.weight", f"{_LAYER}.attn.indexer.wq_b.weight"),
    (
        "layers.{}.attention.indexer.weights_proj.weight",
        f"{_LAYER}.attn.indexer.weights_proj.weight",
    ),
    ("layers.{}.feed_forward.router.gate.weight", f"{_LAYER}.ffn.gate.weight"),
    ("layers.{}.feed_forward.router.expert_table", f"{_LAYER}.ffn.gate.tid2eid"),
    ("layers.{}.feed_forward.experts.w_gate", f"{_LAYER}.ffn.experts.{{e}}.w1.weight"),
    ("layers.{}.feed_forward.experts.w_up", f"{_LAYER}.ffn.experts.{{e}}.w3.weight"),
    ("layers.{}.feed_forward.experts.w_down", f"{_LAYER}.ffn.experts.{{e}}.w2.weight"),
    *(
        (
            f"layers.{{}}.feed_forward.shared_experts.{ours}.weight",
            f"{_LAYER}.ffn.shared_experts.{hf}.weight",
        )
        for ours, hf in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2"))
    ),
)
"""Our FQNs ↔ transformers' on-disk keys (the selection bias and the sinks: ``hf_tensors``)."""

_REFERENCE = "_titan_v4_reference_names"
"""Set by ``adapt_to_checkpoint`` for a checkpoint in the official release's naming."""
_BIAS = re.compile(r"layers\.(\d+)\.feed_forward\.router\.expert_bias")
_SINKS = re.compile(r"layers\.(\d+)\.attention\.sinks\.weight")
_COMPRESS_RATIOS = {0: SLIDING, 4: CSA, 128: HCA}


class DeepSeekV4HFAdapter(HFAdapter[DeepSeekV4Config]):
    """``model_type: deepseek_v4``."""

    model_types = ("deepseek_v4",)
    architecture = "DeepseekV4ForCausalLM"
    key_map = KEY_MAP
    ignored_hf_keys = (r"(.*\.)?rotary_emb\..*", r"(model\.)?mtp\..*")

    def adapt_to_checkpoint(self, hf: Mapping[str, Any], keys: Collection[str]) -> dict[str, Any]:
        hf = super().adapt_to_checkpoint(hf, keys)
        if "embed.weight" in keys:
            hf[_REFERENCE] = True
        return hf

    def config_from_hf(self, hf: Mapping[str, Any]) -> DeepSeekV4Config:
        """Our config; ``ValueError`` naming any field we do not model."""
        # Partial RoPE is modelled (rope_dim); the window applies to every layer.
        check_supported(
            hf,
            sliding_window=True,
            allowed={"partial_rotary_factor": (hf.get("partial_rotary_factor"),)},
        )
        _refuse(hf, "num_key_value_heads", (1, None), "one shared K=V head")
        _refuse(hf, "n_shared_experts", (1, None), "transformers builds exactly one")
        _refuse(hf, "norm_topk_prob", (True, None), "DeepSeek-V4 always renormalises")
        _refuse(hf, "router_jitter_noise", (0, 0.0, None), "no jitter")
        _refuse(hf, "topk_method", ("noaux_tc", None), "top-k of scores + selection bias")
        if hf.get("num_nextn_predict_layers"):
            warnings.warn(
                f"HF config field num_nextn_predict_layers={hf['num_nextn_predict_layers']}: "
                "DeepSeek-V4's multi-token-prediction layers are not modelled and not loaded "
                "(transformers skips them too)",
                stacklevel=3,
            )
        n = required(hf, "num_hidden_layers")
        head_dim = required(hf, "head_dim")
        rope_dim = hf.get("qk_rope_head_dim") or int(
            head_dim * (hf.get("partial_rotary_factor") or 64 / 512)
        )
        rates = dict(hf.get("compress_rates") or {})
        csa = hf.get("compress_rate_csa") or rates.get(CSA, 4)
        hca = hf.get("compress_rate_hca") or rates.get(HCA, 128)
        max_pos = hf.get("max_position_embeddings") or 1_048_576
        main, compress = _ropes(hf, max_pos)
        experts = hf.get("n_routed_experts") or required(hf, "num_local_experts")
        score = hf.get("scoring_func", "sqrtsoftplus")
        if score not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ValueError(
                f"HF config field scoring_func={score!r} is not supported (supported: "
                "'sqrtsoftplus', 'sigmoid', 'softmax')"
            )
        return DeepSeekV4Config(
            vocab_size=required(hf, "vocab_size"),
            dim=required(hf, "hidden_size"),
            num_layers=n,
            num_heads=required(hf, "num_attention_heads"),
            num_kv_heads=1,
            head_dim=head_dim,
            ffn_hidden_dim=required(hf, "moe_intermediate_size"),
            rope=main,
            max_seq_len=max_pos,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=hf.get("initializer_range", 0.02),
            sliding_window=hf.get("sliding_window") or 128,
            rope_dim=rope_dim,
            compress_rope=compress,
            q_lora_rank=required(hf, "q_lora_rank"),
            o_groups=required(hf, "o_groups"),
            o_lora_rank=required(hf, "o_lora_rank"),
            layer_types=_layer_types(hf, n),
            csa_rate=csa,
            hca_rate=hca,
            index_heads=required(hf, "index_n_heads"),
            index_head_dim=required(hf, "index_head_dim"),
            index_topk=required(hf, "index_topk"),
            hc_mult=hf.get("hc_mult", 4),
            hc_sinkhorn_iters=hf.get("hc_sinkhorn_iters", 20),
            hc_eps=hf.get("hc_eps", 1e-6),
            num_experts=experts,
            num_experts_per_tok=required(hf, "num_experts_per_tok"),
            moe_hidden_dim=required(hf, "moe_intermediate_size"),
            num_shared_experts=1,
            score_func=score,
            route_scale=float(hf.get("routed_scaling_factor", 1.5)),
            mlp_layer_types=_mlp_layer_types(hf, n),
            swiglu_limit=float(hf.get("swiglu_limit", 10.0)),
        )

    def config_to_hf(self, config: DeepSeekV4Config) -> dict[str, Any]:
        c = config
        factor = c.rope_dim / c.head_dim
        main = {"rope_type": "default", "rope_theta": c.rope.theta, "partial_rotary_factor": factor}
        if c.rope.scaling is not None:
            raise ValueError(
                "DeepSeekV4Config.rope (the sliding layers' RoPE) must be unscaled to be written "
                f"as an HF checkpoint, got {c.rope.scaling!r}"
            )
        compress = rope_to_hf(c.compress_rope)["rope_scaling"] or {"rope_type": "default"}
        compress = {
            **compress,
            "rope_theta": c.compress_rope.theta,
            "partial_rotary_factor": factor,
        }
        return {
            "architectures": [self.architecture],
            "model_type": self.model_types[0],
            "vocab_size": c.vocab_size,
            "hidden_size": c.dim,
            "moe_intermediate_size": c.moe_hidden_dim,
            "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads,
            "num_key_value_heads": 1,
            "head_dim": c.head_dim,
            "q_lora_rank": c.q_lora_rank,
            "partial_rotary_factor": factor,
            "num_experts_per_tok": c.num_experts_per_tok,
            "n_routed_experts": c.num_experts,
            "n_shared_experts": 1,
            "scoring_func": c.score_func,
            "norm_topk_prob": True,
            "routed_scaling_factor": c.route_scale,
            "max_position_embeddings": c.max_seq_len,
            "rope_theta": c.rope.theta,
            "compress_rope_theta": c.compress_rope.theta,
            "rope_parameters": {"main": main, "compress": compress},
            "layer_types": list(c.layer_types),
            "compress_rates": {CSA: c.csa_rate, HCA: c.hca_rate},
            "hc_mult": c.hc_mult,
            "hc_sinkhorn_iters": c.hc_sinkhorn_iters,
            "hc_eps": c.hc_eps,
            "mlp_layer_types": list(c.mlp_layer_types),
            "swiglu_limit": c.swiglu_limit,
            "sliding_window": c.sliding_window,
            "o_groups": c.o_groups,
            "o_lora_rank": c.o_lora_rank,
            "index_n_heads": c.index_heads,
            "index_head_dim": c.index_head_dim,
            "index_topk": c.index_topk,
            "num_nextn_predict_layers": 0,
            "hidden_act": "silu",
            "initializer_range": c.init_std,
            "rms_norm_eps": c.norm_eps,
            "tie_word_embeddings": c.tie_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
        }

    def hf_tensors(
        self, fqn: str, param: torch.Tensor, hf_config: Mapping[str, Any]
    ) -> list[HFTensor]:
        bias, sinks = _BIAS.fullmatch(fqn), _SINKS.fullmatch(fqn)
        if bias:  # learned layers store their selection bias; hash layers have none
            n = hf_config["num_hidden_layers"]
            if _mlp_layer_types(hf_config, n)[int(bias[1])] == HASH_MOE:
                return []
            tensors = [HFTensor(f"{_LAYER.format(bias[1])}.ffn.gate.bias", param)]
        elif sinks:
            tensors = [
                HFTensor(
                    f"{_LAYER.format(sinks[1])}.attn.attn_sink",
                    param,
                    to_hf=lambda w: w.reshape(-1),
                    from_hf=lambda t: t.reshape(-1, 1),
                )
            ]
        else:
            tensors = super().hf_tensors(fqn, param, hf_config)
        if hf_config.get(_REFERENCE):
            tensors = [_renamed(ht, _reference_key(ht.key)) for ht in tensors]
        return tensors


def _reference_key(key: str) -> str:
    """transformers' on-disk key → the official release's."""
    key = key.removeprefix("model.")
    if key == "embed_tokens.weight":
        return "embed.weight"
    return re.sub(r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1", key)


def _renamed(ht: HFTensor, key: str) -> HFTensor:
    return HFTensor(key, ht.ours, to_hf=ht.to_hf, from_hf=ht.from_hf, shape=ht.shape, put=ht.put)


def _refuse(hf: Mapping[str, Any], name: str, allowed: tuple[Any, ...], why: str) -> None:
    if name in hf and hf[name] not in allowed:
        raise ValueError(
            f"HF config field {name}={hf[name]!r} is not supported ({why}; supported: "
            f"{', '.join(repr(a) for a in allowed if a is not None)})"
        )


def _layer_types(hf: Mapping[str, Any], n: int) -> tuple[str, ...]:
    types = hf.get("layer_types")
    if types is None and hf.get("compress_ratios") is not None:
        ratios = list(hf["compress_ratios"])[:n]
        unknown = sorted({r for r in ratios if r not in _COMPRESS_RATIOS})
        if unknown:
            raise ValueError(
                f"HF config field compress_ratios has {unknown} (supported: 0, 4, 128)"
            )
        types = [_COMPRESS_RATIOS[r] for r in ratios]
    if types is None:  # transformers' default: two HCA layers, then HCA / CSA alternating
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    types = tuple(types)[:n]
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad or len(types) != n:
        raise ValueError(
            f"HF config field layer_types={list(types)} is not supported (one of "
            f"{list(LAYER_TYPES)} per layer)"
        )
    return types


def _mlp_layer_types(hf: Mapping[str, Any], n: int) -> tuple[str, ...]:
    types = hf.get("mlp_layer_types")
    if types is None:
        hashed = hf.get("num_hash_layers", 3)
        types = [HASH_MOE] * min(n, hashed) + [MOE] * max(0, n - hashed)
    types = tuple(types)[:n]
    bad = sorted(set(types) - {HASH_MOE, MOE})
    if bad or len(types) != n:
        raise ValueError(
            f"HF config field mlp_layer_types={list(types)} is not supported (one of "
            f"{[HASH_MOE, MOE]} per layer)"
        )
    return types


def _ropes(hf: Mapping[str, Any], max_pos: int) -> tuple[RopeConfig, RopeConfig]:
    """(plain RoPE of the sliding layers, RoPE of the compressed layers)."""
    params = dict(hf.get("rope_parameters") or {})
    if isinstance(params.get("main"), Mapping) and isinstance(params.get("compress"), Mapping):
        main, compress = dict(params["main"]), dict(params["compress"])
    else:  # legacy: top-level scaling for the compressed layers, two thetas
        flat = {k: v for k, v in (params or dict(hf.get("rope_scaling") or {})).items()}
        main = {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10_000.0)}
        compress = {**flat, "rope_theta": hf.get("compress_rope_theta", 160_000.0)}
        compress.setdefault("rope_type", flat.get("type", "default"))
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
    out = []
    for which, sub in (("main", main), ("compress", compress)):
        sub.pop("partial_rotary_factor", None)  # the rotated width is rope_dim
        try:
            out.append(rope_from_hf({"rope_parameters": sub}, max_position_embeddings=max_pos))
        except ValueError as error:
            raise ValueError(f"HF config field rope_parameters.{which}: {error}") from None
    return out[0], out[1]
