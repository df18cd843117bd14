"""The training loop: build on meta, parallelize, materialise per shard, (resume), train with
accumulation and clipping, log, save, export.

This file composes the libraries; it implements none of their logic. One code path serves
one process, ``torchrun`` jobs on any device, and the fake backend (``comm.fake_world_size``):
``parallelize`` returns this rank's model parts, ``materialize`` gives them their weights, and
the step runs them directly (micro-batches) or through the pipeline schedule.

Loss scaling: every rank divides its summed cross-entropy by the step's *global* count of
target tokens (one all-reduce of a device scalar per step over the data- and
context-parallel ranks) and multiplies by their number, because flexshard averages gradients
over them. The result is the gradient of the mean loss over every target token of the
global batch, however it is split (a context-parallel rank holds a shard of every row). Nothing in a step reads a device value on the host: losses and norms stay on the
device and are read only when logged.
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
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import titan_models
from titan_train.checkpointing import (
    ConfigError,
    TrainState,
    checkpoint_state,
    export_hf,
    resume,
)
from titan_train.components import apply_overrides, loss_head, parse_overrides
from titan_train.config import JobConfig, validate
from titan_train.data.packing import IGNORE_INDEX, Batch, PackedLoader
from titan_train.data.sources import DocumentSource
from titan_train.data.tokenizers import Tokenizer, build_tokenizer
from titan_train.device import (
    FAKE_DEVICE,
    free_memory_bytes,
    init_fake_process_group,
    init_process_group,
    resolve_device,
)
from titan_train.lr_schedule import build_lr_scheduler
from titan_train.materialize import local_bytes, materialize
from titan_train.metrics import MetricsLogger, measure_matmul_flops, memory_bytes
from titan_train.parallelize import (
    ParallelDims,
    ParallelModel,
    build_mesh,
    build_stages,
    check_plan,
    parallelize,
)

__all__ = ["ConfigError", "StepResult", "build_model", "build_optimizer", "train", "train_step"]


def check_supported(cfg: JobConfig, dims: ParallelDims) -> None:
    """Reject combinations this trainer cannot run yet, before anything is built or written."""
    if dims.pp > 1 and cfg.checkpoint.export_hf:
        raise ValueError("checkpoint.export_hf with parallel.pp > 1 is not supported yet")
    if dims.ep > 1 and cfg.checkpoint.export_hf:
        raise ValueError("checkpoint.export_hf with parallel.ep > 1 is not supported yet")
    if dims.pp > 1 and cfg.compile.enabled:
        raise ValueError("compile.enabled with parallel.pp > 1 is not supported yet")
    chunked = any(n == "chunked_cross_entropy" for _, n in parse_overrides(cfg.model.overrides))
    if chunked and (dims.pp > 1 or dims.tp > 1):
        raise ValueError(
            "model.overrides output=chunked_cross_entropy needs parallel.pp=1 and parallel.tp=1 "
            "(the head must see whole rows of the vocabulary and the labels)"
        )
    if cfg.comm.fake_world_size and "LOCAL_RANK" in os.environ:
        raise ValueError(
            "comm.fake_world_size runs one process standing for a whole job: do not combine it "
            "with --nproc or torchrun"
        )


def model_config(cfg: JobConfig, tokenizer: Tokenizer) -> tuple[type, Any]:
    """The model class and config: from the HF folder when initialising from one, else the
    family's flavour (vocabulary from the tokenizer unless set)."""
    if cfg.checkpoint.init_from_hf:
        model_cls, config = titan_models.hf_model_config(cfg.checkpoint.init_from_hf)
        config = dataclasses.replace(config, attention_backend=cfg.model.attention_backend)
        if config.vocab_size < tokenizer.vocab_size:
            raise ValueError(
                f"checkpoint.init_from_hf model has vocab_size={config.vocab_size}, smaller than "
                f"the tokenizer's {tokenizer.vocab_size} (data.tokenizer={cfg.data.tokenizer!r})"
            )
        return model_cls, config
    overrides = {
        "vocab_size": cfg.model.vocab_size or tokenizer.vocab_size,
        "attention_backend": cfg.model.attention_backend,
    }
    if cfg.model.num_mtp_modules >= 0:
        overrides["num_mtp_modules"] = cfg.model.num_mtp_modules
    return titan_models.get_model(cfg.model.family, cfg.model.flavor, **overrides)


