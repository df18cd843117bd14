"""The training loop: build on meta, parallelize, materialise per shard, (resume), train with
accumulation and clipping, log, save, export.

This file composes the libraries; it implements none of their logic. One code path serves
one process and ``torchrun`` jobs on any device (the fake backend, ``titan_train.fake``, is the
other runner of the same steps): ``titan_train.build`` resolves the job once and builds this
rank's model parts, ``materialize`` gives them their weights, and the step runs them directly
(micro-batches) or through the pipeline schedule.

Loss scaling: every rank divides its summed cross-entropy by the step's *global* count of
target tokens (one all-reduce of a device scalar per step over the data- and
context-parallel ranks) and multiplies by their number, because flexshard averages gradients
over them. The result is the gradient of the mean loss over every target token of the
global batch, however it is split (a context-parallel rank holds a shard of every row). Nothing in a step reads a device value on the host: losses and norms stay on the
device and are read only when logged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import titan_models
from titan_train import flight_recorder, run_report
from titan_train.build import Job, build_loaders, build_optimizer, build_parallel, resolve
from titan_train.checkpointing import (
    TrainState,
    checkpoint_state,
    export_hf,
    resume,
)
from titan_train.config import JobConfig
from titan_train.data.packing import IGNORE_INDEX, Batch
from titan_train.device import (
    backend_for,
    device_type,
    free_memory_bytes,
    init_process_group,
    resolve_device,
)
from titan_train.errors import ConfigError, ExportError, NonFiniteError
from titan_train.evaluation import validate_run
from titan_train.fault_tolerance import FaultTolerance, data_shard
from titan_train.graph import build_graph_step
from titan_train.losses import autocast, loss_sum
from titan_train.lr_schedule import build_lr_scheduler
from titan_train.materialize import local_bytes, materialize
from titan_train.metrics import MetricsLogger, measure_matmul_flops, memory_bytes
from titan_train.moe_balance import expert_counts, moe_load, update_expert_biases
from titan_train.numerics import NonFiniteGuard
from titan_train.parallelize import ParallelModel, build_stages
from titan_train.pipelined import pipeline_micro_step
from titan_train.profiling import (
    ActivationMemory,
    StepPhases,
    Tracer,
    cuda_memory_history,
    parse_steps,
)
from titan_train.run_folder import (
    RunFolderPlan,
    RunLock,
    apply_resumed_changes,
    archive_outputs,
    plan_run_folder,
    write_config,
)
from titan_train.timeline import PhaseLog, draw_timeline
from titan_train.watchdog import StepWatchdog

__all__ = [
    "ConfigError",
    "ExportError",
    "NonFiniteError",
    "StepResult",
    "train",
    "train_step",
]


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
    phases: StepPhases | None = None,
    ft: FaultTolerance | None = None,
) -> StepResult:
    """One optimizer step over ``grad_accum`` micro-batches of ``batch`` (on the training
    device); the loss is the mean over every target token of the global batch (see the module
    doc). Forces no host synchronisation. ``on_grads()`` runs once the gradients are
    complete, before clipping. ``skip_nonfinite``: read whether the gradient norm is finite
    (one host read) and skip the update when it is not. ``phases``: time the step's phases.
    ``ft``: fault tolerance (tokens and gradients summed over the live replica groups, the
    update only if torchft commits)."""
    import flexshard

    phase = phases.phase if phases is not None else _untimed
    dims = pm.dims
    batch = pm.shard_batch(batch)
    num_tokens = (batch.labels != IGNORE_INDEX).sum().to(torch.float32)
    if dims.dp_cp > 1:
        with phase("collectives"):
            dist.all_reduce(num_tokens, group=pm.group("dp_cp"))
    live = ft.sync_tokens(num_tokens) if ft is not None else 1  # replica groups: HSDP's sums
    scale = dims.dp_cp * live / num_tokens.clamp(min=1)
    micro = batch.split(cfg.training.grad_accum)
    total = torch.zeros((), dtype=torch.float32, device=num_tokens.device)
    if pm.graph is not None:  # compile.mode='graph': every micro-batch in one captured graph
        with phase("forward_backward"):
            total, micro = pm.graph.run(scale, micro), []
    for i, mb in enumerate(micro):
        last = i == len(micro) - 1
        if pm.sharded:  # accumulate locally, reduce in the last micro-batch's backward
            for part in pm.flexshard_parts():
                part.set_requires_gradient_sync(last)
        if pm.schedule is not None:
            with phase("forward_backward"):
                total += pipeline_micro_step(pm, mb, scale, cfg, sync=last)
            continue
        with phase("forward"), autocast(cfg, mb.input_ids.device):
            loss = loss_sum(pm.parts[0], mb) * scale
        with phase("backward"):
            loss.backward()
        total += loss.detach()
    if ft is not None:
        ft.sync_grads(pm.parameters(), total)
    if on_grads is not None:
        on_grads()
    clip = dict(
        extra_groups=[pm.group("pp")] if dims.pp > 1 else [],
        disjoint={pm.group("ep"): pm.expert_params} if pm.experts else None,
    )
    params = pm.parameters()
    with phase("optimizer"):
        if cfg.training.max_grad_norm > 0:
            norm = flexshard.clip_grad_norm_(params, cfg.training.max_grad_norm, **clip)
        else:
            norm = flexshard.global_grad_norm(params, **clip)
        skipped = skip_nonfinite and not bool(torch.isfinite(norm))  # the same on every rank
        commit = ft is None or ft.should_commit()
        if not skipped and commit:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        counts = expert_counts(pm)
        if not skipped and commit:
            update_expert_biases(pm)
    with phase("collectives"):
        if dims.dp_cp > 1:  # each rank's share (of dp x cp times the mean); tp ranks agree
            dist.all_reduce(total, group=pm.group("dp_cp"))
        if dims.pp > 1:  # only the last stage holds the loss
            dist.all_reduce(total, group=pm.group("pp"))
    return StepResult(total / (dims.dp_cp * live), norm, counts, skipped)


def _untimed(name: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


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


def train(cfg: JobConfig | Job, *, stop_after: int | None = None) -> dict[str, Any]:
    """Run ``cfg`` to the end (or to step ``stop_after``, for resume tests); returns a summary.

    ``cfg``: a config (resolved here) or a ``Job`` already resolved. Outputs go to
    ``<output_dir>/<name>/``: ``config.json``, ``metrics.jsonl``, TensorBoard events,
    ``loss.png``, ``checkpoints/`` and, when asked, ``hf/`` (written by rank 0). A config with
    ``comm.fake_world_size`` is for the fake backend's runner, ``titan_train.fake.run_fake``.
    A non-finite loss or gradient norm raises ``NonFiniteError`` naming the step (see
    ``training.skip_nonfinite``); no checkpoint is written after it.
    """
    job = cfg if isinstance(cfg, Job) else resolve(cfg)
    if job.cfg.comm.fake_world_size:
        raise ConfigError(
            f"comm.fake_world_size={job.cfg.comm.fake_world_size}: the fake backend has its own "
            "runner, titan_train.fake.run_fake (titan-train picks it); train runs real ranks"
        )
    rank = int(os.environ.get("RANK", "0"))
    run_lock = RunLock(Path(job.cfg.output_dir) / job.cfg.name) if rank == 0 else None
    try:
        return _train(job, stop_after)
    except BaseException:
        if run_lock is not None:
            run_lock.release()
            run_lock.discard_failed_start()
        raise
    finally:
        if run_lock is not None:
            run_lock.release()


def _train(job: Job, stop_after: int | None) -> dict[str, Any]:
    cfg, dims, config = job.cfg, job.dims, job.model_config
    plan = plan_run_folder(cfg, check_lock=False)  # on every rank, before any rank writes
    rank = int(os.environ.get("RANK", "0"))
    if _finished(cfg, plan):  # a rerun of a complete run: nothing to do, nothing touched
        assert plan.resume_step is not None  # _finished: a checkpoint at the last step
        if rank == 0:
            print(run_report.finished(plan.run_dir, plan.resume_step), flush=True)
        return {"losses": [], "run_dir": plan.run_dir, "model": None, "step": plan.resume_step}
    device = resolve_device(cfg.training.device)
    if cfg.training.deterministic:
        if device.type == "cuda":  # cuBLAS needs a fixed workspace to be deterministic
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if dims.world_size > 1:
        flight_recorder.enable(cfg.profiling.flight_recorder)  # before the first group
    init_process_group(device, cfg.comm.timeout_s)
    pm = build_parallel(job, device_type(cfg.training.device))
    _check_memory(pm, cfg, device)
    materialize(pm, device, seed=cfg.training.seed, hf_path=cfg.checkpoint.init_from_hf)
    if dims.pp > 1:
        build_stages(pm, cfg)
    if cfg.compile.mode == "graph":
        pm.graph = build_graph_step(pm, cfg)
    rank = dist.get_rank() if dims.world_size > 1 else 0
    dp_rank, dp_size = data_shard(cfg, pm)  # fault tolerance: this group's shards
    torch.manual_seed(cfg.training.seed + dp_rank)
    random.seed(cfg.training.seed + dp_rank)
    loader, val_src = build_loaders(job, dp_rank=dp_rank, dp_size=dp_size)
    optimizer = build_optimizer(pm, cfg)
    scheduler = build_lr_scheduler(optimizer, cfg.training.steps, cfg.lr_schedule)
    state = TrainState(device)

    run_dir = plan.run_dir
    archived = archive_outputs(run_dir) if plan.archive and rank == 0 else None
    if dims.world_size > 1:
        dist.barrier()
    stateful = checkpoint_state(
        pm, optimizer, scheduler, loader, state, adapters_only=cfg.lora.rank > 0
    )
    ft = None
    if cfg.fault_tolerance.enable:
        ft = FaultTolerance(cfg, pm, optimizer, scheduler, loader, state, plan.run_dir)
        stateful.update(ft.checkpoint_items())
    ckpt = resume(cfg, plan, stateful)  # before anything else is written to the run folder
    apply_resumed_changes(plan, cfg, optimizer, scheduler)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_config(run_dir, cfg, plan)
        num_params = job.num_params()
        layout = {k: getattr(dims, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")}
        print(
            run_report.header(
                cfg,
                run_dir=run_dir,
                num_params=num_params,
                layout=layout,
                device=device.type,
                resume_step=plan.resume_step,
                archived=archived,
            ),
            flush=True,
        )
    if dims.world_size > 1:
        dist.barrier()

    m = cfg.metrics
    logger = MetricsLogger(
        run_dir,
        total_steps=cfg.training.steps,
        tensorboard=m.tensorboard,
        enabled=rank == 0,
        resumed_step=state.step,
        wandb=dict(project=m.wandb_project, name=cfg.name, config=dataclasses.asdict(cfg))
        if m.wandb
        else None,
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
    saved = plan.resume_step or 0
    end = cfg.training.steps if stop_after is None else min(stop_after, cfg.training.steps)
    p = cfg.profiling
    phases, profiling_dir = StepPhases(device), run_dir / "profiling"
    phase_log = PhaseLog(profiling_dir, rank, plan.resume_step)

    def record_flight(reason: str) -> None:
        flight_recorder.dump(profiling_dir, rank, backend_for(device), reason)

    watchdog = None
    if dims.world_size > 1:
        watchdog = StepWatchdog(
            _watchdog_limit(cfg), rank=rank, on_fire=lambda: record_flight("step watchdog")
        )
    stop = run_report.StopRequest()
    tracer = Tracer(parse_steps(p.trace_steps), profiling_dir, rank)
    saved_bytes = (
        ActivationMemory(pm.parts[0]) if p.memory_snapshot and device.type == "cpu" else None
    )
    failed = True  # until the loop ends well: a failed peer never completes its last save
    try:
        with stop, cuda_memory_history(p.memory_snapshot, profiling_dir, rank):
            try:
                while state.step < end and not stop.requested:
                    tracer.before_step(state.step + 1)
                    with phases.phase("data"):
                        batch = (ft.next_batch() if ft else next(loader)).to(device)
                    with saved_bytes.measure() if saved_bytes else contextlib.nullcontext():
                        result = train_step(
                            pm, optimizer, batch, cfg, skip_nonfinite=guard.per_step,
                            phases=phases, ft=ft,
                        )  # fmt: skip
                    if saved_bytes is not None:  # the first step's table
                        saved_bytes, _ = None, saved_bytes.write(profiling_dir, rank)
                    if ft is not None and not ft.committed:
                        continue  # discarded by torchft: the same batch with the next quorum
                    phases.steps += 1
                    lr = scheduler.get_last_lr()[0]
                    scheduler.step()
                    state.step += 1
                    steps_since_log += 1
                    guard.add(state.step, result)
                    if state.step % cfg.metrics.log_every == 0 or state.step == end:
                        losses += guard.read()  # the one host read per log interval
                        elapsed = time.perf_counter() - last_log
                        phase_times = phases.read()
                        phase_log.add(state.step, steps_since_log, phase_times)
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
                                **phase_times,
                                **(ft.metrics() if ft else {}),
                            },
                        )
                        last_log, steps_since_log = time.perf_counter(), 0
                    every = cfg.metrics.validate_every
                    if every and (state.step % every == 0 or state.step == cfg.training.steps):
                        with phases.phase("validation"):
                            val = validate_run(pm, job, val_src, device)
                        logger.log(state.step, val, prefix="validation")
                    last = state.step == cfg.training.steps
                    if ckpt is not None and (state.step % cfg.checkpoint.interval == 0 or last):
                        losses += guard.read()  # never save weights a non-finite step touched
                        with phases.phase("checkpoint"):
                            ckpt.save(state.step, stateful)
                        saved = state.step
                    tracer.after_step(state.step)
                    if watchdog is not None:
                        watchdog.beat(state.step)
            except Exception as e:
                if stop.requested and dims.world_size > 1:  # a peer stopped first
                    raise _interrupted(state.step, ckpt, cfg) from None
                if dims.world_size > 1:
                    record_flight(f"step {state.step + 1}: {type(e).__name__}: {e}")
                raise
            if stop.requested and state.step < end:
                if dims.world_size == 1 and ckpt is not None and saved < state.step:
                    losses += guard.read()
                    ckpt.save(state.step, stateful)  # ranks may have stopped at other steps
                raise _interrupted(state.step, ckpt, cfg)
        if watchdog is not None:
            watchdog.pause()  # the last save and the export may take longer than a step
        if ckpt is not None:
            ckpt.wait()
        if dims.world_size > 1:
            dist.barrier()  # every rank's phases are written
        if rank == 0:
            draw_timeline(profiling_dir)
        failed = False
    finally:
        tracer.close()
        if ft is not None:
            ft.close()
        if watchdog is not None:
            watchdog.close()
        if ckpt is not None:
            ckpt.close(abandon_retention=failed)
        logger.close()
    summary = {"losses": losses, "run_dir": run_dir, "model": pm.parts[0], "step": state.step}
    if cfg.checkpoint.export_hf and state.step == cfg.training.steps:
        _export(pm, config, cfg, stateful, saved)
    if rank == 0 and state.step == cfg.training.steps:
        val = logger.history("validation/loss")
        print(run_report.closing(summary, run_dir=run_dir, validation=val[-1][1] if val else None))
    return summary


def _finished(cfg: JobConfig, plan: RunFolderPlan) -> bool:
    """The run folder's latest checkpoint is the last step, and its export (if asked) exists."""
    if plan.resume_step is None or plan.resume_step < cfg.training.steps:
        return False
    return not cfg.checkpoint.export_hf or (plan.run_dir / "hf" / "config.json").exists()


