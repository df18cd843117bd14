"""Learning-rate schedules: linear warm-up then cosine, linear or warmup-stable-decay."""

from __future__ import annotations

import math

import torch

from titan_train.config import LRScheduleConfig


def lr_factor(step: int, total_steps: int, cfg: LRScheduleConfig) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based) of ``total_steps``."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.decay == "constant":
        return 1.0
    lo = cfg.min_lr_ratio
    if cfg.decay == "wsd":
        decay_steps = max(1, round(total_steps * cfg.wsd_decay_fraction))
        decay_start = max(cfg.warmup_steps, total_steps - decay_steps)
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
        return 1.0 - (1.0 - lo) * progress
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    if cfg.decay == "linear":
        return 1.0 - (1.0 - lo) * progress
    return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, cfg: LRScheduleConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following ``lr_factor`` (its state_dict checkpoints like any scheduler)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg)
    )
