"""Evaluation of a model (one stage: the whole model) over validation batches: summed
cross-entropy, target tokens, and for image-text batches the answers predicted right."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from titan_train.losses import cross_entropy_sum, loss_sum


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Any,
    num_batches: int,
    device: torch.device,
    shard: Any = None,
) -> tuple[float, int, int, int]:
    """Summed cross-entropy, target-token count, and (image-text batches) answers right and
    answers seen over ``num_batches`` batches of ``loader`` (``shard``: this rank's part of a
    batch, under context parallelism)."""
    model.eval()
    total, tokens = torch.zeros((), dtype=torch.float64, device=device), 0
    right, answers = torch.zeros((), dtype=torch.long, device=device), 0
    for _ in range(num_batches):
        batch = next(loader) if shard is None else shard(next(loader))
        tokens += batch.num_target_tokens
        if batch.answers is None:
            total += loss_sum(model, batch.to(device)).double()
            continue
        answers += int(batch.answers.max()) + 1
        batch = batch.to(device)
        logits = model(batch.input_ids, **batch.model_inputs())
        total += cross_entropy_sum(logits, batch.labels).double()
        right += answers_right(logits, batch.labels, batch.answers)
    model.train()
    return float(total), tokens, int(right), answers


def answers_right(
    logits: torch.Tensor, labels: torch.Tensor, answers: torch.Tensor
) -> torch.Tensor:
    """How many samples have every answer token predicted (greedy) — on the device."""
    mask = answers >= 0
    wrong = (logits.argmax(-1) != labels)[mask].long()
    per_sample = torch.zeros(int(answers.numel()), dtype=torch.long, device=logits.device)
    per_sample.index_add_(0, answers[mask], wrong)
    seen = torch.zeros_like(per_sample).index_add_(0, answers[mask], torch.ones_like(wrong))
    return ((per_sample == 0) & (seen > 0)).sum()
