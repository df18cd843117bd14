"""The parallelize step: one device mesh, the model's declarative plan, and the libraries.

``parallelize`` takes the model *on the meta device* and, for each of this rank's model parts
(the whole model, or its pipeline stages), applies in order: tensor parallelism (torch
DTensor ``parallelize_module`` from the plan's layout), expert parallelism (``dist_moe``),
rematerialisation (``torch_remat``, per block), per-block ``torch.compile``, and data-parallel
sharding (``flexshard``; Muon puts matrices ``Owned``; ``flexshard.fp8_gather`` tiles the FP8
linears' weights ``BlockShard`` gathered in e4m3). Before all of it, ``quantize.*`` swaps the
linears and experts for FP8 / MXFP8 ones (``low_precision``). Nothing is allocated: ``materialize``
then gives each rank the pieces it holds. The pipeline split happens first, so each stage is
parallelised on its own, as in torchtitan. No sharding, schedule or MoE logic lives here: only
the wiring.

The mesh and its axes, what each parallel degree requires and how expert parallelism shares
ranks with tensor parallelism are ``titan_train.layout``'s (see its docstring). Under
pipelining every stage runs on the local ``S / cp`` tokens of each microbatch; its
context-parallel group is the ``cp`` axis at its ``pp`` position. ``ParallelModel.shard_batch``
gives each ``cp`` rank its shard of every sequence.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

import titan_models
from titan_train.config import JobConfig
from titan_train.data.packing import Batch
from titan_train.layout import ParallelDims

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from flexshard import FlexShardModule


@dataclass(slots=True)
class ParallelModel:
    """This rank's part of the model and what the train step needs to drive it."""

    parts: list[titan_models.Transformer]
    """The whole model, or this rank's pipeline stages in stage order."""
    dims: ParallelDims
    meshes: dict[str, Any] = field(default_factory=dict)
    """``build_mesh``'s device meshes by axis (empty on one process)."""
    schedule: Any = None
    """The ``titan_pipeline.Schedule`` when ``pp > 1``."""
    stages: list[Any] = field(default_factory=list)
    """The ``titan_pipeline.PipelineStage`` objects of this rank (built once materialised)."""
    sharded: bool = False
    """Whether ``parts`` are flexshard-sharded (gradients reduced by hooks)."""
    stage_outputs: list[tuple[int, torch.dtype]] = field(default_factory=list)
    """Per pipeline stage: the width and dtype of its output (the plan's ``stage_width``, by
    default the hidden size; vocabulary last)."""
    stage_inputs: tuple[str, ...] = ()
    """The plan's ``stage_inputs``: batch fields every pipeline stage gets as keywords
    (``token_ids``: the input ids, for hash-routed MoE layers)."""
    experts: list[tuple[str, nn.Module, Any]] = field(default_factory=list)
    """Under expert parallelism: (FQN, experts module, ``dist_moe.ExpertPlacement``) of every
    MoE layer this rank holds."""
    context_parallel: titan_models.ContextParallel | None = None
    """Under context parallelism: the group's collectives and algorithm every part runs with."""
    graph: Any = None
    """``compile.mode='graph'``: the ``titan_train.graph.GraphStep`` that runs the step."""

    @property
    def has_head(self) -> bool:
        """Whether this rank computes logits (the last pipeline stage, or no pipeline)."""
        return self.schedule is None or any(st.is_last for st in self.stages)

    @property
    def expert_params(self) -> list[nn.Parameter]:
        """This rank's routed-expert weights (different on every rank of the ``ep`` group)."""
        return [p for _, module, _ in self.experts for p in module.parameters()]

    def flexshard_parts(self) -> list[FlexShardModule]:
        """``parts`` as the flexshard modules they are once ``sharded``: their gradient-sync
        switch and bucket states."""
        from flexshard import FlexShardModule

        out: list[FlexShardModule] = []
        for part in self.parts:
            if not isinstance(part, FlexShardModule):
                raise TypeError(
                    f"{type(part).__name__} is not sharded by flexshard (ParallelModel.sharded="
                    f"{self.sharded})"
                )
            out.append(part)
        return out

    def parameters(self) -> list[torch.nn.Parameter]:
        """Local parameters of every part, each once."""
        seen: dict[int, torch.nn.Parameter] = {}
        for part in self.parts:
            for p in part.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(FQN in the unsplit model, local parameter): pipeline stages keep their FQNs."""
        out: dict[int, tuple[str, torch.nn.Parameter]] = {}
        for part in self.parts:
            for name, p in part.named_parameters():
                out.setdefault(id(p), (name, p))
        return list(out.values())

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (which data it reads)."""
        return self.meshes["dp"].get_local_rank() if self.meshes else 0

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group of one mesh axis (None: one process)."""
        return self.meshes[axis].get_group() if self.meshes else None

    def shard_batch(self, batch: Batch) -> Batch:
        """This rank's tokens of every row of ``batch`` (the zig-zag chunks of the ``cp``
        group; all of them without context parallelism): inputs, labels, document ids and
        positions alike, so each token keeps its target and its place in its document."""
        cp = self.context_parallel
        if cp is None:
            return batch
        return Batch(
            cp.shard(batch.input_ids, dim=1),
            cp.shard(batch.labels, dim=1),
            cp.shard(batch.document_ids, dim=1),
            cp.shard(batch.positions, dim=1),
        )


def parallelize(
    model: titan_models.Transformer,
    cfg: JobConfig,
    dims: ParallelDims,
    meshes: dict[str, Any],
    plan: titan_models.ModelPlan,
) -> ParallelModel:
    """Split, shard and wrap ``model`` (on the meta device) for this rank; nothing is
    allocated (``materialize`` does that). ``quantize.*`` swaps in the FP8 / MXFP8 GEMMs and
    ``lora.*`` the adapters first, on the whole model, so every layout below shards the
    swapped modules."""
    from titan_train.lora import apply_lora_config
    from titan_train.low_precision import apply_quantize

    apply_quantize(model, cfg)
    apply_lora_config(model, cfg)
    pm = ParallelModel(parts=[model], dims=dims, meshes=meshes)
    if dims.pp > 1:
        _split_pipeline(pm, model, plan, cfg)
    if dims.cp > 1:
        pm.context_parallel = titan_models.ContextParallel(
            group=pm.group("cp"),
            algorithm=cfg.parallel.cp_algorithm,
            tile_kernel=cfg.parallel.cp_tile_kernel,
            tile_scores=cfg.parallel.cp_tile_scores,
        )
    for part in pm.parts:
        part.context_parallel = pm.context_parallel
        if dims.cp > 1:  # the balance loss counts each row's experts over its CP shards
            import dist_moe

            dist_moe.sequence_parallel_balance(part, pm.group("cp"))
        if dims.tp > 1:
            _apply_tensor_parallel(part, plan.tensor_parallel, meshes["tp"])
        if dims.ep > 1:
            mesh_type = next(iter(meshes.values())).device_type
            pm.experts += _apply_expert_parallel(part, plan, pm, cfg, mesh_type)
        if not (cfg.compile.mode == "graph" and "memory" in cfg.compile.passes):
            _apply_remat(part, plan, cfg)  # else the graph's memory pass applies the policy
        if cfg.compile.mode == "local" or cfg.compile.enabled:
            _apply_compile(part, plan)
        if dims.dp_cp > 1:
            _apply_data_parallel(part, cfg, pm)
            pm.sharded = True
    return pm


# --- tensor parallelism -------------------------------------------------------------------


def _apply_tensor_parallel(
    module: nn.Module, tp_plan: titan_models.TensorParallelPlan, tp_mesh: DeviceMesh
) -> None:
    """Megatron-style TP from the plan: column-wise / row-wise linears, a vocab-parallel
    embedding, full logits gathered at the head. Norms on the residual stream stay replicated
    (no sequence parallelism yet). The plan's ``replicated`` norms run on the local heads: they
    become replicated DTensors over the head dimension (``SequenceParallel`` on dim 2), so
    DTensor sums their partial gradients. The plan's ``head_shared_columns`` (MLA's rope key)
    get their gradient summed over ``tp`` by a forward hook's autograd function."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    layout: dict[str, Any] = {}
    modules = dict(module.named_modules())
    for pattern in tp_plan.colwise:
        for n in _matching(modules, pattern):
            head = n == "output"
            layout[n] = ColwiseParallel(output_layouts=Replicate()) if head else ColwiseParallel()
    for pattern in tp_plan.rowwise:
        for n in _matching(modules, pattern):  # an embedding takes replicated token ids
            vocab = isinstance(modules[n], nn.Embedding)
            layout[n] = RowwiseParallel(input_layouts=Replicate()) if vocab else RowwiseParallel()
    for pattern in tp_plan.replicated:
        for n in _matching(modules, pattern):
            layout[n] = SequenceParallel(sequence_dim=2, use_local_output=True)
    for n, style in layout.items():
        if isinstance(modules[n], titan_models.LoRALinear):
            from titan_train.lora import lora_tensor_parallel

            layout[n] = lora_tensor_parallel(style)
    if layout:
        parallelize_module(module, tp_mesh, layout)
    for pattern, start in tp_plan.head_shared_columns:  # MLA's rope key: read by every head
        for n in _matching(modules, pattern):
            modules[n].register_forward_hook(_sum_grad_columns_hook(start, tp_mesh.get_group()))


