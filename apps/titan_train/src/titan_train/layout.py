"""The job's layout: parallel degrees, what the model's plan allows, and the device mesh.

Mesh axes, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``; ``dp``
is ``dp_replicate x dp_shard`` flattened, ``dp_cp`` the same with ``cp``. Data-parallel ranks
read different data; ``tp`` and ``pp`` ranks of one data-parallel rank read the same, and its
``cp`` ranks each take their shard of every sequence. Parameters are replicated over ``cp``
like over the data-parallel ranks, so flexshard shards them over ``dp_shard x cp`` (as
torchtitan does), HSDP when ``dp_replicate > 1``.

Expert parallelism is carved out of ``dp_shard x cp x tp``: those axes flattened unflatten into
``experts_shard x ep``, so the ``ep`` group is the innermost ``ep`` ranks of them (the ranks
nearest each other; with ``ep`` dividing ``tp`` it lies inside one tensor-parallel group, with
``ep`` a multiple of ``tp`` it holds whole ones). Without ``tp`` this is torchtitan's layout;
with it, as torchtitan's ``etp=1``, the ranks of a tensor-parallel group dispatch different
tokens: attention and dense MLPs are tensor-parallel and leave the residual stream replicated
over ``tp``, so every ``tp`` rank routes every token (router, shared experts and norms run in
full, replicated, with the same gradients on every ``tp`` rank, as under TP without EP), then
dispatches only its ``1/tp`` slice of them to the experts, and the routed outputs are
all-gathered over ``tp`` (``dist_moe.TokenSplitDispatcher``; its backward gathers the slices'
input and routing-weight gradients, so no gradient needs a sum over ``tp``). MoE is per token:
any ranks can exchange tokens, so ``ep`` needs only to divide ``dp_shard * cp * tp``. The
price of the split, per MoE layer: an all-gather of the ``(T, D)`` routed outputs over ``tp`` in
the forward, and of the ``(T, D)`` input and ``(T, top_k)`` routing-weight gradients in the
backward; in return the experts' work and the all-to-all volume fall by ``tp``. The seed's
PP1 / DP16 / TP4 / CP4 / EP64 (256 ranks): ``dp_shard x cp x tp = 256``, so each ``ep`` group
of 64 holds 4 ``dp_shard`` x 4 ``cp`` x 4 ``tp`` ranks, and every expert has 4 copies.

Routed experts are split over ``ep`` and sharded by flexshard over the ranks that hold the same
ones (``experts_dp``: ``dp_replicate x experts_shard``); everything else over ``dp_replicate x
dp_shard x cp``. flexshard averages gradients over those ranks; an expert's gradient already
sums the tokens of its ``ep`` group (the all-to-all's backward), and the copies over
``experts_dp`` together hold every token of the step once (each ``tp`` slice reaches one copy),
so its sharding divides their sum by the ``dp x cp`` size, like every other gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import titan_models
from titan_train.config import JobConfig


@dataclass(frozen=True, slots=True)
class ParallelDims:
    """Resolved degrees of one job (``dp_shard=-1`` filled in)."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    ep: int
    cp: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel ranks: those that read different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks that hold different tokens of a step (data-parallel x context-parallel):
        the loss and the replicated parameters' gradients are reduced over them."""
        return self.dp * self.cp

    @classmethod
    def resolve(cls, cfg: JobConfig, world_size: int) -> ParallelDims:
        """Check the degrees against the world size; raise ``ValueError`` naming the fields."""
        p = cfg.parallel
        others = p.dp_replicate * p.tp * p.pp * p.cp
        if p.dp_shard == -1:
            if world_size % others:
                raise ValueError(
                    f"parallel degrees dp_replicate*dp_shard*cp*tp*pp must equal the world size "
                    f"{world_size}, but dp_replicate*cp*tp*pp = {p.dp_replicate}*{p.cp}*{p.tp}*"
                    f"{p.pp} = {others} does not divide it (parallel.dp_shard=-1 takes the rest)"
                )
            dp_shard = world_size // others
        else:
            dp_shard = p.dp_shard
        product = others * dp_shard
        if product != world_size:
            raise ValueError(
                f"parallel degrees dp_replicate*dp_shard*cp*tp*pp = {p.dp_replicate}*{dp_shard}*"
                f"{p.cp}*{p.tp}*{p.pp} = {product} must equal the world size {world_size}"
            )
        if (dp_shard * p.cp * p.tp) % p.ep:
            raise ValueError(
                f"parallel.ep={p.ep} must divide parallel.dp_shard*cp*tp = {dp_shard}*{p.cp}*"
                f"{p.tp}: expert parallelism is carved out of the data-, context- and "
                "tensor-parallel ranks"
            )
        return cls(world_size, p.dp_replicate, dp_shard, p.tp, p.pp, p.ep, p.cp)