def build_model(cfg: JobConfig, tokenizer: Tokenizer, device: torch.device) -> nn.Module:
    """The whole model on one device, as one process would train it (the reference the
    parallel layouts are compared with: they hold pieces of exactly these weights)."""
    if cfg.checkpoint.init_from_hf:
        model = titan_models.from_hf(cfg.checkpoint.init_from_hf, device=device)
        backend = cfg.model.attention_backend
        model.config = dataclasses.replace(model.config, attention_backend=backend)
    else:
        model_cls, config = model_config(cfg, tokenizer)
        with torch.device("meta"):
            model = model_cls(config)
        model.init_weights(device=device, seed=cfg.training.seed)
    apply_overrides(model, cfg.model.overrides)
    return model


def build_optimizer(pm: ParallelModel, cfg: JobConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only; or Muon on the blocks' matrices (flexshard's
    distributed Muon: Owned matrices are orthogonalised on their owner) with AdamW for the
    rest (embeddings, head, norms)."""
    import flexshard

    named = [(n, p) for n, p in pm.named_parameters() if p.requires_grad]

    def ndim(p: torch.Tensor) -> int:
        info = flexshard.param_info(p)
        return len(info.shape) if info is not None else p.ndim

    o = cfg.optimizer
    if o.name == "muon":
        muon = [p for n, p in named if n.startswith("layers.") and ndim(p) == 2]
        ids = {id(p) for p in muon}
        rest = [p for _, p in named if id(p) not in ids]
        return flexshard.optim.Muon(
            [
                {"params": muon, "use_muon": True},
                {"params": rest, "use_muon": False, "lr": o.lr},
            ],
            lr=o.muon_lr,
            weight_decay=o.weight_decay,
            momentum=o.momentum,
            betas=o.betas,
            adamw_eps=o.eps,
            ns_dtype=torch.float32,
        )
    from torch.distributed.tensor import DTensor

    groups = []
    for decays in (True, False):
        params = [p for _, p in named if (ndim(p) >= 2) == decays]
        # Fused (foreach) updates need one tensor type per group: TP's DTensors apart from
        # the plain tensors of unsharded modules (norms, MoE experts under TP).
        for is_dtensor in (True, False):
            same = [p for p in params if isinstance(p, DTensor) == is_dtensor]
            if same:
                groups.append({"params": same, "weight_decay": o.weight_decay if decays else 0.0})
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, foreach=True)


def _loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    head = loss_head(model)
    if head is not None:  # the head computes the loss itself (chunked cross-entropy)
        with head.targets(batch.labels):
            return model(
                batch.input_ids, positions=batch.positions, document_ids=batch.document_ids
            )
    inputs = dict(positions=batch.positions, document_ids=batch.document_ids)
    num_mtp = getattr(model.config, "num_mtp_modules", 0)
    if num_mtp and model.training:  # multi-token prediction: its weighted mean, per token
        logits, mtp_logits = model(batch.input_ids, **inputs, return_mtp=True)
        mtp = titan_models.mtp_loss(
            mtp_logits,
            batch.labels,
            document_ids=batch.document_ids,
            weight=model.config.mtp_loss_weight,
            ignore_index=IGNORE_INDEX,
        )
        targets = (batch.labels != IGNORE_INDEX).sum()
        return _cross_entropy_sum(logits, batch.labels) + mtp * targets
    logits = model(batch.input_ids, **inputs)
    return _cross_entropy_sum(logits, batch.labels)


def _cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """What one step measured, on the device (read at log steps only)."""

    loss: torch.Tensor
    """Mean cross-entropy over every target token of the global batch."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping."""
    expert_counts: torch.Tensor | None
    """Tokens per expert of this rank's MoE layers, ``(layers, E)``; None without MoE."""


