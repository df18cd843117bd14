"""The training loop: build, parallelize, (resume), train with accumulation and clipping, log,
save, export.

This file composes the libraries; it implements none of their logic. One code path serves
one process and ``torchrun`` jobs: ``parallelize`` returns this rank's model parts, and the
step either runs them directly (micro-batches) or through the pipeline schedule.

Loss scaling: every rank divides its summed cross-entropy by the step's *global* count of
target tokens (one all-reduce of an int per step) and multiplies by the data-parallel size,
because gradient reduction averages over data-parallel ranks. The result is the gradient of
the mean loss over every target token of the global batch, however it is split.
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
from titan_train.components import apply_overrides, loss_head, parse_overrides
from titan_train.config import JobConfig, validate
from titan_train.data.packing import IGNORE_INDEX, Batch, PackedLoader
from titan_train.data.sources import DocumentSource
from titan_train.data.tokenizers import Tokenizer, build_tokenizer
from titan_train.lr_schedule import build_lr_scheduler
from titan_train.metrics import MetricsLogger, measure_matmul_flops, memory_bytes
from titan_train.parallelize import ParallelDims, ParallelModel, check_plan, parallelize


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


def check_supported(cfg: JobConfig, dims: ParallelDims) -> None:
    """Reject combinations this trainer cannot run yet, before anything is built or written."""
    if dims.pp > 1 and cfg.checkpoint.export_hf:
        raise ValueError("checkpoint.export_hf with parallel.pp > 1 is not supported yet")
    if dims.pp > 1 and cfg.compile.enabled:
        raise ValueError("compile.enabled with parallel.pp > 1 is not supported yet")
    chunked = any(n == "chunked_cross_entropy" for _, n in parse_overrides(cfg.model.overrides))
    if chunked and (dims.pp > 1 or dims.tp > 1):
        raise ValueError(
            "model.overrides output=chunked_cross_entropy needs parallel.pp=1 and parallel.tp=1 "
            "(the head must see whole rows of the vocabulary and the labels)"
        )


def build_model(cfg: JobConfig, tokenizer: Tokenizer, device: torch.device) -> nn.Module:
    """The recipe's model: from an HF folder, or built on meta and initialised on ``device``."""
    if cfg.checkpoint.init_from_hf:
        model = titan_models.from_hf(cfg.checkpoint.init_from_hf, device=str(device))
        backend = cfg.model.attention_backend
        model.config = dataclasses.replace(model.config, attention_backend=backend)
        vocab = model.config.vocab_size
        if vocab < tokenizer.vocab_size:
            raise ValueError(
                f"checkpoint.init_from_hf model has vocab_size={vocab}, smaller than the "
                f"tokenizer's {tokenizer.vocab_size} (data.tokenizer={cfg.data.tokenizer!r})"
            )
    else:
        model_cls, model_cfg = _model_config(cfg, tokenizer)
        with torch.device("meta"):
            model = model_cls(model_cfg)
        model.init_weights(device=device, seed=cfg.training.seed)
    apply_overrides(model, cfg.model.overrides)
    return model


def _model_config(cfg: JobConfig, tokenizer: Tokenizer) -> tuple[type, Any]:
    overrides = {
        "vocab_size": cfg.model.vocab_size or tokenizer.vocab_size,
        "attention_backend": cfg.model.attention_backend,
    }
    return titan_models.get_model(cfg.model.family, cfg.model.flavor, **overrides)


def _global_ndim(p: torch.Tensor) -> int:
    import flexshard

    info = flexshard.param_info(p)
    return len(info.shape) if info is not None else p.ndim


