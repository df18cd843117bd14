"""The training loop: build, (resume), train with accumulation and clipping, log, save, export.

This file composes the libraries; it implements none of their logic. Today it trains on one
process; the composed parallelize step (flexshard, TP, PP, EP) is not wired in yet and any
parallel degree > 1 is rejected with a clear error before anything is built or written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import titan_models
from titan_train.config import JobConfig, validate
from titan_train.data.packing import IGNORE_INDEX, Batch, PackedLoader
from titan_train.data.sources import DocumentSource
from titan_train.data.tokenizers import Tokenizer, build_tokenizer
from titan_train.lr_schedule import build_lr_scheduler
from titan_train.metrics import MetricsLogger, measure_matmul_flops, memory_bytes


class ConfigError(ValueError):
    """The job cannot start with this config; raised before anything is written."""


@dataclasses.dataclass(slots=True)
class TrainState:
    """Progress that a checkpoint must restore besides model, optimizer and data."""

    step: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "rng": _rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        _set_rng_state(state["rng"])


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(int(x) for x in state["python"]), None))


def check_supported(cfg: JobConfig, world_size: int) -> None:
    """Reject what this trainer cannot run yet, before anything is built or written."""
    p = cfg.parallel
    degrees = {
        "parallel.dp_replicate": p.dp_replicate,
        "parallel.tp": p.tp,
        "parallel.pp": p.pp,
        "parallel.ep": p.ep,
    }
    dp_shard = world_size if p.dp_shard == -1 else p.dp_shard
    degrees["parallel.dp_shard"] = dp_shard
    product = p.dp_replicate * dp_shard * p.tp * p.pp
    if product != world_size:
        raise ValueError(
            f"parallel degrees dp_replicate*dp_shard*tp*pp = {product} must equal the world "
            f"size {world_size}"
        )
    too_big = {k: v for k, v in degrees.items() if v > 1}
    if too_big:
        raise ValueError(
            f"{', '.join(f'{k}={v}' for k, v in too_big.items())}: multi-process parallelism "
            "is not wired into titan-train yet; run with all degrees 1 on one process"
        )
    if cfg.optimizer.name != "adamw":
        raise ValueError(f"optimizer.name={cfg.optimizer.name!r}: only 'adamw' is wired in yet")
    if cfg.remat.policy != "none" or cfg.compile.enabled:
        raise ValueError("remat.policy and compile.enabled are not wired into titan-train yet")


def build_model(cfg: JobConfig, tokenizer: Tokenizer, device: torch.device) -> nn.Module:
    """The recipe's model: from an HF folder, or built on meta and initialised on ``device``."""
    if cfg.checkpoint.init_from_hf:
        model = titan_models.from_hf(cfg.checkpoint.init_from_hf, device=str(device))
        vocab = model.config.vocab_size
        if vocab < tokenizer.vocab_size:
            raise ValueError(
                f"checkpoint.init_from_hf model has vocab_size={vocab}, smaller than the "
                f"tokenizer's {tokenizer.vocab_size} (data.tokenizer={cfg.data.tokenizer!r})"
            )
        return model
    overrides = {"vocab_size": cfg.model.vocab_size or tokenizer.vocab_size}
    model_cls, model_cfg = titan_models.get_model(cfg.model.family, cfg.model.flavor, **overrides)
    with torch.device("meta"):
        model = model_cls(model_cfg)
    return model.init_weights(device=device, seed=cfg.training.seed)


def build_optimizer(model: nn.Module, cfg: JobConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    o = cfg.optimizer
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": o.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
        foreach=True,
    )


def _loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    logits = model(batch.input_ids, positions=batch.positions, document_ids=batch.document_ids)
    return F.cross_entropy(
        logits.flatten(0, 1).float(),
        batch.labels.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: JobConfig,
) -> tuple[float, float]:
    """One optimizer step over ``grad_accum`` micro-batches; returns (loss, grad norm).

    The loss is the mean over every target token of the whole step, whatever the split into
    micro-batches: each micro-batch's summed loss is divided by the step's token count.
    """
    micro = batch.split(cfg.training.grad_accum)
    num_tokens = max(1, batch.num_target_tokens)
    total = torch.zeros(())
    for mb in micro:
        with _autocast(cfg):
            loss = _loss_sum(model, mb) / num_tokens
        loss.backward()
        total += loss.detach()
    if cfg.training.max_grad_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_grad_norm)
    else:
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None]
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total), float(norm)


def _autocast(cfg: JobConfig) -> Any:
    if cfg.training.mixed_precision == "bf16":
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    return torch.autocast(device_type="cpu", enabled=False)


