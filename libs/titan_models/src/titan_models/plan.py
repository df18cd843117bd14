"""Declarative parallelism plans: pure data that the app applies; the model never imports
``torch.distributed``.

FQN patterns are globs as ``fqn_matches`` reads them (``fqn.py``): ``*`` stays inside one
dotted segment (``layers.*.attention.wq`` matches ``layers.7.attention.wq``), a ``**`` segment
spans any number of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .components import TransformerConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorParallelPlan:
    """Which modules are sharded how over the tensor-parallel mesh axis."""

    colwise: tuple[str, ...]
    """``nn.Linear`` whose output features are sharded (weight ``Shard(0)``); their outputs stay
    sharded by heads / hidden units. The output head is among them (loss-parallel logits)."""
    rowwise: tuple[str, ...]
    """``nn.Linear`` whose input features are sharded (weight ``Shard(1)``) and whose partial
    outputs are reduced (reduce-scattered over the sequence under sequence parallelism). An
    ``nn.Embedding`` here is vocabulary-parallel: its rows are sharded."""
    sequence_parallel: tuple[str, ...]
    """Norms on the residual stream, run on sequence-sharded activations (weights replicated)."""
    replicated: tuple[str, ...]
    """Modules with replicated weights whose gradients are partial per rank and summed over the
    tensor-parallel group: the per-head QK-norms (run on the local heads); linear attention's
    per-head output norm and KDA's low-rank gate inputs (``wf_a``, ``wg_a``). Kimi Linear's and
    DeepSeek-V4's MLA latents are listed here too, which ``with_capabilities`` refuses under
    TP; DeepSeek-V3's are ``unsharded``, with a ``head_shared_columns`` rope key."""
    unsharded: tuple[str, ...] = ()
    """Modules left whole and plain on every rank, with the same full gradient everywhere:
    they read the replicated residual stream and feed column-wise layers, whose input
    gradient torch's TP sums (MLA's latent projections and norms ``wq_a``, ``q_norm``,
    ``wkv_a``, ``kv_norm``; MTP's ``eh_proj``, which feeds the residual stream)."""
    head_shared_columns: tuple[tuple[str, int], ...] = ()
    """``(module pattern, first column)``: replicated linears (on the replicated residual
    stream) whose output columns from ``first column`` on feed every local head directly, not
    through a column-wise layer: MLA's rope key, split off ``wkv_a``'s latent. Their gradient
    is partial per rank and is summed over the tensor-parallel group; the columns before it
    reach the heads through a column-wise layer, whose input gradient torch's TP sums."""
    head_sharded: tuple[str, ...] = ()
    """*Parameter* FQN patterns (not modules) split on dim 0 with the heads, like the outputs
    of the column-wise projections they act on: linear attention's per-head ``dt_bias`` /
    ``A_log`` and depthwise conv filters (``conv_q.weight``, ...). Each rank holds its heads'
    rows as a plain tensor; the modules read head counts off their weights at run time."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineUnit:
    """The smallest piece a pipeline split may put on a stage, in forward order."""

    name: str
    """``tok_embeddings``, ``layers.<i>`` or ``head``."""
    modules: tuple[str, ...]
    """Top-level FQNs a stage that owns this unit keeps (the others it sets to ``None`` or
    deletes from ``layers``)."""
    num_params: int
    """Parameters in the unit (a tied head counts its shared weight), for balancing stages."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelPlan:
    """Everything the app needs to parallelise one model, as data."""

    tensor_parallel: TensorParallelPlan
    """Tensor- and sequence-parallel layout."""
    pipeline_units: tuple[PipelineUnit, ...]
    """Ordered pipeline-splittable units: embedding, each block, final norm + head."""
    remat_units: tuple[str, ...]
    """Module patterns whose activations are rematerialised as a unit (the blocks)."""
    tied_parameters: tuple[tuple[str, str], ...] = ()
    """Parameter FQN pairs that are one tensor; stages holding both ends must keep them equal."""
    experts: tuple[str, ...] = ()
    """FQN patterns of the ``dist_moe.MoE`` modules: the app hands each to
    ``dist_moe.expert_parallel(module, ep_group)``. They are in no tensor-parallel list (router,
    routed and shared experts run unsharded over TP; under sequence parallelism each TP rank
    routes its own sequence shard)."""
    stage_width: int | None = None
    """Features per token a pipeline stage sends to the next (``None``: the model width ``dim``;
    DeepSeek-V4 sends its ``hc_mult`` residual streams, ``hc_mult · dim``)."""
    stage_inputs: tuple[str, ...] = ()
    """Forward keyword arguments every pipeline stage needs from the batch besides positions and
    documents: ``token_ids`` (the input ids, ``(B, S)``) for hash-routed MoE layers."""
    context_parallel: bool = True
    """Whether the attention can be split over a context-parallel group (DeepSeek-V4's
    compressed attention cannot yet)."""

    # What the model supports, so a trainer asks the plan instead of probing the config
    # (``with_capabilities`` fills these from the config for every family).
    tp_divisors: tuple[tuple[str, int], ...] = ()
    """``(config field, count)`` a tensor-parallel degree must divide: the head counts (split
    whole over the ranks) and the MLP's hidden units."""
    num_experts: int = 0
    """Routed experts per MoE layer (an expert-parallel degree must divide it); 0: no MoE."""
    cp_min_chunk: int = 1
    """Fewest tokens one context-parallel chunk may hold (a linear-attention layer's short
    conv reads the ``kernel - 1`` tokens before a chunk from the chunk before it)."""
    refused: tuple[tuple[str, str], ...] = ()
    """``(axis, why)`` for each parallel axis (``tp``, ``pp``, ``cp``, ``ep``) the model cannot
    be split over, with the reason in words (e.g. multi-token prediction under ``pp``: the
    embedding and the head must share a stage)."""

    def refusal(self, axis: str) -> str | None:
        """Why the model cannot be split over ``axis``; None when it can."""
        return next((why for a, why in self.refused if a == axis), None)


