"""Evaluation of a model (one stage: the whole model) over validation batches: summed
cross-entropy, target tokens, and for image-text batches the answers predicted right."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from titan_train.config import JobConfig
from titan_train.data.image_files import ImageFilesSource
from titan_train.data.image_text import ShapesSource
from titan_train.data.packing import IGNORE_INDEX, Batch, PackedLoader
from titan_train.loaders import ValidationSource, image_text_loader
from titan_train.losses import cross_entropy_sum, loss_sum
from titan_train.parallelize import ParallelModel
from titan_train.pipelined import evaluate_pipeline

if TYPE_CHECKING:
    from titan_train.build import Job


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterator[Batch],
    num_batches: int,
    device: torch.device,
    shard: Callable[[Batch], Batch] | None = None,
    *,
    exact_match: bool = False,
) -> tuple[float, int, int, int]:
    """Summed cross-entropy, target-token count, and answers right and answers seen over
    ``num_batches`` batches of ``loader`` (``shard``: this rank's part of a batch, under
    context parallelism). Answers are the image-text batches' marked spans, or with
    ``exact_match`` (chat data) each sample's trained tokens: right when every one of them is
    the greedy prediction, which is exactly when greedy decoding from the sample's prompt and
    history reproduces its replies and their stop tokens."""
    model.eval()
    total, tokens = torch.zeros((), dtype=torch.float64, device=device), 0
    right, answers = torch.zeros((), dtype=torch.long, device=device), 0
    for _ in range(num_batches):
        batch = next(loader) if shard is None else shard(next(loader))
        tokens += batch.num_target_tokens
        if batch.answers is None and exact_match:
            batch = dataclasses.replace(batch, answers=sample_answers(batch))
        if batch.answers is None:
            total += loss_sum(model, batch.to(device)).double()
            continue
        answers += int(batch.answers.max()) + 1
        batch = batch.to(device)
        assert batch.answers is not None  # Batch.to keeps them
        logits = model(batch.input_ids, **batch.model_inputs())
        total += cross_entropy_sum(logits, batch.labels).double()
        right += answers_right(logits, batch.labels, batch.answers)
    model.train()
    return float(total), tokens, int(right), answers


def sample_answers(batch: Batch) -> torch.Tensor:
    """Per target token, the index (0, 1, ...) of its sample in the batch, -1 where there is
    no loss: a packed chat batch's samples as answers (samples never straddle rows)."""
    trained = batch.labels != IGNORE_INDEX
    answers = torch.full_like(batch.labels, -1)
    _, index = torch.unique(batch.document_ids[trained], return_inverse=True)
    answers[trained] = index
    return answers


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


def validate_run(
    pm: ParallelModel, job: Job, val_src: ValidationSource, device: torch.device
) -> dict[str, float]:
    """Mean validation loss over every data-parallel rank's batches (under pipelining: the
    schedule's forward actions only), and the answer accuracy of image-text data."""
    cfg, tokenizer, t = job.cfg, job.tokenizer, job.cfg.training
    val_loader: Iterator[Batch]
    if isinstance(val_src, (ShapesSource, ImageFilesSource)):
        val_loader = image_text_loader(cfg, tokenizer, val_src, job.model_config)
    else:
        val_loader = PackedLoader(val_src, tokenizer, seq_len=t.seq_len, batch_size=t.batch_size)
    right = answers = 0
    if pm.schedule is None:
        n = cfg.metrics.validation_batches
        # Exact match needs whole samples and logits: not under CP or the chunked-CE head.
        chat = cfg.data.source == "chat" and pm.dims.cp == 1 and not _chunked_head(cfg)
        total, tokens, right, answers = evaluate(
            pm.parts[0], val_loader, n, device, pm.shard_batch, exact_match=chat
        )
    else:
        total, tokens = evaluate_pipeline(pm, val_loader, cfg, device)
    if pm.dims.world_size > 1:
        sums = [total, float(tokens), float(right), float(answers)]
        both = torch.tensor(sums, dtype=torch.float64, device=device)
        dist.all_reduce(both, group=pm.group("dp_cp"))
        total, tokens, right, answers = float(both[0]), int(both[1]), int(both[2]), int(both[3])
    out = {"loss": total / max(1, tokens)}
    if answers:
        out["answer_accuracy"] = right / answers
    return out


def _chunked_head(cfg: JobConfig) -> bool:
    from titan_train.components import parse_overrides

    return any(name == "chunked_cross_entropy" for _, name in parse_overrides(cfg.model.overrides))
