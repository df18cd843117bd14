"""What the RL trainer ranks and generator replicas are built from: picklable factories (they
travel to Monarch actors) and the flexshard data-parallel hook of titan_rl's learner."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import flexshard
import titan_models
import titan_rl
from titan_train.device import replica_device


class StartingModel:
    """``model_factory(device)``: the starting run's HF export on ``device`` (the same weights
    on every rank and replica)."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.hf_dir = str(hf_dir)

    def __call__(self, device: torch.device) -> nn.Module:
        return titan_models.from_hf(self.hf_dir).to(device)


class AdamW:
    """``optimizer_factory(params)``: AdamW at a constant ``lr``, no weight decay."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def __call__(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0)


class Generators:
    """``generator_factory(index)``: a ``TorchGenerator`` over the starting model on the
    replica's device (``titan_train.device.replica_device``)."""

    def __init__(self, model: StartingModel, *, batch_invariant: bool) -> None:
        self.model, self.batch_invariant = model, batch_invariant

    def __call__(self, index: int) -> titan_rl.TorchGenerator:
        return titan_rl.TorchGenerator(
            self.model(replica_device(index)).eval(), batch_invariant=self.batch_invariant
        )


class FlexShardDataParallel:
    """titan_rl's ``DataParallel`` hook with flexshard: parameters sharded over the trainer
    group, gradients reduce-scattered in flexshard's backward hooks (so ``reduce_gradients``
    has nothing left to do), the global-norm clip flexshard's, the published weights each
    rank's local shards (objects with ``local_chunks``)."""

    def parallelize(self, model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
        # reduce_order="rank": every rank sums gradients in rank order, the sums one process
        # makes, so a data-parallel trainer reproduces one process's update.
        return flexshard.shard(model, group, reduce_order="rank")

    def reduce_gradients(self, model: nn.Module) -> None:
        return None

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return flexshard.clip_grad_norm_(model, max_norm)

    def state_dict(self, model: nn.Module) -> dict[str, Any]:
        return flexshard.sharded_state_dict(model)


def full_weights(learner: Any) -> dict[str, torch.Tensor] | None:
    """``trainer.run`` target: the whole model's weights on rank 0 (gathered), None elsewhere."""
    model: nn.Module = learner.model
    if not isinstance(model, flexshard.FlexShardModule):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return flexshard.full_state_dict(model) or None  # {} off rank 0