def decoder_plan(
    model_cls: type[nn.Module],
    config: TransformerConfig,
    *,
    colwise: tuple[str, ...],
    rowwise: tuple[str, ...],
    replicated: tuple[str, ...],
    experts: tuple[str, ...] = (),
    sequence_parallel: tuple[str, ...] = (),
    head_modules: tuple[str, ...] = (),
    head_sharded: tuple[str, ...] = (),
    head_shared_columns: tuple[tuple[str, int], ...] = (),
    unsharded: tuple[str, ...] = (),
    stage_width: int | None = None,
    stage_inputs: tuple[str, ...] = (),
) -> ModelPlan:
    """The plan of a ``Transformer``: Megatron-style TP/SP, one pipeline unit per block,
    blocks as remat units, and (MoE families) the expert modules.

    The patterns given are the blocks' own; embedding, head and the residual-stream norms are
    added here. Unit sizes are counted on a meta-device build (nothing is allocated).
    ``head_modules``: modules beside ``norm`` and ``output`` that the last stage keeps;
    ``stage_width`` / ``stage_inputs``: see ``ModelPlan``.
    """
    with torch.device("meta"):
        model = model_cls(config)

    def unit(name: str, modules: tuple[str, ...]) -> PipelineUnit:
        params = {
            id(p): p.numel() for top in modules for p in model.get_submodule(top).parameters()
        }
        return PipelineUnit(name=name, modules=modules, num_params=sum(params.values()))

    units = (
        unit("tok_embeddings", ("tok_embeddings",)),
        *(unit(f"layers.{i}", (f"layers.{i}",)) for i in range(config.num_layers)),
        unit("head", ("norm", "output", *head_modules)),
    )
    return ModelPlan(
        tensor_parallel=TensorParallelPlan(
            colwise=(*colwise, "output"),
            rowwise=("tok_embeddings", *rowwise),
            sequence_parallel=(
                "layers.*.attention_norm",
                "layers.*.ffn_norm",
                *sequence_parallel,
                "norm",
            ),
            replicated=replicated,
            head_sharded=head_sharded,
            head_shared_columns=head_shared_columns,
            unsharded=unsharded,
        ),
        pipeline_units=units,
        remat_units=("layers.*", *(f"{m}.*" for m in head_modules)),
        tied_parameters=(("tok_embeddings.weight", "output.weight"),)
        if config.tie_embeddings
        else (),
        experts=experts,
        stage_width=stage_width,
        stage_inputs=stage_inputs,
    )