def _interrupted(step: int, ckpt: Any, cfg: JobConfig) -> run_report.Interrupted:
    """The Ctrl-C outcome, naming the newest complete checkpoint once this rank's writes end."""
    latest = None
    if ckpt is not None:
        with contextlib.suppress(Exception):  # a peer gone mid-save: its checkpoint is not listed
            ckpt.wait()
        latest = ckpt.latest_step()
    return run_report.Interrupted(step, latest, cfg.checkpoint.interval > 0)


def _export(
    pm: ParallelModel,
    config: titan_models.TransformerConfig,
    cfg: JobConfig,
    stateful: Any,
    saved: int,
) -> None:
    """The HF export, after the last checkpoint is complete. If it fails the error names that
    checkpoint (with checkpoints off, one is written now): nothing trained is lost."""
    run_dir = Path(cfg.output_dir) / cfg.name
    try:
        export_hf(pm, config, run_dir / "hf", cfg)
    except Exception as e:
        step, root = cfg.training.steps, run_dir / "checkpoints"
        rerun = "rerun the same command"
        if saved != step:  # checkpoint.interval=0
            from torch_checkpointing import CheckpointManager

            with CheckpointManager(root, async_mode="off") as ckpt:
                ckpt.save(step, stateful)
            rerun += f" with --checkpoint.interval {step} --allow-config-change"
        raise ExportError(
            f"HF export to {run_dir / 'hf'} failed ({type(e).__name__}: {e}); the trained weights "
            f"are safe in the step-{step} checkpoint in {root}: fix the cause and {rerun} to "
            "export them"
        ) from e


def _watchdog_limit(cfg: JobConfig) -> float:
    """The step watchdog fires only after the process group's own timeout would have."""
    return cfg.comm.timeout_s + max(60.0, 0.25 * cfg.comm.timeout_s)
