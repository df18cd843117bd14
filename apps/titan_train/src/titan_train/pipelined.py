"""The pipeline-parallel step and evaluation: one titan_pipeline schedule run over a batch's
microbatches, with flexshard's gradient reduction in each stage's last microbatch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from titan_train.config import JobConfig
from titan_train.data.packing import Batch
from titan_train.losses import autocast, cross_entropy_sum
from titan_train.parallelize import ParallelModel

__all__ = ["evaluate_pipeline", "pipeline_micro_step"]


def _sync_on_last(pm: ParallelModel, m: int) -> Any:
    """Reduce each stage's gradients (flexshard) in its last microbatch's backward only."""

    def hook(stage: Any, microbatch: int) -> None:
        stage.module.set_requires_gradient_sync(microbatch == m - 1)

    return hook if pm.sharded else None


def pipeline_micro_step(
    pm: ParallelModel, mb: Batch, scale: torch.Tensor, cfg: JobConfig, *, sync: bool
) -> torch.Tensor:
    """The summed, ``scale``d loss of one micro-batch ``mb`` run through the pipeline schedule
    in ``cfg.parallel.pp_microbatches`` pieces; gradients reduce only when ``sync``."""
    m = cfg.parallel.pp_microbatches

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy_sum(logits, labels) * scale

    with autocast(cfg, mb.input_ids.device):
        return _run_pipeline(
            pm,
            mb,
            m,
            loss_fn,
            loss_scale=1.0,
            before_backward=_sync_on_last(pm, m) if sync else None,
        )


def _run_pipeline(
    pm: ParallelModel, batch: Batch, m: int, loss_fn: Any, **options: Any
) -> torch.Tensor:
    """One titan_pipeline step over ``batch`` in ``m`` microbatches; the summed losses (zero on
    ranks without the last stage), on the device."""
    import titan_pipeline

    inputs = titan_pipeline.split_microbatches(batch.input_ids, m)
    size = tuple(inputs[0].shape)
    losses = titan_pipeline.run(
        pm.schedule,
        pm.stages,
        inputs,
        titan_pipeline.split_microbatches(batch.labels, m),
        loss_fn,
        stage_kwargs=_side_inputs(batch, m, pm.stage_inputs),
        stage_outputs=[((*size, width), dtype) for width, dtype in pm.stage_outputs],
        **options,
    )
    total = torch.zeros((), dtype=torch.float32, device=batch.input_ids.device)
    for loss in losses:
        total += loss.detach().float()
    return total


def _side_inputs(batch: Batch, m: int, extra: tuple[str, ...] = ()) -> list[dict[str, object]]:
    """What every pipeline stage needs besides its input, per microbatch: positions, document
    ids and the plan's ``stage_inputs`` (``token_ids``: the input ids)."""
    fields = {"positions": batch.positions, "document_ids": batch.document_ids}
    for name in extra:
        if name != "token_ids":
            raise ValueError(f"pipeline stage input {name!r} is unknown (known: token_ids)")
        fields[name] = batch.input_ids
    chunks = {k: v.chunk(m) for k, v in fields.items()}
    return [{k: v[i] for k, v in chunks.items()} for i in range(m)]


@torch.no_grad()
def evaluate_pipeline(
    pm: ParallelModel, loader: Iterator[Batch], cfg: JobConfig, device: torch.device
) -> tuple[float, int]:
    """Summed validation cross-entropy (the schedule's forward actions only) and the target
    token count over ``cfg.metrics.validation_batches`` batches, on every stage."""
    for part in pm.parts:
        part.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    m = cfg.parallel.pp_microbatches
    for _ in range(cfg.metrics.validation_batches):
        batch = pm.shard_batch(next(loader))
        tokens += batch.num_target_tokens
        total += _run_pipeline(pm, batch.to(device), m, cross_entropy_sum, forward_only=True)
    for part in pm.parts:
        part.train()
    if not pm.has_head:
        total.zero_()
    dist.all_reduce(total, group=pm.group("pp"))  # the last stage's sum to every stage
    return float(total), tokens