def check_plan(cfg: JobConfig, dims: ParallelDims, plan: titan_models.ModelPlan) -> None:
    """The layout against what the model's plan says it supports; raise before anything is
    built. The plan is the only source: no family name or config field is looked at here."""
    name = f"{cfg.model.family} {cfg.model.flavor}"
    for axis in ("tp", "pp", "cp", "ep"):
        degree = getattr(dims, axis)
        why = plan.refusal(axis)
        if degree > 1 and why is not None:
            raise ValueError(
                f"parallel.{axis}={degree} is not supported by {name}: {why} (use "
                f"parallel.{axis}=1)"
            )
    if dims.tp > 1:
        for field_name, count in plan.tp_divisors:
            if count % dims.tp:
                raise ValueError(
                    f"parallel.tp={dims.tp} must divide the model's {field_name}={count} ({name})"
                )
    if dims.pp > 1:
        _check_pipeline(cfg, dims, len(plan.pipeline_units))
    if dims.cp > 1:
        _check_context_parallel(cfg, dims, plan.cp_min_chunk)
    if dims.ep > 1 and plan.num_experts % dims.ep:
        raise ValueError(
            f"parallel.ep={dims.ep} must divide the model's num_experts={plan.num_experts} ({name})"
        )
    local_len = cfg.training.seq_len // dims.cp
    if dims.ep > 1 and dims.tp > 1 and local_len % dims.tp:
        # even slices: static-capacity dispatch (fake mode, symm_mem) needs equal token counts
        raise ValueError(
            f"parallel.ep={dims.ep} with parallel.tp={dims.tp} splits each sequence's "
            f"training.seq_len / parallel.cp = {cfg.training.seq_len} / {dims.cp} = {local_len} "
            f"tokens over the tensor-parallel ranks: parallel.tp must divide {local_len}"
        )


def _check_pipeline(cfg: JobConfig, dims: ParallelDims, units: int) -> None:
    import titan_pipeline

    p = cfg.parallel
    if p.pp_schedule not in titan_pipeline.STAGES_PER_RANK:
        raise ValueError(
            f"parallel.pp_schedule={p.pp_schedule!r} is not one of "
            f"{sorted(titan_pipeline.STAGES_PER_RANK)}"
        )
    stages = dims.pp * titan_pipeline.STAGES_PER_RANK[p.pp_schedule]
    if stages > units:
        raise ValueError(
            f"parallel.pp={dims.pp} with schedule {p.pp_schedule!r} needs {stages} stages "
            f"but the model has only {units} pipeline units (embedding, blocks, head)"
        )
    micro = cfg.training.batch_size // cfg.training.grad_accum
    if micro % p.pp_microbatches:
        raise ValueError(
            f"parallel.pp_microbatches={p.pp_microbatches} must divide the micro-batch of "
            f"{micro} sequences (training.batch_size / training.grad_accum)"
        )


def _check_context_parallel(cfg: JobConfig, dims: ParallelDims, min_chunk: int) -> None:
    """What context parallelism does not compose with yet: one error naming it."""
    # selective remat likely caches every score tile's matmul of the attention's forward
    # (measured: 2,333 GiB of activations per rank, Llama 3 8B at 128K over CP 8)
    if cfg.remat.policy == "selective":
        raise ValueError(
            f"parallel.cp={dims.cp} does not compose with remat.policy='selective' yet; context "
            "parallelism composes with parallel.dp_shard, dp_replicate, tp, pp and ep (set "
            "parallel.cp=1 to use it)"
        )
    chunk = cfg.training.seq_len // (2 * dims.cp)
    if chunk < min_chunk:
        raise ValueError(
            f"parallel.cp={dims.cp} splits training.seq_len={cfg.training.seq_len} into chunks "
            f"of {chunk} tokens, shorter than the model's smallest context-parallel chunk of "
            f"{min_chunk} tokens (the linear-attention conv window's {min_chunk} earlier "
            f"inputs); use training.seq_len >= {2 * dims.cp * min_chunk}"
        )


def build_mesh(dims: ParallelDims, device_type: str) -> dict[str, Any]:
    """The device meshes of the job, by axis (empty on one process): ``pp``, ``tp``, ``cp``,
    ``dp_replicate``, ``dp_shard``, ``dp`` (the two flattened: which data a rank reads),
    ``dp_cp`` (with ``cp``: over which the loss is summed), ``dp_2d`` (replicate x
    ``dp_shard·cp``, flexshard's HSDP mesh) and, under expert parallelism, ``ep`` (the
    innermost ``ep`` ranks of ``dp_shard·cp·tp``) and ``experts_dp`` (replicate x
    ``dp_shard·cp·tp / ep``: where an expert's copies live)."""
    if dims.world_size == 1:
        return {}
    from torch.distributed.device_mesh import init_device_mesh

    axes = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    root = init_device_mesh(
        device_type,
        (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp),
        mesh_dim_names=axes,
    )
    meshes = {axis: root[axis] for axis in axes}
    meshes["dp"] = root[("dp_replicate", "dp_shard")]._flatten("dp")
    dp_cp = root[("dp_replicate", "dp_shard", "cp")]._flatten("dp_cp")
    meshes["dp_cp"] = dp_cp
    meshes["dp_2d"] = dp_cp._unflatten(
        0, (dims.dp_replicate, dims.dp_shard * dims.cp), ("dp_replicate", "dp_shard_cp")
    )
    if dims.ep > 1:  # the innermost ep ranks of dp_shard x cp x tp (the nearest ranks)
        ranks = root[("dp_replicate", "dp_shard", "cp", "tp")]._flatten("dp_cp_tp")
        split = ranks._unflatten(
            0,
            (dims.dp_replicate, dims.dp_shard * dims.cp * dims.tp // dims.ep, dims.ep),
            ("dp_replicate", "experts_shard", "ep"),
        )
        meshes |= {"ep": split["ep"], "experts_dp": split[("dp_replicate", "experts_shard")]}
    return meshes
