"""How a family's parameters and config map to Hugging Face's format.

An adapter describes, for each of our parameters, the HF tensors it is made of as *views into
the parameter* (``HFTensor``). That one description drives loading (copy each HF tensor into
its view), saving (write each view) and validation (evaluated on the meta device it yields
every expected key and shape without allocating). A one-to-one rename is one view, the whole
parameter; the per-expert tensors of a stacked ``(E, ...)`` expert weight are ``param[e]`` (an
HF template with ``{e}``); a permuted layout supplies ``to_hf`` / ``from_hf`` transforms. Our
persistent buffers (a router's selection bias) are described the same way; one that HF does not
store maps to no tensor and is zero after loading.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch

from .components import Llama3RopeScaling, RopeConfig, TransformerConfig, YarnRopeScaling


@dataclass(frozen=True, slots=True)
class HFTensor:
    """One tensor of an HF checkpoint and where it lives in our model."""

    key: str
    """Its name in the HF state dict."""
    ours: torch.Tensor
    """A view into our parameter holding exactly this tensor's values."""
    to_hf: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Our layout → HF's (``None``: identical)."""
    from_hf: Callable[[torch.Tensor], torch.Tensor] | None = None
    """HF's layout → ours (``None``: identical)."""
    shape: tuple[int, ...] | None = None
    """The checkpoint tensor's shape when it holds more than this view: a fused tensor split
    over several of our parameters (written only when every part has a ``put``)."""
    put: Callable[[torch.Tensor, torch.Tensor], object] | None = None
    """For a fused tensor: ``put(full, ours)`` copies this view (our layout) into its place in
    the full HF tensor, so ``to_hf`` can assemble the tensor from its parts."""

    def hf_shape(self) -> tuple[int, ...]:
        """Shape of the tensor in the checkpoint (free on the meta device)."""
        if self.shape is not None:
            return self.shape
        return tuple((self.to_hf(self.ours) if self.to_hf else self.ours).shape)


_C = TypeVar("_C", bound=TransformerConfig)


class HFAdapter(Generic[_C]):
    """Base of a family's adapter (``_C``: the family's config class); subclasses set the class
    attributes and the config mapping."""

    model_types: ClassVar[tuple[str, ...]]
    """HF ``model_type`` values this adapter reads."""
    architecture: ClassVar[str]
    """HF ``architectures[0]`` written by ``to_hf``."""
    key_map: ClassVar[tuple[tuple[str, str], ...]]
    """(our FQN template, HF key template); ``{}`` stands for the layer index, ``{e}`` (HF side)
    for the expert index of a stacked expert weight, and an empty HF template for a tensor HF
    does not store."""
    ignored_hf_keys: ClassVar[tuple[str, ...]] = (r"(.*\.)?rotary_emb\.inv_freq",)
    """Regexes of checkpoint keys that carry nothing we load (old RoPE buffers)."""

    def __init__(self) -> None:
        self._to_hf = [(_template_regex(ours), hf) for ours, hf in self.key_map]

    def config_from_hf(self, hf: Mapping[str, Any]) -> _C:
        raise NotImplementedError

    def config_to_hf(self, config: _C) -> dict[str, Any]:
        raise NotImplementedError

    def hf_tensors(
        self, fqn: str, param: torch.Tensor, hf_config: Mapping[str, Any]
    ) -> list[HFTensor]:
        """The HF tensors that make up our parameter (or persistent buffer) ``fqn`` in a
        checkpoint whose ``config.json`` is ``hf_config``."""
        for pattern, hf in self._to_hf:
            match = pattern.fullmatch(fqn)
            if match:
                if not hf:
                    return []
                if "{e}" in hf and hf_config.get(FUSED_EXPERTS):
                    return [_fused_experts(hf.format(*match.groups(), e="{e}"), param)]
                if "{e}" in hf:
                    return [
                        HFTensor(hf.format(*match.groups(), e=e), param[e])
                        for e in range(param.shape[0])
                    ]
                return [HFTensor(hf.format(*match.groups()), param)]
        raise ValueError(f"{type(self).__name__} has no HF name for parameter {fqn!r}")

    def adapt_to_checkpoint(self, hf: Mapping[str, Any], keys: Collection[str]) -> dict[str, Any]:
        """The HF config as it applies to the tensors the checkpoint holds (``keys``; from a
        folder, a mapping key → file, for an adapter that must read a tensor's shape); used for
        both the config and the key mapping. Marks a checkpoint whose experts are stored fused
        (``save_pretrained(save_original_format=False)``: transformers' in-memory layout)."""
        hf = dict(hf)
        if any(k.endswith(".experts.gate_up_proj") for k in keys):
            hf[FUSED_EXPERTS] = True
        return hf

    def is_ignored(self, key: str, config: TransformerConfig) -> bool:
        """Checkpoint keys we skip: old RoPE buffers, and ``lm_head`` when the head is tied
        (``transformers`` ignores it too, using the embedding)."""
        if config.tie_embeddings and key == "lm_head.weight":
            return True
        return any(re.fullmatch(p, key) for p in self.ignored_hf_keys)