_TP_COUNTS = (
    "num_heads",
    "num_kv_heads",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_num_heads",
    "ffn_hidden_dim",
)


def with_capabilities(plan: ModelPlan, config: TransformerConfig) -> ModelPlan:
    """``plan`` with what the model supports filled in from ``config`` (``ModelPlan``'s
    capability fields); reasons a family already gave in ``refused`` are kept."""
    from dataclasses import replace

    from .components.linear_attention.layer_types import resolved_layer_types

    divisors = tuple(
        (name, count)
        for name in _TP_COUNTS
        if isinstance(count := getattr(config, name, None), int) and count > 0
    )
    refused = dict(plan.refused)
    latent = [m for m in plan.tensor_parallel.replicated if not m.endswith("_norm")]
    if latent:
        refused.setdefault(
            "tp",
            f"the model has replicated projections whose outputs the local heads share ({latent[0]}, "
            "MLA's latents); their gradients need a sum no tensor-parallel style expresses yet",
        )
    if plan.tied_parameters:
        why = "the model ties its embedding and output head; tied weights cannot be split yet"
        refused.setdefault("tp", why)
        refused.setdefault("pp", why)
    mtp = getattr(config, "num_mtp_modules", 0) or 0
    if mtp:
        refused.setdefault(
            "pp",
            f"the model uses multi-token prediction (num_mtp_modules={mtp}), which needs the embedding and "
            "the head on one stage",
        )
        refused.setdefault(
            "cp",
            f"the model uses multi-token prediction (num_mtp_modules={mtp}), which shifts tokens along the "
            "whole sequence",
        )
    if not plan.context_parallel:
        refused.setdefault("cp", "the model's attention cannot be split over a sequence yet")
    if not plan.experts:
        refused.setdefault("ep", "the model has no MoE layers")
    min_chunk = 1
    has_types = getattr(config, "layer_types", None) or hasattr(config, "full_attention_interval")
    if has_types and "linear_attention" in resolved_layer_types(config):
        min_chunk = max(1, getattr(config, "linear_conv_kernel_dim", 1) - 1)
    return replace(
        plan,
        tp_divisors=divisors,
        num_experts=getattr(config, "num_experts", 0) if plan.experts else 0,
        cp_min_chunk=min_chunk,
        refused=tuple(refused.items()),
    )


def check_tensor_parallel(config: TransformerConfig, degree: int) -> None:
    """``ValueError`` naming the first head count of ``config`` that a tensor-parallel
    ``degree`` does not divide (attention heads, and the linear-attention heads of hybrids)."""
    for name in (
        "num_heads",
        "num_kv_heads",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_num_heads",
    ):
        heads = getattr(config, name, None)
        if heads is not None and heads % degree:
            raise ValueError(
                f"tensor-parallel degree {degree} must divide {type(config).__name__}.{name}="
                f"{heads} (heads are split whole over the ranks)"
            )


def dense_decoder_plan(
    model_cls: type[nn.Module], config: TransformerConfig, *, qk_norm: bool
) -> ModelPlan:
    """The plan of a ``Transformer`` of attention + SwiGLU blocks (Llama 3, Qwen3)."""
    return decoder_plan(
        model_cls,
        config,
        colwise=(
            "layers.*.attention.wq",
            "layers.*.attention.wk",
            "layers.*.attention.wv",
            "layers.*.feed_forward.w1",
            "layers.*.feed_forward.w3",
        ),
        rowwise=("layers.*.attention.wo", "layers.*.feed_forward.w2"),
        replicated=("layers.*.attention.q_norm", "layers.*.attention.k_norm") if qk_norm else (),
    )
