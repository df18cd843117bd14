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
import os
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import titan_models
from titan_train.checkpointing import (
    TrainState,
    checkpoint_state,
    export_hf,
    resume,
)
from titan_train.components import apply_overrides, parse_overrides
from titan_train.config import JobConfig, validate
from titan_train.data.chat import chat_sources
from titan_train.data.image_files import ImageFilesSource
from titan_train.data.image_text import ImageProcessor, ImageTextLoader, ShapesSource
from titan_train.data.packing import IGNORE_INDEX, Batch, PackedLoader
from titan_train.data.sources import DocumentSource
from titan_train.data.tokenizers import Tokenizer, build_tokenizer
from titan_train.device import (
    free_memory_bytes,
    init_fake_process_group,
    init_process_group,
    resolve_device,
)
from titan_train.errors import ConfigError, NonFiniteError
from titan_train.evaluation import evaluate
from titan_train.losses import autocast, loss_sum
from titan_train.low_precision import apply_quantize, check_low_precision
from titan_train.lr_schedule import build_lr_scheduler
from titan_train.materialize import local_bytes, materialize
from titan_train.metrics import MetricsLogger, measure_matmul_flops, memory_bytes
from titan_train.moe_balance import expert_counts, moe_load, update_expert_biases
from titan_train.numerics import NonFiniteGuard
from titan_train.parallelize import (
    ParallelDims,
    ParallelModel,
    build_mesh,
    build_stages,
    check_plan,
    parallelize,
)
from titan_train.pipelined import evaluate_pipeline, pipeline_micro_step
from titan_train.run_folder import (
    RunLock,
    apply_resumed_changes,
    archive_outputs,
    plan_run_folder,
    write_config,
)
from titan_train.watchdog import StepWatchdog

__all__ = [
    "ConfigError",
    "NonFiniteError",
    "StepResult",
    "build_model",
    "build_optimizer",
    "train",
    "train_step",
]