def train_step(
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: JobConfig,
    *,
    on_grads: Any = None,
) -> StepResult:
    """One optimizer step over ``grad_accum`` micro-batches of ``batch`` (on the training
    device); the loss is the mean over every target token of the global batch (see the module
    doc). Forces no host synchronisation. ``on_grads()`` runs once the gradients are
    complete, before clipping."""
    import flexshard

    dims = pm.dims
    batch = pm.shard_batch(batch)
    num_tokens = (batch.labels != IGNORE_INDEX).sum().to(torch.float32)
    if dims.dp_cp > 1:
        dist.all_reduce(num_tokens, group=pm.group("dp_cp"))
    scale = dims.dp_cp / num_tokens.clamp(min=1)
    micro = batch.split(cfg.training.grad_accum)
    total = torch.zeros((), dtype=torch.float32, device=num_tokens.device)
    for i, mb in enumerate(micro):
        last = i == len(micro) - 1
        if pm.sharded:  # accumulate locally, reduce in the last micro-batch's backward
            for part in pm.parts:
                part.set_requires_gradient_sync(last)
        if pm.schedule is not None:
            total += _pipeline_micro_step(pm, mb, scale, cfg, sync=last)
            continue
        with _autocast(cfg, mb.input_ids.device):
            loss = _loss_sum(pm.parts[0], mb) * scale
        loss.backward()
        total += loss.detach()
    if on_grads is not None:
        on_grads()
    clip = dict(
        extra_groups=[pm.group("pp")] if dims.pp > 1 else [],
        disjoint={pm.group("ep"): pm.expert_params} if pm.experts else None,
    )
    params = pm.parameters()
    if cfg.training.max_grad_norm > 0:
        norm = flexshard.clip_grad_norm_(params, cfg.training.max_grad_norm, **clip)
    else:
        norm = flexshard.global_grad_norm(params, **clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    counts = _expert_counts(pm)
    _update_expert_biases(pm)
    if dims.dp_cp > 1:  # each rank's share (of dp x cp times the mean); tp ranks agree
        dist.all_reduce(total, group=pm.group("dp_cp"))
    if dims.pp > 1:  # only the last stage holds the loss
        dist.all_reduce(total, group=pm.group("pp"))
    return StepResult(loss=total / dims.dp_cp, grad_norm=norm, expert_counts=counts)


def _expert_counts(pm: ParallelModel) -> torch.Tensor | None:
    """This step's tokens per expert of every MoE layer this rank routes, ``(layers, E)`` on
    the device (taken before the bias update resets them); None without MoE layers."""
    import dist_moe

    counts = [
        m.router.tokens_per_expert
        for part in pm.parts
        for m in part.modules()
        if isinstance(m, dist_moe.MoE)
    ]
    return torch.stack(counts).float() if counts else None


def _moe_load(counts: torch.Tensor | None) -> dict[str, float]:
    """Routing balance: max and mean over MoE layers of max/mean load (reads ``counts`` on
    the host: call it at log steps only)."""
    if counts is None:
        return {}
    mean = counts.mean(1)
    ratios = (counts.amax(1) / mean)[mean > 0].tolist()  # a layer that saw no token: left out
    if not ratios:
        return {}
    return {"moe_load_max": max(ratios), "moe_load_mean": sum(ratios) / len(ratios)}


def _sync_on_last(pm: ParallelModel, m: int) -> Any:
    """Reduce each stage's gradients (flexshard) in its last microbatch's backward only."""

    def hook(stage: Any, microbatch: int) -> None:
        stage.module.set_requires_gradient_sync(microbatch == m - 1)

    return hook if pm.sharded else None


def _pipeline_micro_step(
    pm: ParallelModel, mb: Batch, scale: torch.Tensor, cfg: JobConfig, *, sync: bool
) -> torch.Tensor:
    m = cfg.parallel.pp_microbatches

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _cross_entropy_sum(logits, labels) * scale

    with _autocast(cfg, mb.input_ids.device):
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
        stage_kwargs=_side_inputs(batch, m),
        stage_outputs=[((*size, width), dtype) for width, dtype in pm.stage_outputs],
        **options,
    )
    total = torch.zeros((), dtype=torch.float32, device=batch.input_ids.device)
    for loss in losses:
        total += loss.detach().float()
    return total