class _SumGradColumns(torch.autograd.Function):
    """Forward: the identity. Backward: the gradient's last-dim columns from ``start`` on
    summed over ``group`` (each rank's local heads gave their part of it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, start: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        tail = grad[..., ctx.start :].contiguous()
        dist.all_reduce(tail, group=ctx.group)
        return torch.cat([grad[..., : ctx.start], tail], dim=-1), None, None


def _sum_grad_columns_hook(start: int, group: dist.ProcessGroup) -> Any:
    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return _SumGradColumns.apply(out, start, group)

    return hook


def _matching(modules: dict[str, nn.Module], pattern: str) -> list[str]:
    return [n for n in modules if n and titan_models.fqn_matches(pattern, n)]


# --- expert parallelism -------------------------------------------------------------------


def _apply_expert_parallel(
    module: nn.Module,
    plan: titan_models.ModelPlan,
    pm: ParallelModel,
    cfg: JobConfig,
    device_type: str,
) -> list[tuple[str, nn.Module, Any]]:
    """Split each MoE's routed experts over the ``ep`` group, tokens exchanged by
    ``moe.dispatch``: all-to-all collectives, or dist_moe's symmetric-memory puts (emulated in
    shared memory when the group has no CUDA devices). Under tensor parallelism each ``tp``
    rank dispatches its slice of the (replicated) tokens, the outputs gathered over ``tp``."""
    import dist_moe

    group = pm.group("ep")
    token_group = pm.group("tp") if pm.dims.tp > 1 else None
    out: list[tuple[str, nn.Module, Any]] = []
    for n, sub in list(module.named_modules()):
        if any(titan_models.fqn_matches(p, n) for p in plan.experts):
            if not isinstance(sub, dist_moe.MoE):
                raise TypeError(
                    f"the model plan's experts pattern matches {n}, a {type(sub).__name__}, not "
                    "a dist_moe.MoE"
                )
            dispatcher: Any = "all_to_all"
            if cfg.moe.dispatch == "symm_mem":
                dispatcher = dist_moe.SymmMemDispatcher(
                    sub.config.router.num_experts,
                    group,
                    sub.config.permute,
                    max_tokens=cfg.moe.symm_mem_max_tokens or None,
                    emulate=device_type != "cuda",
                )
            placement = dist_moe.expert_parallel(
                sub, group, dispatcher=dispatcher, token_group=token_group
            )
            out.append((f"{n}.experts", sub.experts, placement))
    return out


# --- rematerialisation and compile --------------------------------------------------------


def _apply_remat(module: nn.Module, plan: titan_models.ModelPlan, cfg: JobConfig) -> None:
    if cfg.remat.policy == "none":
        return
    import torch_remat

    policy = {
        "full": torch_remat.Full,
        "selective": torch_remat.Selective,
        "every_nth": lambda: torch_remat.EveryNth(cfg.remat.every_nth),
    }[cfg.remat.policy]()
    units = [n for n, _ in _units(module, plan.remat_units)]
    if units:
        torch_remat.apply(module, policy, units=units)


def _apply_compile(module: nn.Module, plan: titan_models.ModelPlan) -> None:
    """Local compile: each block compiled on its own (small graphs, one recompile per shape)."""
    for _, block in _units(module, plan.remat_units):
        block.compile()


def _units(module: nn.Module, patterns: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    return [
        (n, m)
        for n, m in module.named_modules()
        if n and any(titan_models.fqn_matches(p, n) for p in patterns)
    ]


# --- data parallelism (flexshard) ---------------------------------------------------------


def _apply_data_parallel(module: nn.Module, cfg: JobConfig, pm: ParallelModel) -> None:
    """flexshard over ``dp_replicate x dp_shard x cp``: one bucket per block plus the root;
    with Muon the blocks' matrices are ``Owned`` (whole on one rank, orthogonalised there with
    no gather). Experts split by expert parallelism are sharded first, over the ranks of
    their own ``ep`` position (``dp_replicate x experts_shard``)."""
    import flexshard as fs

    mp = None
    if cfg.training.mixed_precision == "bf16":
        mp = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mine = {id(m) for m in module.modules()}
    for _, experts, _ in pm.experts:
        if id(experts) in mine:  # their gradients already hold the tokens of the ep group
            fs.shard(
                experts,
                pm.meshes["experts_dp"],
                mp=mp,
                gradient_divide_factor=float(pm.dims.dp_cp),
            )
    local_experts = [p for _, e, _ in pm.experts if id(e) in mine for p in e.parameters()]
    buckets = []
    defaults = fs.default_buckets(module, ignored_params=local_experts)
    for bucket in _merge_into_root(defaults, "mtp."):
        params = list(bucket.match)
        if cfg.flexshard.fp8_gather:  # the FP8 linears' weights gathered as e4m3 tiles
            from titan_train.low_precision import fp8_gather_buckets

            buckets += fp8_gather_buckets(module, bucket, cfg)
        elif cfg.optimizer.name == "muon" and bucket.name != "<root>":
            mats = [p for p in params if _local(p).ndim == 2]
            rest = [p for p in params if _local(p).ndim != 2]
            if mats:
                buckets.append(fs.Bucket(mats, fs.Owned(balance="flops"), name=bucket.name))
            if rest:
                buckets.append(fs.Bucket(rest, fs.Shard(0), name=f"{bucket.name}.vectors"))
        else:
            buckets.append(bucket)
    fs.shard(
        module,
        pm.meshes["dp_2d"],
        buckets=buckets,
        mp=mp,
        ignored_params=local_experts,
    )


def _merge_into_root(buckets: list[Any], prefix: str) -> list[Any]:
    """Move the blocks under ``prefix`` into the root bucket: the model calls parts of them
    (an MTP module's norm) outside their own forward, so they must stay gathered with the
    root from forward to backward."""
    import flexshard as fs

    moved = [p for b in buckets if (b.name or "").startswith(prefix) for p in b.match]
    if not moved:
        return buckets
    kept = [b for b in buckets if not (b.name or "").startswith(prefix)]
    root = next((b for b in kept if b.name == "<root>"), None)
    rest = [b for b in kept if b is not root]
    params = [*(root.match if root is not None else []), *moved]
    return [*rest, fs.Bucket(params, fs.Shard(0), name="<root>")]


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


# --- pipeline -----------------------------------------------------------------------------


def _split_pipeline(
    pm: ParallelModel, model: titan_models.Transformer, plan: titan_models.ModelPlan, cfg: JobConfig
) -> None:
    """Cut the model into stages by parameter count and keep this rank's (FQNs unchanged)."""
    import titan_pipeline

    p = cfg.parallel
    schedule = titan_pipeline.build_schedule(
        p.pp_schedule, num_ranks=pm.dims.pp, num_microbatches=p.pp_microbatches
    )
    units = plan.pipeline_units
    ranges = titan_pipeline.balance([u.num_params for u in units], schedule.num_stages)
    bounds = [[units[i] for i in r] for r in ranges]
    pp_rank = pm.meshes["pp"].get_local_rank()
    pm.schedule = schedule
    pm.stage_inputs = plan.stage_inputs
    pm.parts = []
    for s in schedule.stages_of_rank(pp_rank):
        keep = {m for u in bounds[s] for m in u.modules}
        pm.parts.append(_prune(model, keep))


def _prune(model: titan_models.Transformer, keep: set[str]) -> titan_models.Transformer:
    """A copy of ``model`` holding only the top-level modules / blocks in ``keep``; dropped
    parts become ``None`` (the model's forward skips them), FQNs stay those of the whole."""
    memo = {id(m): None for n, m in model.named_children() if n not in ("layers", "rope")}
    memo.update({id(b): None for k, b in model.layers.items() if f"layers.{k}" not in keep})
    memo.pop(id(None), None)
    part = copy.deepcopy(model, memo)  # never copies the dropped modules' weights
    for name, child in model.named_children():  # embedding, norm, head, a vision tower, ...
        if name in keep and name not in ("layers", "rope"):
            setattr(part, name, copy.deepcopy(child))
    for k in [k for k in part.layers if f"layers.{k}" not in keep]:
        del part.layers[k]
    return part


def build_stages(pm: ParallelModel, cfg: JobConfig) -> None:
    """The ``titan_pipeline`` stages of this rank's parts (once their weights exist), and what
    every stage outputs per microbatch (hidden states; logits at the last)."""
    import titan_pipeline

    num_stages = pm.schedule.num_stages
    local = pm.schedule.stages_of_rank(pm.meshes["pp"].get_local_rank())
    pm.stages = [
        titan_pipeline.PipelineStage(part, s, num_stages, group=pm.group("pp"))
        for s, part in zip(local, pm.parts, strict=True)
    ]
    config = pm.parts[0].config
    dtype = torch.bfloat16 if cfg.training.mixed_precision == "bf16" else torch.float32
    width = titan_models.get_plan(config).stage_width or config.dim
    widths = [width] * (num_stages - 1) + [config.vocab_size]
    pm.stage_outputs = [(width, dtype) for width in widths]
