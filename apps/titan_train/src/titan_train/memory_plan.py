"""``--dry-run``: per-rank memory of a job, from the model built on the meta device and its
declarative plan, without allocating a byte or starting a process group.

For every parameter the plan decides its tensor-parallel split (column-/row-wise ⇒ /tp;
norms and QK-norms replicated), its pipeline stage (units balanced by parameter count with
titan_pipeline's ``balance``) and its data-parallel shard (/dp_shard, flexshard ``Shard(0)``).
Routed experts of MoE layers are split over ``ep`` instead (whole experts per rank, never
gathered).
Bytes per parameter element: parameters and gradients in fp32 (master weights), AdamW two
fp32 states (Muon one), plus the transiently gathered compute copy of the largest block.
Activations are not included: they depend on the remat policy and the micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

import titan_models
from titan_models import fqn_matches
from titan_pipeline import balance
from titan_train.config import JobConfig


@dataclass(frozen=True, slots=True)
class StageMemory:
    """Bytes one rank of a pipeline stage holds."""

    stage: int
    params: int
    grads: int
    optimizer: int
    gathered: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.gathered


def plan_memory(cfg: JobConfig, world_size: int) -> tuple[list[StageMemory], int, int]:
    """Per-stage, per-rank memory; also the total parameter count and the dp_shard used."""
    p = cfg.parallel
    dp_shard = p.dp_shard if p.dp_shard != -1 else world_size // (p.dp_replicate * p.tp * p.pp)
    if dp_shard < 1 or p.dp_replicate * dp_shard * p.tp * p.pp != world_size:
        raise ValueError(
            f"parallel degrees dp_replicate*dp_shard*tp*pp must equal the world size "
            f"{world_size}; got {p.dp_replicate}*{dp_shard}*{p.tp}*{p.pp}"
        )
    overrides = {"vocab_size": cfg.model.vocab_size} if cfg.model.vocab_size else {}
    model_cls, model_cfg = titan_models.get_model(cfg.model.family, cfg.model.flavor, **overrides)
    if model_cfg.num_heads % p.tp or model_cfg.num_kv_heads % p.tp:
        raise ValueError(
            f"parallel.tp={p.tp} must divide num_heads={model_cfg.num_heads} and "
            f"num_kv_heads={model_cfg.num_kv_heads} of {cfg.model.family} {cfg.model.flavor}"
        )
    with torch.device("meta"):
        model = model_cls(model_cfg)
    plan = titan_models.get_plan(model_cfg)
    units = plan.pipeline_units
    if p.pp > len(units):
        raise ValueError(f"parallel.pp={p.pp} exceeds the model's {len(units)} pipeline units")
    tp = plan.tensor_parallel
    split = (*tp.colwise, *tp.rowwise)
    stages = balance([u.num_params for u in units], p.pp)

    def tp_numel(fqn: str, numel: int) -> int:
        module = fqn.rsplit(".", 1)[0]
        return numel // p.tp if any(fqn_matches(pat, module) for pat in split) else numel

    def unit_of(fqn: str) -> int:
        for i, unit in enumerate(units):
            if any(fqn == m or fqn.startswith(m + ".") for m in unit.modules):
                return i
        raise AssertionError(f"parameter {fqn} belongs to no pipeline unit of the plan")

    routed = tuple(f"{pattern}.experts" for pattern in plan.experts)

    def is_routed(fqn: str) -> bool:
        module = fqn.rsplit(".", 1)[0]
        return any(fqn_matches(pat, module) for pat in routed)

    per_unit = [0] * len(units)
    per_unit_experts = [0] * len(units)
    stage_of_unit = {i: s for s, r in enumerate(stages) for i in r}
    seen: set[tuple[int, int]] = set()  # a tied weight counts once per stage that holds it
    for fqn, param in model.named_parameters(remove_duplicate=False):
        unit = unit_of(fqn)
        if (stage_of_unit[unit], id(param)) not in seen:
            seen.add((stage_of_unit[unit], id(param)))
            if is_routed(fqn):
                per_unit_experts[unit] += param.numel() // p.ep
            else:
                per_unit[unit] += tp_numel(fqn, param.numel())
    compute_bytes = 2 if cfg.training.mixed_precision == "bf16" else 4
    states = 2 if cfg.optimizer.name == "adamw" else 1
    out = []
    for s, r in enumerate(stages):
        local = sum(per_unit[i] for i in r)
        shard = -(-local // dp_shard) + sum(per_unit_experts[i] for i in r)
        gathered = max(per_unit[i] for i in r) * compute_bytes  # one unit gathered at a time
        out.append(StageMemory(s, 4 * shard, 4 * shard, 4 * states * shard, gathered))
    total = sum(p.numel() for p in model.parameters())
    return out, total, dp_shard


def dry_run(cfg: JobConfig, *, world_size: int | None = None) -> list[StageMemory]:
    """Print the per-rank memory table of ``cfg`` on ``world_size`` ranks (default: product
    of the configured degrees) and return it."""
    p = cfg.parallel
    if world_size is None:
        if p.dp_shard == -1:
            raise ValueError(
                "--dry-run needs parallel.dp_shard set (not -1) to know the world size"
            )
        world_size = p.dp_replicate * p.dp_shard * p.tp * p.pp
    table, total, dp_shard = plan_memory(cfg, world_size)
    gib = 2**30
    view = Table(
        title=(
            f"{cfg.model.family} {cfg.model.flavor}: {total / 1e9:.2f} B parameters on "
            f"{world_size} ranks (dp_replicate={p.dp_replicate} dp_shard={dp_shard} tp={p.tp} "
            f"pp={p.pp} ep={p.ep}), per rank"
        )
    )
    for col in ("stage", "params GiB", "grads GiB", "optimizer GiB", "gathered GiB", "total GiB"):
        view.add_column(col, justify="right")
    for m in table:
        view.add_row(
            str(m.stage),
            *(f"{v / gib:.2f}" for v in (m.params, m.grads, m.optimizer, m.gathered, m.total)),
        )
    Console().print(view)
    print("activations not included (they depend on remat policy and micro-batch size)")
    return table