def _update_expert_biases(pm: ParallelModel) -> None:
    """Aux-loss-free balancing: one bias update per step from the loads of every DP rank."""
    import dist_moe

    group = pm.group("dp_cp")  # every rank's tokens (None: one process)
    for part in pm.parts:
        dist_moe.update_expert_biases(part, group)


def _side_inputs(batch: Batch, m: int) -> list[dict[str, torch.Tensor]]:
    """What every pipeline stage needs besides its input, per microbatch."""
    return [
        {"positions": pos, "document_ids": doc}
        for pos, doc in zip(batch.positions.chunk(m), batch.document_ids.chunk(m), strict=True)
    ]


def _autocast(cfg: JobConfig, device: torch.device) -> Any:
    if device.type == FAKE_DEVICE.type:  # autocast has no meta variant; flexshard casts
        return torch.autocast("cpu", enabled=False)
    bf16 = cfg.training.mixed_precision == "bf16"
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: PackedLoader,
    num_batches: int,
    device: torch.device,
    shard: Any = None,
) -> tuple[float, int]:
    """Summed cross-entropy and target-token count over ``num_batches`` batches of ``loader``
    (``shard``: this rank's part of a batch, under context parallelism)."""
    model.eval()
    total, tokens = torch.zeros((), dtype=torch.float64, device=device), 0
    for _ in range(num_batches):
        batch = next(loader) if shard is None else shard(next(loader))
        tokens += batch.num_target_tokens
        total += _loss_sum(model, batch.to(device)).double()
    model.train()
    return float(total), tokens


def _loaders(
    cfg: JobConfig, tokenizer: Tokenizer, *, dp_rank: int = 0, dp_size: int = 1
) -> tuple[PackedLoader, DocumentSource]:
    """This data-parallel rank's training stream (every ``dp_size``-th document) and its
    validation source."""
    d, t = cfg.data, cfg.training
    common = dict(
        kind=d.source,
        seed=t.seed,
        validation_fraction=d.validation_fraction,
        paths=d.paths,
        text_field=d.text_field,
        slip_rate=d.arithmetic_slip_rate,
        reverse_answer=d.arithmetic_reverse_answer,
        rank=dp_rank,
        world_size=dp_size,
    )
    train_src = DocumentSource(split="train", **common)
    val_src = DocumentSource(split="validation", **common)
    return PackedLoader(train_src, tokenizer, seq_len=t.seq_len, batch_size=t.batch_size), val_src


def _check_memory(pm: ParallelModel, cfg: JobConfig, device: torch.device) -> None:
    """Fail before allocating when this rank's parameters, gradients and optimizer state
    cannot fit on its device (activations come on top)."""
    need = local_bytes(
        pm, optimizer=cfg.optimizer.name, bf16=cfg.training.mixed_precision == "bf16"
    )
    free = free_memory_bytes(device)
    if sum(need.values()) > free:
        gib = {k: f"{v / 2**30:.2f}" for k, v in need.items()}
        raise ConfigError(
            f"{cfg.model.family} {cfg.model.flavor} needs {sum(need.values()) / 2**30:.2f} GiB "
            f"per rank on {device} before activations (params {gib['params']}, grads "
            f"{gib['grads']}, optimizer {gib['optimizer']}, gathered {gib['gathered']} GiB) but "
            f"{free / 2**30:.2f} GiB are free; use more ranks or a smaller model (see "
            f"--comm.fake-world-size for the per-rank memory of a layout)"
        )