def check_supported(cfg: JobConfig, dims: ParallelDims) -> None:
    """Reject combinations this trainer cannot run yet, before anything is built or written."""
    if dims.pp > 1 and cfg.compile.enabled:
        raise ValueError("compile.enabled with parallel.pp > 1 is not supported yet")
    chunked = any(n == "chunked_cross_entropy" for _, n in parse_overrides(cfg.model.overrides))
    if chunked and (dims.pp > 1 or dims.tp > 1):
        raise ValueError(
            "model.overrides output=chunked_cross_entropy needs parallel.pp=1 and parallel.tp=1 "
            "(the head must see whole rows of the vocabulary and the labels)"
        )
    if (dims.pp > 1 or dims.cp > 1) and cfg.data.source in _IMAGE_TEXT:
        raise ValueError(
            f"data.source={cfg.data.source!r} with parallel.pp > 1 or parallel.cp > 1 is not supported "
            "yet: pipeline stages and sequence shards take token ids only, not the images "
            "(use parallel.pp=1, parallel.cp=1)"
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
    apply_quantize(model, cfg)
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


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """What one step measured, on the device (read at log steps only)."""

    loss: torch.Tensor
    """Mean cross-entropy over every target token of the global batch."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping."""
    expert_counts: torch.Tensor | None
    """Tokens per expert of this rank's MoE layers, ``(layers, E)``; None without MoE."""
    skipped: bool = False
    """The gradient norm was not finite and the update was skipped (``skip_nonfinite`` only)."""


def train_step(
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: JobConfig,
    *,
    on_grads: Any = None,
    skip_nonfinite: bool = False,
) -> StepResult:
    """One optimizer step over ``grad_accum`` micro-batches of ``batch`` (on the training
    device); the loss is the mean over every target token of the global batch (see the module
    doc). Forces no host synchronisation. ``on_grads()`` runs once the gradients are
    complete, before clipping. ``skip_nonfinite``: read whether the gradient norm is finite
    (one host read) and skip the update when it is not."""
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
            total += pipeline_micro_step(pm, mb, scale, cfg, sync=last)
            continue
        with autocast(cfg, mb.input_ids.device):
            loss = loss_sum(pm.parts[0], mb) * scale
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
    skipped = skip_nonfinite and not bool(torch.isfinite(norm))  # the same on every rank
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    counts = expert_counts(pm)
    if not skipped:
        update_expert_biases(pm)
    if dims.dp_cp > 1:  # each rank's share (of dp x cp times the mean); tp ranks agree
        dist.all_reduce(total, group=pm.group("dp_cp"))
    if dims.pp > 1:  # only the last stage holds the loss
        dist.all_reduce(total, group=pm.group("pp"))
    return StepResult(total / dims.dp_cp, norm, counts, skipped)


_IMAGE_TEXT = ("shapes", "image_files")


def _image_text_loader(cfg: JobConfig, tokenizer: Tokenizer, source: Any) -> Any:
    """An ``ImageTextLoader`` over ``source`` for the job's model (its image processor and
    special tokens)."""
    _, config = model_config(cfg, tokenizer)
    d, t = cfg.data, cfg.training
    processor = ImageProcessor(
        config.vision, min_pixels=d.image_min_pixels, max_pixels=d.image_max_pixels
    )
    return ImageTextLoader(
        source,
        tokenizer,
        processor,
        seq_len=t.seq_len,
        batch_size=t.batch_size,
        image_token_id=config.image_token_id,
        vision_start_id=config.vision_start_token_id,
        vision_end_id=config.vision_end_token_id,
        skip_too_long=d.skip_too_long,
        skip_bad_images=d.skip_bad_images,
    )


def _image_text_sources(
    cfg: JobConfig, tokenizer: Tokenizer, dp_rank: int, dp_size: int
) -> tuple[Any, ShapesSource | ImageFilesSource]:
    _, config = model_config(cfg, tokenizer)
    vision = getattr(config, "vision", None)
    d = cfg.data
    if vision is None:
        raise ValueError(
            f"data.source={d.source!r} needs a vision-language model; {cfg.model.family} has no "
            "vision tower (e.g. --model.family qwen3_vl)"
        )
    common = dict(validation_fraction=d.validation_fraction, rank=dp_rank, world_size=dp_size)
    if d.source == "shapes":
        unit = vision.patch_size * vision.spatial_merge_size
        common |= dict(unit=unit, seed=cfg.training.seed)
        train, val = (ShapesSource(split=s, **common) for s in ("train", "validation"))
    else:
        common |= dict(
            paths=d.paths,
            image_field=d.image_field,
            question_field=d.question_field,
            answer_field=d.answer_field,
        )
        train, val = (ImageFilesSource(split=s, **common) for s in ("train", "validation"))
    return _image_text_loader(cfg, tokenizer, train), val


def _loaders(
    cfg: JobConfig, tokenizer: Tokenizer, *, dp_rank: int = 0, dp_size: int = 1
) -> tuple[Any, Any]:
    """This data-parallel rank's training stream (every ``dp_size``-th document) and its
    validation source."""
    d, t = cfg.data, cfg.training
    if d.source in _IMAGE_TEXT:
        return _image_text_sources(cfg, tokenizer, dp_rank, dp_size)
    if d.source == "chat":
        train_src, val_src = chat_sources(cfg, tokenizer, dp_rank=dp_rank, dp_size=dp_size)
        loader = PackedLoader(train_src, tokenizer, seq_len=t.seq_len, batch_size=t.batch_size)
        return loader, val_src
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
        max_len = getattr(config, "max_seq_len", None)
        if max_len is not None and cfg.training.seq_len > max_len:
            raise ValueError(
                f"training.seq_len={cfg.training.seq_len} exceeds the model's max_seq_len="
                f"{max_len} ({cfg.model.family} {cfg.model.flavor})"
            )
        with torch.device("meta"):  # overrides checked on a model that allocates nothing
            meta_model = model_cls(config)
            apply_overrides(meta_model, cfg.model.overrides)
            check_low_precision(meta_model, cfg, dims)
        _loaders(cfg, tokenizer)  # checks data files and fields
        if not fake:
            resolve_device(cfg.training.device)
            # resume / overwrite rules, config changes (torchrun's ranks: see train)
            plan_run_folder(cfg, check_lock="LOCAL_RANK" not in os.environ)
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
    A non-finite loss or gradient norm raises ``NonFiniteError`` naming the step (see
    ``training.skip_nonfinite``); no checkpoint is written after it.
    """
    dims, tokenizer, model_cls, config = prepare(cfg)
    if cfg.comm.fake_world_size:
        from titan_train.fake import run_fake

        return run_fake(cfg, dims, tokenizer, model_cls, config)
    rank = int(os.environ.get("RANK", "0"))
    run_lock = RunLock(Path(cfg.output_dir) / cfg.name) if rank == 0 else None
    try:
        return _train(cfg, dims, tokenizer, model_cls, config, stop_after)
    finally:
        if run_lock is not None:
            run_lock.release()


def _train(
    cfg: JobConfig,
    dims: ParallelDims,
    tokenizer: Tokenizer,
    model_cls: type,
    config: Any,
    stop_after: int | None,
) -> dict[str, Any]:
    plan = plan_run_folder(cfg, check_lock=False)  # on every rank, before any rank writes
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

    run_dir = plan.run_dir
    if plan.archive and rank == 0:
        archive_outputs(run_dir)
    if dims.world_size > 1:
        dist.barrier()
    stateful = checkpoint_state(pm, optimizer, scheduler, loader, state)
    ckpt = resume(cfg, plan, stateful)  # before anything else is written to the run folder
    apply_resumed_changes(plan, cfg, optimizer, scheduler)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_config(run_dir, cfg, plan)
    if dims.world_size > 1:
        dist.barrier()

    logger = MetricsLogger(
        run_dir,
        total_steps=cfg.training.steps,
        tensorboard=cfg.metrics.tensorboard,
        enabled=rank == 0,
        resumed_step=state.step,
    )
    bf16 = cfg.training.mixed_precision == "bf16"
    peak = cfg.metrics.peak_flops or measure_matmul_flops(
        device, dtype=torch.bfloat16 if bf16 and device.type != "cpu" else torch.float32
    )
    flops_per_token = titan_models.flops_per_token(config, cfg.training.seq_len)
    tokens_per_step = cfg.training.batch_size * cfg.training.seq_len * dims.dp
    guard = NonFiniteGuard(cfg.training.skip_nonfinite)
    losses: list[float] = []
    last_log = time.perf_counter()
    steps_since_log = 0
    end = cfg.training.steps if stop_after is None else min(stop_after, cfg.training.steps)
    watchdog = StepWatchdog(_watchdog_limit(cfg), rank=rank) if dims.world_size > 1 else None
    try:
        while state.step < end:
            batch = next(loader).to(device)
            result = train_step(pm, optimizer, batch, cfg, skip_nonfinite=guard.per_step)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            state.step += 1
            steps_since_log += 1
            guard.add(state.step, result)
            if state.step % cfg.metrics.log_every == 0 or state.step == end:
                losses += guard.read()  # the one host read per log interval
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
                        **moe_load(result.expert_counts),
                        **memory_bytes(device),
                    },
                )
                last_log, steps_since_log = time.perf_counter(), 0
            every = cfg.metrics.validate_every
            if every and (state.step % every == 0 or state.step == cfg.training.steps):
                val = _validate(pm, cfg, tokenizer, val_src, device)
                logger.log(state.step, val, prefix="validation")
            if ckpt is not None and state.step % cfg.checkpoint.interval == 0:
                losses += guard.read()  # never save weights a non-finite step touched
                ckpt.save(state.step, stateful)
            if watchdog is not None:
                watchdog.beat(state.step)
        if watchdog is not None:
            watchdog.pause()  # the last save and the export may take longer than a step
        if ckpt is not None:
            ckpt.wait()
    finally:
        if watchdog is not None:
            watchdog.close()
        if ckpt is not None:
            ckpt.close()
        logger.close()
    if cfg.checkpoint.export_hf and state.step == cfg.training.steps:
        export_hf(pm, config, run_dir / "hf")
    return {"losses": losses, "run_dir": run_dir, "model": pm.parts[0], "step": state.step}


def _watchdog_limit(cfg: JobConfig) -> float:
    """The step watchdog fires only after the process group's own timeout would have."""
    return cfg.comm.timeout_s + max(60.0, 0.25 * cfg.comm.timeout_s)


def _validate(
    pm: ParallelModel,
    cfg: JobConfig,
    tokenizer: Tokenizer,
    val_src: DocumentSource,
    device: torch.device,
) -> dict[str, float]:
    """Mean validation loss over every data-parallel rank's batches (under pipelining: the
    schedule's forward actions only), and the answer accuracy of image-text data."""
    t = cfg.training
    if isinstance(val_src, (ShapesSource, ImageFilesSource)):
        val_loader = _image_text_loader(cfg, tokenizer, val_src)
    else:
        val_loader = PackedLoader(val_src, tokenizer, seq_len=t.seq_len, batch_size=t.batch_size)
    right = answers = 0
    if pm.schedule is None:
        n = cfg.metrics.validation_batches
        total, tokens, right, answers = evaluate(pm.parts[0], val_loader, n, device, pm.shard_batch)
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
