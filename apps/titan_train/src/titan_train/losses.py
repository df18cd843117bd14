"""The training objective: summed cross-entropy over a batch's target tokens (with the
model's chunked loss head or multi-token prediction when it has them), under the device's
autocast."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import titan_models
from titan_train.components import loss_head
from titan_train.config import JobConfig
from titan_train.data.packing import IGNORE_INDEX, Batch
from titan_train.device import FAKE_DEVICE

__all__ = ["autocast", "cross_entropy_sum", "loss_sum"]


def loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Summed loss of ``model`` over ``batch``'s target tokens (scaled by the caller)."""
    head = loss_head(model)
    if head is not None:  # the head computes the loss itself (chunked cross-entropy)
        with head.targets(batch.labels):
            return model(batch.input_ids, **batch.model_inputs())
    inputs = batch.model_inputs()
    config = model.config
    mtp = isinstance(config, titan_models.DeepSeekV3Config) and config.num_mtp_modules > 0
    if mtp and model.training:  # multi-token prediction (DeepSeek-V3, Kimi): weighted, per token
        assert isinstance(config, titan_models.DeepSeekV3Config)
        logits, mtp_logits = model(batch.input_ids, **inputs, return_mtp=True)
        mtp = titan_models.mtp_loss(
            mtp_logits,
            batch.labels,
            document_ids=batch.document_ids,
            weight=config.mtp_loss_weight,
            ignore_index=IGNORE_INDEX,
        )
        targets = (batch.labels != IGNORE_INDEX).sum()
        return cross_entropy_sum(logits, batch.labels) + mtp * targets
    logits = model(batch.input_ids, **inputs)
    return cross_entropy_sum(logits, batch.labels)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the tokens whose label is not ``IGNORE_INDEX`` (in fp32)."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def autocast(cfg: JobConfig, device: torch.device) -> Any:
    """bf16 autocast on ``device`` when the job asks for it (off in fake mode)."""
    if device.type == FAKE_DEVICE.type:  # autocast has no meta variant; flexshard casts
        return torch.autocast("cpu", enabled=False)
    bf16 = cfg.training.mixed_precision == "bf16"
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16)