FUSED_EXPERTS = "_titan_fused_experts"
"""Key ``adapt_to_checkpoint`` sets in the HF config of a checkpoint with fused experts."""


def _fused_experts(per_expert_key: str, param: torch.Tensor) -> HFTensor:
    """Our stacked expert weight inside transformers' fused tensors: ``experts.gate_up_proj``
    (E, 2I, D) holds the gate rows then the up rows of each expert, ``experts.down_proj``
    (E, D, I) is our ``w_down`` as is. ``per_expert_key`` is the on-disk per-expert template."""
    stem, projection = per_expert_key.split(".{e}.")
    if projection == "down_proj.weight":
        return HFTensor(f"{stem}.down_proj", param)
    experts, hidden, dim = param.shape
    half = slice(0, hidden) if projection == "gate_proj.weight" else slice(hidden, 2 * hidden)
    return HFTensor(
        f"{stem}.gate_up_proj",
        param,
        from_hf=lambda t: t[:, half],
        shape=(experts, 2 * hidden, dim),
        put=lambda full, w: full[:, half].copy_(w),
    )


def hf_rows(key: str, ours: torch.Tensor, total_rows: int, start: int) -> HFTensor:
    """Our ``ours`` as rows ``start .. start + len(ours)`` of the checkpoint tensor ``key`` that
    has ``total_rows`` rows (and ``ours``' other dims): a fused projection such as Qwen3.5's
    ``in_proj_qkv``, one of our parameters per part."""
    rows = slice(start, start + ours.shape[0])
    return HFTensor(
        key,
        ours,
        from_hf=lambda t: t[rows],
        shape=(total_rows, *ours.shape[1:]),
        put=lambda full, w: full[rows].copy_(w),
    )


def _template_regex(template: str) -> re.Pattern[str]:
    return re.compile(re.escape(template).replace(r"\{\}", r"(\d+)"))


STACK_KEY_MAP: tuple[tuple[str, str], ...] = (
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{}.attention_norm.weight", "model.layers.{}.input_layernorm.weight"),
    ("layers.{}.ffn_norm.weight", "model.layers.{}.post_attention_layernorm.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
)
"""Embedding, block norms, final norm and head: the same names in every family."""

GQA_KEY_MAP: tuple[tuple[str, str], ...] = (
    ("layers.{}.attention.wq.weight", "model.layers.{}.self_attn.q_proj.weight"),
    ("layers.{}.attention.wk.weight", "model.layers.{}.self_attn.k_proj.weight"),
    ("layers.{}.attention.wv.weight", "model.layers.{}.self_attn.v_proj.weight"),
    ("layers.{}.attention.wo.weight", "model.layers.{}.self_attn.o_proj.weight"),
    ("layers.{}.attention.q_norm.weight", "model.layers.{}.self_attn.q_norm.weight"),
    ("layers.{}.attention.k_norm.weight", "model.layers.{}.self_attn.k_norm.weight"),
)
"""``components.Attention`` ↔ HF's ``self_attn``."""

MLP_KEY_MAP: tuple[tuple[str, str], ...] = (
    ("layers.{}.feed_forward.w1.weight", "model.layers.{}.mlp.gate_proj.weight"),
    ("layers.{}.feed_forward.w2.weight", "model.layers.{}.mlp.down_proj.weight"),
    ("layers.{}.feed_forward.w3.weight", "model.layers.{}.mlp.up_proj.weight"),
)
"""``components.FeedForward`` ↔ HF's dense ``mlp``."""

MOE_KEY_MAP: tuple[tuple[str, str], ...] = (
    ("layers.{}.feed_forward.router.gate.weight", "model.layers.{}.mlp.gate.weight"),
    (
        "layers.{}.feed_forward.router.expert_bias",
        "model.layers.{}.mlp.gate.e_score_correction_bias",
    ),
    ("layers.{}.feed_forward.experts.w_gate", "model.layers.{}.mlp.experts.{e}.gate_proj.weight"),
    ("layers.{}.feed_forward.experts.w_up", "model.layers.{}.mlp.experts.{e}.up_proj.weight"),
    ("layers.{}.feed_forward.experts.w_down", "model.layers.{}.mlp.experts.{e}.down_proj.weight"),
    (
        "layers.{}.feed_forward.shared_experts.w_gate.weight",
        "model.layers.{}.mlp.shared_experts.gate_proj.weight",
    ),
    (
        "layers.{}.feed_forward.shared_experts.w_up.weight",
        "model.layers.{}.mlp.shared_experts.up_proj.weight",
    ),
    (
        "layers.{}.feed_forward.shared_experts.w_down.weight",
        "model.layers.{}.mlp.shared_experts.down_proj.weight",
    ),
)
"""``dist_moe.MoE`` ↔ HF's sparse ``mlp``: per-expert keys on disk (transformers fuses them into
``experts.gate_up_proj`` (E, 2I, D) / ``experts.down_proj`` in memory and splits them again when
saving) ↔ our stacked ``(E, I, D)`` / ``(E, D, I)`` weights."""

DENSE_KEY_MAP: tuple[tuple[str, str], ...] = STACK_KEY_MAP + GQA_KEY_MAP + MLP_KEY_MAP
"""Our names ↔ the ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` names."""


# HF config fields that change the architecture, with the only values we model. A checkpoint
# with any other value is refused instead of loading into a silently different model.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "attention_bias": (False, None),
    "mlp_bias": (False, None),
    "hidden_act": ("silu",),
    "attention_dropout": (0, 0.0, None),
    "partial_rotary_factor": (1, 1.0, None),
    "quantization_config": (None,),
}