def build_optimizer(pm: ParallelModel, cfg: JobConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only; or Muon on the blocks' matrices (flexshard's
    distributed Muon: Owned matrices are orthogonalised on their owner) with AdamW for the
    rest (embeddings, head, norms)."""
    named = [(n, p) for n, p in pm.named_parameters() if p.requires_grad]
    o = cfg.optimizer
    if o.name == "muon":
        import flexshard

        muon = [p for n, p in named if n.startswith("layers.") and _global_ndim(p) == 2]
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
        params = [p for _, p in named if (_global_ndim(p) >= 2) == decays]
        # Fused (foreach) updates need one tensor type per group: TP's DTensors apart from
        # the plain tensors of unsharded modules (norms, MoE experts under TP).
        for is_dtensor in (True, False):
            same = [p for p in params if isinstance(p, DTensor) == is_dtensor]
            if same:
                groups.append({"params": same, "weight_decay": o.weight_decay if decays else 0.0})
    return torch.optim.AdamW(
        groups,
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
        foreach=True,
    )


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
        return _cross_entropy_sum(logits, batch.labels) + mtp * batch.num_target_tokens
    logits = model(batch.input_ids, **inputs)
    return _cross_entropy_sum(logits, batch.labels)


def _cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def train_step(
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: JobConfig,
) -> tuple[float, float, dict[str, float]]:
    """One optimizer step over ``grad_accum`` micro-batches; returns (loss, grad norm, extra
    metrics), the loss being the mean over every target token of the global batch (see the
    module doc)."""
    dims = pm.dims
    num_tokens = torch.tensor(batch.num_target_tokens, dtype=torch.int64)
    if dims.dp > 1:
        dist.all_reduce(num_tokens, group=pm.dp_group())
    scale = dims.dp / max(1, int(num_tokens))
    micro = batch.split(cfg.training.grad_accum)
    total = torch.zeros((), dtype=torch.float64)
    for i, mb in enumerate(micro):
        _set_gradient_sync(pm, i == len(micro) - 1)
        if pm.schedule is not None:
            total += _pipeline_micro_step(pm, mb, scale, cfg, sync=i == len(micro) - 1)
            continue
        with _autocast(cfg):
            loss = _loss_sum(pm.parts[0], mb) * scale
        loss.backward()
        total += loss.detach()
    for p in pm.tp_summed:  # replicated weights applied to local heads: sum their gradients
        if p.grad is not None:
            dist.all_reduce(p.grad, group=pm.group("tp"))
    for p in pm.expert_params:  # all shards' tokens, each scaled by dp: average like DP does
        if p.grad is not None:
            p.grad.div_(dims.dp_shard)
    if dims.dp_replicate > 1:  # HSDP: the replicas hold the same shards; average their grads
        group = pm.group("dp_replicate")
        for p in pm.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(dims.dp_replicate)
    norm = _clip_grad_norm(pm, cfg.training.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    extra = _moe_load(pm)  # read before the bias update resets the counts
    _update_expert_biases(pm)
    if dims.world_size > 1:  # each data-parallel rank's share; tp ranks hold copies of it
        dist.all_reduce(total)
        total /= dims.tp * dims.dp
    return float(total), float(norm), extra


def _moe_load(pm: ParallelModel) -> dict[str, float]:
    """This rank's routing balance this step: max and mean over MoE layers of max/mean load."""
    import dist_moe

    ratios = [
        m.load().max_over_mean
        for part in pm.parts
        for m in part.modules()
        if isinstance(m, dist_moe.MoE)
    ]
    ratios = [r for r in ratios if r == r]  # nan: a layer that saw no token
    if not ratios:
        return {}
    return {"moe_load_max": max(ratios), "moe_load_mean": sum(ratios) / len(ratios)}


def _sync_on_last(pm: ParallelModel, m: int) -> Any:
    """Reduce each stage's gradients (flexshard) in its last microbatch's backward only."""

    def hook(stage: Any, microbatch: int) -> None:
        stage.module.set_requires_gradient_sync(microbatch == m - 1)

    return hook if pm.sharded else None


def _pipeline_micro_step(
    pm: ParallelModel, mb: Batch, scale: float, cfg: JobConfig, *, sync: bool
) -> float:

    m = cfg.parallel.pp_microbatches

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _cross_entropy_sum(logits, labels) * scale

    with _autocast(cfg):
        return _run_pipeline(
            pm,
            mb,
            m,
            loss_fn,
            loss_scale=1.0,
            before_backward=_sync_on_last(pm, m) if sync else None,
        )


def _run_pipeline(pm: ParallelModel, batch: Batch, m: int, loss_fn: Any, **options: Any) -> float:
    """One titan_pipeline step over ``batch`` in ``m`` microbatches; the summed losses (zero on
    ranks without the last stage)."""
    import titan_pipeline

    losses = titan_pipeline.run(
        pm.schedule,
        pm.stages,
        titan_pipeline.split_microbatches(batch.input_ids, m),
        titan_pipeline.split_microbatches(batch.labels, m),
        loss_fn,
        stage_kwargs=_side_inputs(batch, m),
        **options,
    )
    return float(sum(float(x) for x in losses))


