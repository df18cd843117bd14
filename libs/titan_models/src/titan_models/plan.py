"""Declarative parallelism plans: pure data that the app applies; the model never imports
``torch.distributed``.

FQN patterns are dot-separated module names in which ``*`` matches exactly one segment
(``layers.*.attention.wq`` matches ``layers.7.attention.wq``); see ``fqn_matches``.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """Modules that run on each rank's local heads with replicated weights, gradients summed
    over the tensor-parallel group (the per-head QK-norms)."""


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


def fqn_matches(pattern: str, fqn: str) -> bool:
    """Whether ``fqn`` matches ``pattern`` segment by segment (``*`` = any one segment)."""
    parts, wanted = fqn.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(
        w in ("*", p) for w, p in zip(wanted, parts, strict=True)
    )


def dense_decoder_plan(config: TransformerConfig, *, qk_norm: bool) -> ModelPlan:
    """The plan of a ``Transformer`` of attention + SwiGLU blocks (Llama 3, Qwen3)."""
    c = config
    attention = c.dim * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    attention += c.num_heads * c.head_dim * c.dim + (2 * c.head_dim if qk_norm else 0)
    block = attention + 3 * c.dim * c.ffn_hidden_dim + 2 * c.dim
    units = (
        PipelineUnit(
            name="tok_embeddings", modules=("tok_embeddings",), num_params=c.vocab_size * c.dim
        ),
        *(
            PipelineUnit(name=f"layers.{i}", modules=(f"layers.{i}",), num_params=block)
            for i in range(c.num_layers)
        ),
        PipelineUnit(
            name="head", modules=("norm", "output"), num_params=c.dim + c.vocab_size * c.dim
        ),
    )
    return ModelPlan(
        tensor_parallel=TensorParallelPlan(
            colwise=(
                "layers.*.attention.wq",
                "layers.*.attention.wk",
                "layers.*.attention.wv",
                "layers.*.feed_forward.w1",
                "layers.*.feed_forward.w3",
                "output",
            ),
            rowwise=("tok_embeddings", "layers.*.attention.wo", "layers.*.feed_forward.w2"),
            sequence_parallel=("layers.*.attention_norm", "layers.*.ffn_norm", "norm"),
            replicated=("layers.*.attention.q_norm", "layers.*.attention.k_norm")
            if qk_norm
            else (),
        ),
        pipeline_units=units,
        remat_units=("layers.*",),
        tied_parameters=(("tok_embeddings.weight", "output.weight"),) if c.tie_embeddings else (),
    )