def prepare(
    cfg: JobConfig, *, world_size: int | None = None
) -> tuple[ParallelDims, Tokenizer, type, Any]:
    """Every check that can reject ``cfg``, before any process group, allocation or file:
    ``ConfigError`` naming the field. ``world_size``: that of a job about to be launched
    (default: the fake world size, or torchrun's ``WORLD_SIZE``)."""
    try:
        validate(cfg)
        fake = cfg.comm.fake_world_size
        world = world_size or fake or int(os.environ.get("WORLD_SIZE", "1"))
        dims = ParallelDims.resolve(cfg, world)
        check_supported(cfg, dims)
        tokenizer = build_tokenizer(cfg.data.tokenizer)
        model_cls, config = model_config(cfg, tokenizer)
        check_plan(cfg, dims, config)
        with torch.device("meta"):  # overrides checked on a model that allocates nothing
            apply_overrides(model_cls(config), cfg.model.overrides)
        _loaders(cfg, tokenizer)  # checks data files and fields
        if not fake:
            resolve_device(cfg.training.device)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return dims, tokenizer, model_cls, config


def build(
    cfg: JobConfig, dims: ParallelDims, model_cls: type, config: Any, *, fake_rank: int = 0
) -> ParallelModel:
    """This rank's model parts, parallelised on the meta device (nothing allocated); in
    fake-backend mode, those of rank ``fake_rank``."""
    from titan_train.device import device_type

    if cfg.comm.fake_world_size:
        init_fake_process_group(cfg.comm.fake_world_size, fake_rank)
        mesh_type = "cuda" if cfg.training.device == "auto" else cfg.training.device
    else:
        device = resolve_device(cfg.training.device)
        init_process_group(device, cfg.comm.timeout_s)
        mesh_type = device_type(cfg.training.device)
    mesh = build_mesh(dims, mesh_type)
    with torch.device("meta"):
        model = model_cls(config)
    apply_overrides(model, cfg.model.overrides)
    if cfg.comm.fake_world_size:
        from titan_train.fake import static_moe

        static_moe(model)
    try:
        return parallelize(model, cfg, dims, mesh)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def train(cfg: JobConfig, *, stop_after: int | None = None) -> dict[str, Any]:
    """Run ``cfg`` to the end (or to step ``stop_after``, for resume tests); returns a summary.

    Outputs go to ``<output_dir>/<name>/``: ``config.json``, ``metrics.jsonl``, TensorBoard
    events, ``loss.png``, ``checkpoints/`` and, when asked, ``hf/`` (written by rank 0). With
    ``comm.fake_world_size`` it runs the fake backend instead (``titan_train.fake``).
    """
    dims, tokenizer, model_cls, config = prepare(cfg)
    if cfg.comm.fake_world_size:
        from titan_train.fake import run_fake

        return run_fake(cfg, dims, tokenizer, model_cls, config)
    device = resolve_device(cfg.training.device)
    if cfg.training.deterministic:
        if device.type == "cuda":  # cuBLAS needs a fixed workspace to be deterministic
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    pm = build(cfg, dims, model_cls, config)
    _check_memory(pm, cfg, device)
    materialize(pm, device, seed=cfg.training.seed, hf_path=cfg.checkpoint.init_from_hf)
    if dims.pp > 1:
        build_stages(pm, cfg)
    rank = dist.get_rank() if dims.world_size > 1 else 0
    torch.manual_seed(cfg.training.seed + pm.dp_rank)
    random.seed(cfg.training.seed + pm.dp_rank)
    loader, val_src = _loaders(cfg, tokenizer, dp_rank=pm.dp_rank, dp_size=dims.dp)
    optimizer = build_optimizer(pm, cfg)
    scheduler = build_lr_scheduler(optimizer, cfg.training.steps, cfg.lr_schedule)
    state = TrainState(device)

    run_dir = Path(cfg.output_dir) / cfg.name
    stateful = checkpoint_state(pm, optimizer, scheduler, loader, state)
    ckpt = resume(cfg, run_dir, stateful)  # before anything is written to the run folder
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    if dims.world_size > 1:
        dist.barrier()

    logger = MetricsLogger(
        run_dir,
        total_steps=cfg.training.steps,
        tensorboard=cfg.metrics.tensorboard,
        enabled=rank == 0,
    )
    bf16 = cfg.training.mixed_precision == "bf16"
    peak = cfg.metrics.peak_flops or measure_matmul_flops(
        device, dtype=torch.bfloat16 if bf16 and device.type != "cpu" else torch.float32
    )
    flops_per_token = titan_models.flops_per_token(config, cfg.training.seq_len)
    tokens_per_step = cfg.training.batch_size * cfg.training.seq_len * dims.dp
    losses: list[float] = []
    pending: list[torch.Tensor] = []  # device losses not yet read
    last_log = time.perf_counter()
    steps_since_log = 0
    end = cfg.training.steps if stop_after is None else min(stop_after, cfg.training.steps)
    while state.step < end:
        batch = next(loader).to(device)
        result = train_step(pm, optimizer, batch, cfg)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        state.step += 1
        steps_since_log += 1
        pending.append(result.loss)
        if state.step % cfg.metrics.log_every == 0 or state.step == end:
            losses += torch.stack(pending).tolist()  # the one host read per log interval
            pending.clear()
            elapsed = time.perf_counter() - last_log
            tps = steps_since_log * tokens_per_step / elapsed
            logger.log(
                state.step,
                {
                    "loss": losses[-1],
                    "grad_norm": float(result.grad_norm),
                    "lr": lr,
                    "tokens_per_s": tps,
                    "mfu": tps * flops_per_token / (peak * dims.world_size),
                    **_moe_load(result.expert_counts),
                    **memory_bytes(device),
                },
            )
            last_log, steps_since_log = time.perf_counter(), 0
        every = cfg.metrics.validate_every
        if every and (state.step % every == 0 or state.step == cfg.training.steps):
            val = _validate(pm, cfg, tokenizer, val_src, device)
            logger.log(state.step, {"loss": val}, prefix="validation")
        if ckpt is not None and state.step % cfg.checkpoint.interval == 0:
            ckpt.save(state.step, stateful)
    if ckpt is not None:
        ckpt.wait()
        ckpt.close()
    logger.close()
    if cfg.checkpoint.export_hf and state.step == cfg.training.steps:
        export_hf(pm, model_cls, config, run_dir / "hf")
    return {"losses": losses, "run_dir": run_dir, "model": pm.parts[0], "step": state.step}