def _update_expert_biases(pm: ParallelModel) -> None:
    """Aux-loss-free balancing: one bias update per step from the loads of every DP rank."""
    import dist_moe

    group = pm.dp_group() if pm.mesh is not None else None  # same calls on each rank
    for part in pm.parts:
        dist_moe.update_expert_biases(part, group)


def _side_inputs(batch: Batch, m: int) -> list[dict[str, torch.Tensor]]:
    """What every pipeline stage needs besides its input, per microbatch."""
    return [
        {"positions": pos, "document_ids": doc}
        for pos, doc in zip(batch.positions.chunk(m), batch.document_ids.chunk(m), strict=True)
    ]


def _set_gradient_sync(pm: ParallelModel, sync: bool) -> None:
    """Accumulate locally on all but the last micro-batch (flexshard ``no_sync``)."""
    if pm.sharded:
        for part in pm.parts:
            part.set_requires_gradient_sync(sync)


def _clip_grad_norm(pm: ParallelModel, max_norm: float) -> torch.Tensor:
    """Global gradient norm over every shard, tensor-parallel piece and pipeline stage;
    gradients scaled down to ``max_norm`` when it is > 0."""
    params = [p for p in pm.parameters() if p.grad is not None]
    if pm.dims.world_size == 1:
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return torch.nn.utils.get_total_norm([p.grad for p in params])
    import flexshard

    experts = {id(p) for p in pm.expert_params}
    norm = flexshard.global_grad_norm([p for p in params if id(p) not in experts])
    if experts:  # each rank holds other experts: add their squares over the ep ranks
        sq = sum((p.grad.double().square().sum() for p in pm.expert_params), torch.zeros(()))
        dist.all_reduce(sq, group=pm.group("dp_shard"))
        norm = (norm.double().square() + sq).sqrt().to(norm.dtype)
    if pm.dims.pp > 1:  # each stage's norm covers its parameters: add the squares over stages
        sq = norm.double() ** 2
        dist.all_reduce(sq, group=pm.group("pp"))
        norm = sq.sqrt().to(norm.dtype)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef.to(p.grad.dtype))
    return norm


def _autocast(cfg: JobConfig) -> Any:
    if cfg.training.mixed_precision == "bf16":
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    return torch.autocast(device_type="cpu", enabled=False)


@torch.no_grad()
def evaluate(model: nn.Module, loader: PackedLoader, num_batches: int) -> tuple[float, int]:
    """Summed cross-entropy and target-token count over ``num_batches`` batches of ``loader``."""
    model.eval()
    total, tokens = 0.0, 0
    for _ in range(num_batches):
        batch = next(loader)
        total += float(_loss_sum(model, batch))
        tokens += batch.num_target_tokens
    model.train()
    return total, tokens


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


def _init_distributed() -> int:
    """World size; joins the process group torchrun describes (gloo on CPU, NCCL on GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return world


class _ModelState:
    """The model's checkpoint item: sharded pieces (flexshard's protocol objects, DTensors)
    of every local part under the unsplit model's FQNs."""

    def __init__(self, pm: ParallelModel) -> None:
        self.pm = pm

    def state_dict(self) -> dict[str, Any]:
        import flexshard

        out: dict[str, Any] = {}
        for part in self.pm.parts:
            out.update(flexshard.sharded_state_dict(part) if self.pm.sharded else part.state_dict())
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # torch_checkpointing fills sharded pieces and tensors in place.
        pass


