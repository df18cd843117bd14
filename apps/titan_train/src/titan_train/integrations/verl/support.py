"""Pieces of the veRL engine (``titan_train.integrations.verl``): veRL's train / eval
context and its LR schedule. Imported only by that module, after veRL imported there."""

from __future__ import annotations

from typing import Any

import torch
from verl.utils import torch_functional as verl_F  # pyrefly: ignore[missing-import]
from verl.workers.config import FSDPOptimizerConfig  # pyrefly: ignore[missing-import]
from verl.workers.engine.base import BaseEngineCtx  # pyrefly: ignore[missing-import]

__all__ = ["ModeContext", "lr_scheduler"]


class ModeContext(BaseEngineCtx):
    """veRL's train/eval context: the module's mode; train zeroes the gradients on exit."""

    def __enter__(self) -> None:
        super().__enter__()
        self.engine.module.train(self.mode == "train")

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        zero = self.zero_grad_on_exit or exc_type is not None
        if self.mode == "train" and zero and self.engine.optimizer is not None:
            self.engine.optimizer_zero_grad()
        super().__exit__(exc_type, exc_value, traceback)


def lr_scheduler(optimizer: torch.optim.Optimizer, config: FSDPOptimizerConfig) -> Any:
    """veRL's LR schedule for ``config`` (constant or cosine, with warmup), as its FSDP
    engine builds it."""
    warmup = config.lr_warmup_steps
    if warmup is None or warmup <= 0:
        warmup = int(config.lr_warmup_steps_ratio * config.total_training_steps)
    if config.lr_scheduler_type == "constant":
        return verl_F.get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup)
    if config.lr_scheduler_type == "cosine":
        return verl_F.get_cosine_schedule_with_warmup(
            optimizer,
            num_warmup_steps=warmup,
            num_training_steps=config.total_training_steps,
            min_lr_ratio=config.min_lr_ratio,
            num_cycles=config.num_cycles,
            zero_indexed_step=config.zero_indexed_step,
        )
    raise ValueError(
        f"optimizer_config.lr_scheduler_type={config.lr_scheduler_type!r} must be 'constant' or "
        "'cosine'"
    )