@torch.no_grad()
def evaluate(model: nn.Module, loader: PackedLoader, num_batches: int) -> float:
    """Mean cross-entropy per target token over ``num_batches`` batches of ``loader``."""
    model.eval()
    total, tokens = 0.0, 0
    for _ in range(num_batches):
        batch = next(loader)
        total += float(_loss_sum(model, batch))
        tokens += batch.num_target_tokens
    model.train()
    return total / max(1, tokens)


def _loaders(cfg: JobConfig, tokenizer: Tokenizer) -> tuple[PackedLoader, DocumentSource]:
    d, t = cfg.data, cfg.training
    common = dict(
        kind=d.source,
        seed=t.seed,
        validation_fraction=d.validation_fraction,
        paths=d.paths,
        text_field=d.text_field,
    )
    train_src = DocumentSource(split="train", **common)
    val_src = DocumentSource(split="validation", **common)
    return PackedLoader(train_src, tokenizer, seq_len=t.seq_len, batch_size=t.batch_size), val_src


def train(cfg: JobConfig, *, stop_after: int | None = None) -> dict[str, Any]:
    """Run ``cfg`` to the end (or to step ``stop_after``, for resume tests); returns a summary.

    Outputs go to ``<output_dir>/<name>/``: ``config.json``, ``metrics.jsonl``, TensorBoard
    events, ``loss.png``, ``checkpoints/`` and, when asked, ``hf/``.
    """
    try:  # everything that can reject the config runs before anything is written
        validate(cfg)
        check_supported(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        tokenizer = build_tokenizer(cfg.data.tokenizer)
        loader, val_src = _loaders(cfg, tokenizer)
        torch.manual_seed(cfg.training.seed)
        random.seed(cfg.training.seed)
        if cfg.training.deterministic:
            torch.use_deterministic_algorithms(True)
        device = torch.device("cpu")
        model = build_model(cfg, tokenizer, device)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    optimizer = build_optimizer(model, cfg)
    scheduler = build_lr_scheduler(optimizer, cfg.training.steps, cfg.lr_schedule)
    state = TrainState()

    run_dir = Path(cfg.output_dir) / cfg.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    ckpt = _checkpoint_manager(cfg, run_dir)
    stateful = {"model": model, "optim": optimizer, "lr": scheduler, "data": loader, "train": state}
    if ckpt is not None and cfg.checkpoint.resume and ckpt.latest_step() is not None:
        ckpt.load(stateful)

    logger = MetricsLogger(
        run_dir, total_steps=cfg.training.steps, tensorboard=cfg.metrics.tensorboard
    )
    peak = cfg.metrics.peak_flops or measure_matmul_flops()
    flops_per_token = titan_models.flops_per_token(model.config, cfg.training.seq_len)
    tokens_per_step = cfg.training.batch_size * cfg.training.seq_len
    losses: list[float] = []
    last_log = time.perf_counter()
    steps_since_log = 0
    end = cfg.training.steps if stop_after is None else min(stop_after, cfg.training.steps)
    while state.step < end:
        batch = next(loader)
        loss, grad_norm = train_step(model, optimizer, batch, cfg)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        state.step += 1
        steps_since_log += 1
        losses.append(loss)
        if state.step % cfg.metrics.log_every == 0 or state.step == end:
            elapsed = time.perf_counter() - last_log
            tps = steps_since_log * tokens_per_step / elapsed
            logger.log(
                state.step,
                {
                    "loss": loss,
                    "grad_norm": grad_norm,
                    "lr": lr,
                    "tokens_per_s": tps,
                    "mfu": tps * flops_per_token / peak,
                    **memory_bytes(),
                },
            )
            last_log, steps_since_log = time.perf_counter(), 0
        every = cfg.metrics.validate_every
        if every and (state.step % every == 0 or state.step == cfg.training.steps):
            val_loader = PackedLoader(
                val_src, tokenizer, seq_len=cfg.training.seq_len, batch_size=cfg.training.batch_size
            )
            val = evaluate(model, val_loader, cfg.metrics.validation_batches)
            logger.log(state.step, {"loss": val}, prefix="validation")
        if ckpt is not None and state.step % cfg.checkpoint.interval == 0:
            ckpt.save(state.step, stateful)
    if ckpt is not None:
        ckpt.wait()
        ckpt.close()
    logger.close()
    if cfg.checkpoint.export_hf and state.step == cfg.training.steps:
        titan_models.to_hf(model, run_dir / "hf")
    return {"losses": losses, "run_dir": run_dir, "model": model, "step": state.step}


def _checkpoint_manager(cfg: JobConfig, run_dir: Path) -> Any:
    if cfg.checkpoint.interval == 0:
        return None
    from torch_checkpointing import CheckpointManager

    return CheckpointManager(
        run_dir / "checkpoints",
        async_mode=cfg.checkpoint.async_mode,
        keep_last=cfg.checkpoint.keep_last,
    )