def _validate(
    pm: ParallelModel,
    cfg: JobConfig,
    tokenizer: Tokenizer,
    val_src: DocumentSource,
    device: torch.device,
) -> float:
    """Mean validation loss over every data-parallel rank's batches (under pipelining: the
    schedule's forward actions only)."""
    t = cfg.training
    val_loader = PackedLoader(val_src, tokenizer, seq_len=t.seq_len, batch_size=t.batch_size)
    if pm.schedule is None:
        n = cfg.metrics.validation_batches
        total, tokens = evaluate(pm.parts[0], val_loader, n, device, pm.shard_batch)
    else:
        total, tokens = _evaluate_pipeline(pm, val_loader, cfg, device)
    if pm.dims.world_size > 1:
        both = torch.tensor([total, float(tokens)], dtype=torch.float64, device=device)
        dist.all_reduce(both, group=pm.group("dp_cp"))
        total, tokens = float(both[0]), int(both[1])
    return total / max(1, tokens)


@torch.no_grad()
def _evaluate_pipeline(
    pm: ParallelModel, loader: PackedLoader, cfg: JobConfig, device: torch.device
) -> tuple[float, int]:
    for part in pm.parts:
        part.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    m = cfg.parallel.pp_microbatches
    for _ in range(cfg.metrics.validation_batches):
        batch = pm.shard_batch(next(loader))
        tokens += batch.num_target_tokens
        total += _run_pipeline(pm, batch.to(device), m, _cross_entropy_sum, forward_only=True)
    for part in pm.parts:
        part.train()
    if not pm.has_head:
        total.zero_()
    dist.all_reduce(total, group=pm.group("pp"))  # the last stage's sum to every stage
    return float(total), tokens