class _OptimizerState:
    """The optimizer's checkpoint item under flexshard: state keyed by parameter FQN, moments
    as sharded pieces with their parameter's layout (filled in place on load)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict[str, Any]:
        import flexshard

        flexshard.init_optim_state(self.optimizer)  # a fresh optimizer: targets to load into
        return flexshard.sharded_optim_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import flexshard

        flexshard.load_sharded_optim_state_dict(self.module, self.optimizer, state)


def train(cfg: JobConfig, *, stop_after: int | None = None) -> dict[str, Any]:
    """Run ``cfg`` to the end (or to step ``stop_after``, for resume tests); returns a summary.

    Outputs go to ``<output_dir>/<name>/``: ``config.json``, ``metrics.jsonl``, TensorBoard
    events, ``loss.png``, ``checkpoints/`` and, when asked, ``hf/`` (written by rank 0).
    """
    try:  # everything that can reject the config runs before anything is written
        validate(cfg)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        dims = ParallelDims.resolve(cfg, world)
        check_supported(cfg, dims)
        tokenizer = build_tokenizer(cfg.data.tokenizer)
        if not cfg.checkpoint.init_from_hf:
            check_plan(cfg, dims, _model_config(cfg, tokenizer)[1])
        _loaders(cfg, tokenizer)  # checks data files and fields
        if cfg.training.deterministic:
            torch.use_deterministic_algorithms(True)
        device = torch.device("cpu")
        model = build_model(cfg, tokenizer, device)
        if cfg.checkpoint.init_from_hf:
            check_plan(cfg, dims, model.config)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    _init_distributed()
    pm = parallelize(model, cfg, dims)
    del model
    rank = dist.get_rank() if dims.world_size > 1 else 0
    torch.manual_seed(cfg.training.seed + pm.dp_rank)
    random.seed(cfg.training.seed + pm.dp_rank)
    loader, val_src = _loaders(cfg, tokenizer, dp_rank=pm.dp_rank, dp_size=dims.dp)
    optimizer = build_optimizer(pm, cfg)
    scheduler = build_lr_scheduler(optimizer, cfg.training.steps, cfg.lr_schedule)
    state = TrainState()

    run_dir = Path(cfg.output_dir) / cfg.name
    stateful = _checkpoint_state(pm, optimizer, scheduler, loader, state)
    ckpt = _resume(cfg, run_dir, stateful)  # before anything is written to the run folder
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
    peak = cfg.metrics.peak_flops or measure_matmul_flops()
    model_config = pm.parts[0].config
    flops_per_token = titan_models.flops_per_token(model_config, cfg.training.seq_len)
    tokens_per_step = cfg.training.batch_size * cfg.training.seq_len * dims.dp
    losses: list[float] = []
    last_log = time.perf_counter()
    steps_since_log = 0
    end = cfg.training.steps if stop_after is None else min(stop_after, cfg.training.steps)
    while state.step < end:
        batch = next(loader)
        loss, grad_norm, extra = train_step(pm, optimizer, batch, cfg)
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
                    "mfu": tps * flops_per_token / (peak * dims.world_size),
                    **extra,
                    **memory_bytes(),
                },
            )
            last_log, steps_since_log = time.perf_counter(), 0
        every = cfg.metrics.validate_every
        if every and (state.step % every == 0 or state.step == cfg.training.steps):
            val = _validate(pm, cfg, tokenizer, val_src)
            if val is not None:
                logger.log(state.step, {"loss": val}, prefix="validation")
        if ckpt is not None and state.step % cfg.checkpoint.interval == 0:
            ckpt.save(state.step, stateful)
    if ckpt is not None:
        ckpt.wait()
        ckpt.close()
    logger.close()
    if cfg.checkpoint.export_hf and state.step == cfg.training.steps:
        _export_hf(pm, cfg, tokenizer, run_dir / "hf", rank)
    return {"losses": losses, "run_dir": run_dir, "model": pm.parts[0], "step": state.step}


def _checkpoint_state(
    pm: ParallelModel, optimizer: Any, scheduler: Any, loader: PackedLoader, state: TrainState
) -> dict[str, Any]:
    """What a checkpoint holds. On several ranks, what differs per rank (data position, RNG,
    optimizer state of local shards, pipeline stages' weights) is saved per rank."""
    if pm.dims.world_size == 1:
        return {
            "model": pm.parts[0],
            "optim": optimizer,
            "lr": scheduler,
            "data": loader,
            "train": state,
        }
    from torch_checkpointing import PerRank

    # Stages and experts differ per rank; HSDP replicas hold duplicate shards.
    per_rank = pm.dims.pp > 1 or pm.expert_params or pm.dims.dp_replicate > 1
    model = PerRank(_ModelState(pm)) if per_rank else _ModelState(pm)
    if pm.sharded and not per_rank:  # reshardable, like the parameters
        optim = _OptimizerState(pm.parts[0], optimizer)
    else:
        optim = PerRank(optimizer)
    return {
        "model": model,
        "optim": optim,
        "lr": scheduler,
        "data": PerRank(loader),
        "train": PerRank(state),
    }


def _validate(
    pm: ParallelModel, cfg: JobConfig, tokenizer: Tokenizer, val_src: DocumentSource
) -> float | None:
    """Mean validation loss over every data-parallel rank's batches (under pipelining: the
    schedule's forward actions only)."""
    t = cfg.training
    val_loader = PackedLoader(val_src, tokenizer, seq_len=t.seq_len, batch_size=t.batch_size)
    if pm.schedule is None:
        total, tokens = evaluate(pm.parts[0], val_loader, cfg.metrics.validation_batches)
    else:
        total, tokens = _evaluate_pipeline(pm, val_loader, cfg)
    if pm.dims.world_size > 1:
        both = torch.tensor([total, float(tokens)], dtype=torch.float64)
        dist.all_reduce(both, group=pm.dp_group())
        total, tokens = float(both[0]), int(both[1])
    return total / max(1, tokens)


@torch.no_grad()
def _evaluate_pipeline(
    pm: ParallelModel, loader: PackedLoader, cfg: JobConfig
) -> tuple[float, int]:

    for part in pm.parts:
        part.eval()
    total, tokens = 0.0, 0
    m = cfg.parallel.pp_microbatches
    for _ in range(cfg.metrics.validation_batches):
        batch = next(loader)
        total += _run_pipeline(pm, batch, m, _cross_entropy_sum, forward_only=True)
        tokens += batch.num_target_tokens
    for part in pm.parts:
        part.train()
    if not pm.has_head:
        total = 0.0
    summed = torch.tensor([total], dtype=torch.float64)
    dist.all_reduce(summed, group=pm.group("pp"))  # the last stage's sum to every stage
    return float(summed[0]), tokens


def _export_hf(
    pm: ParallelModel, cfg: JobConfig, tokenizer: Tokenizer, path: Path, rank: int
) -> None:
    """HF safetensors of the final weights: full tensors gathered to rank 0, written there."""
    model = pm.parts[0]
    if pm.dims.world_size > 1:
        from torch.distributed.tensor import DTensor

        import flexshard

        if pm.sharded:
            full = flexshard.full_state_dict(model, rank0_only=False)
        else:
            full = model.state_dict()
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in full.items()}
        if rank == 0:
            model_cls, model_cfg = _model_config(cfg, tokenizer)
            with torch.device("meta"):
                model = model_cls(model_cfg)
            model.to_empty(device="cpu")
            model.load_state_dict(full)
        dist.barrier()
    if rank == 0:
        titan_models.to_hf(model, path)
    if pm.dims.world_size > 1:
        dist.barrier()