class DenseHFAdapter(HFAdapter[_C]):
    """Adapter of a dense decoder whose HF config is Llama-shaped (Llama 3, Qwen3)."""

    key_map = DENSE_KEY_MAP
    config_cls: type[_C]
    default_max_position_embeddings: ClassVar[int]
    """What HF's config class assumes when ``max_position_embeddings`` is absent."""
    default_rms_norm_eps: ClassVar[float] = 1e-6
    """What HF's config class assumes when ``rms_norm_eps`` is absent."""

    def config_from_hf(self, hf: Mapping[str, Any]) -> _C:
        """Our config for an HF ``config.json``; ``ValueError`` naming any field we do not model."""
        check_supported(hf, sliding_window=True)
        return self.config_cls(**self.config_fields_from_hf(hf), **self.windows_from_hf(hf))

    def windows_from_hf(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        """``sliding_window`` / ``sliding_window_layers`` of an HF config (default: the format
        has none, so any window field is refused)."""
        refuse_sliding_window(hf)
        return {}

    def windows_to_hf(self, config: _C) -> dict[str, Any]:
        """The HF window fields of our config (default: refused when it has a window)."""
        if config.sliding_window is not None:
            raise ValueError(
                f"{type(config).__name__}.sliding_window={config.sliding_window} cannot be "
                f"written as an HF {self.model_types[0]!r} checkpoint (no sliding window there)"
            )
        return {}

    def config_fields_from_hf(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        """The ``TransformerConfig`` fields of an HF config (a family adds its own)."""
        heads = required(hf, "num_attention_heads")
        hidden = required(hf, "hidden_size")
        max_pos = hf.get("max_position_embeddings") or self.default_max_position_embeddings
        return dict(
            vocab_size=required(hf, "vocab_size"),
            dim=hidden,
            num_layers=required(hf, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            ffn_hidden_dim=required(hf, "intermediate_size"),
            rope=rope_from_hf(hf, max_position_embeddings=max_pos),
            max_seq_len=max_pos,
            norm_eps=hf.get("rms_norm_eps", self.default_rms_norm_eps),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=hf.get("initializer_range", 0.02),
        )

    def config_to_hf(self, config: _C) -> dict[str, Any]:
        """The HF ``config.json`` fields (legacy ``rope_theta`` / ``rope_scaling`` spelling,
        which transformers 4.x and 5.x both read)."""
        return {
            "architectures": [self.architecture],
            "model_type": self.model_types[0],
            "vocab_size": config.vocab_size,
            "hidden_size": config.dim,
            "intermediate_size": config.ffn_hidden_dim,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads,
            "head_dim": config.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": config.max_seq_len,
            "rms_norm_eps": config.norm_eps,
            "initializer_range": config.init_std,
            **rope_to_hf(config.rope),
            "tie_word_embeddings": config.tie_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            **self.windows_to_hf(config),
        }


def check_supported(
    hf: Mapping[str, Any],
    *,
    sliding_window: bool = False,
    allowed: Mapping[str, tuple[Any, ...]] | None = None,
    layer_types: tuple[str, ...] = ("full_attention",),
) -> None:
    """``ValueError`` naming the first HF config field whose value we do not model
    (``sliding_window``: the caller reads the window fields itself; ``allowed``: a family's
    own supported values of some fields, e.g. gpt-oss's ``attention_bias=True``;
    ``layer_types``: the entries of HF's ``layer_types`` the family models)."""
    for name, values in {**_NEUTRAL, **(allowed or {})}.items():
        if name in hf and hf[name] not in values:
            raise ValueError(
                f"HF config field {name}={hf[name]!r} is not supported (supported: "
                f"{', '.join(repr(a) for a in values if a is not None) or 'absent'})"
            )
    if not sliding_window:
        refuse_sliding_window(hf, layer_types=layer_types)


def refuse_sliding_window(
    hf: Mapping[str, Any], *, layer_types: tuple[str, ...] = ("full_attention",)
) -> None:
    """``ValueError`` when an HF config asks for sliding-window layers."""
    if "use_sliding_window" in hf:
        if hf["use_sliding_window"]:
            raise ValueError(
                "HF config field use_sliding_window=True is not supported (sliding-window "
                "attention is not modelled; supported: False)"
            )
    elif hf.get("sliding_window") is not None:
        raise ValueError(
            f"HF config field sliding_window={hf['sliding_window']!r} is not supported "
            "(sliding-window attention is not modelled; supported: None)"
        )
    other = sorted({t for t in hf.get("layer_types") or () if t not in layer_types})
    if other:
        raise ValueError(
            f"HF config field layer_types contains {other} (supported: "
            f"{', '.join(repr(t) for t in layer_types)})"
        )


def qwen_windows_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2/3-style windows: ``use_sliding_window`` switches them on, ``layer_types`` (or, when
    absent, the layers from ``max_window_layers`` on) says which layers slide."""
    if not hf.get("use_sliding_window"):
        return {}
    window = required(hf, "sliding_window")
    num_layers = required(hf, "num_hidden_layers")
    types = hf.get("layer_types")
    if types:
        unknown = sorted({t for t in types} - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(
                f"HF config field layer_types contains {unknown} (supported: "
                "'full_attention', 'sliding_attention')"
            )
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    else:
        layers = tuple(range(hf.get("max_window_layers", num_layers), num_layers))
    if not layers:
        return {}
    if len(layers) == num_layers:
        return {"sliding_window": window}
    return {"sliding_window": window, "sliding_window_layers": layers}


def qwen_windows_to_hf(config: TransformerConfig) -> dict[str, Any]:
    """The Qwen2/3 window fields (``layer_types`` spelled out; ``max_window_layers`` as HF's
    older code reads it where the sliding layers are a suffix)."""
    L = config.num_layers
    sliding = [config.layer_window(i) is not None for i in range(L)]
    types = ["sliding_attention" if s else "full_attention" for s in sliding]
    first = sliding.index(True) if any(sliding) else L
    return {
        "use_sliding_window": any(sliding),
        "sliding_window": config.sliding_window,
        "max_window_layers": first if all(sliding[first:]) else L,
        "layer_types": types,
    }


def required(hf: Mapping[str, Any], name: str) -> Any:
    if hf.get(name) is None:
        raise ValueError(f"HF config field {name} is missing")
    return hf[name]


def rope_from_hf(hf: Mapping[str, Any], *, max_position_embeddings: int) -> RopeConfig:
    """``RopeConfig`` from ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (checkpoints on the Hub)."""
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = dict(hf.get(field) or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"HF config field {field} is per layer type, which is not supported")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    factor = params.get("partial_rotary_factor", 1.0)
    if factor not in (1, 1.0):
        raise ValueError(
            f"HF config field {field}.partial_rotary_factor={factor!r} is not supported"
        )
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            scaling=Llama3RopeScaling(
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_seq_len=int(original),
            ),
        )
    if kind == "yarn":
        return RopeConfig(
            theta=theta,
            scaling=YarnRopeScaling(
                factor=float(params["factor"]),
                original_max_seq_len=int(original),
                beta_fast=float(params.get("beta_fast") or 32.0),
                beta_slow=float(params.get("beta_slow") or 1.0),
                mscale=params.get("mscale"),
                mscale_all_dim=params.get("mscale_all_dim"),
                attention_factor=params.get("attention_factor"),
                truncate=bool(params.get("truncate", True)),
            ),
        )
    raise ValueError(
        f"HF config field {field}.rope_type={kind!r} is not supported "
        "(supported: 'default', 'llama3', 'yarn')"
    )


def rope_to_hf(rope: RopeConfig) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` as Hub checkpoints spell them."""
    s = rope.scaling
    if s is None:
        scaling = None
    elif isinstance(s, Llama3RopeScaling):
        scaling = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_seq_len,
        }
    else:
        scaling = {
            "rope_type": "yarn",
            "factor": s.factor,
            "original_max_position_embeddings": s.original_max_seq_len,
            "beta_fast": s.beta_fast,
            "beta_slow": s.beta_slow,
            "truncate": s.truncate,
        }
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(s, name) is not None:
                scaling[name] = getattr(s, name)
    return {"rope_theta": rope.theta, "rope_scaling": scaling}