def _resume(cfg: JobConfig, run_dir: Path, stateful: dict[str, Any]) -> Any:
    """The checkpoint manager (None without checkpoints), after loading the latest complete
    checkpoint of the run folder when resuming. A checkpoint that does not fit this job (another
    model, another layout) is a ``ConfigError`` and nothing is written."""
    if cfg.checkpoint.interval == 0:
        return None
    from torch_checkpointing import CheckpointManager, StateMismatchError

    ckpt = CheckpointManager(
        run_dir / "checkpoints",
        async_mode=cfg.checkpoint.async_mode,
        keep_last=cfg.checkpoint.keep_last,
    )
    step = ckpt.latest_step() if cfg.checkpoint.resume else None
    if step is None:
        return ckpt
    try:
        ckpt.load(stateful, step)
    except StateMismatchError as e:
        ckpt.close()
        diff = [*e.missing[:2], *e.unexpected[:2]]
        diff += [f"{name} ({ours} here, {theirs} saved)" for name, ours, theirs in e.mismatched[:2]]
        raise ConfigError(
            f"checkpoint step {step} in {run_dir / 'checkpoints'} does not fit this job "
            f"({cfg.model.family} {cfg.model.flavor}): {len(e.missing)} missing, "
            f"{len(e.unexpected)} unexpected, {len(e.mismatched)} mismatched entries, e.g. "
            f"{', '.join(diff)}; use another --name or --checkpoint.no-resume"
        ) from None
    return ckpt
