"""Resolve a job once, then build its pieces from what was resolved.

``resolve(cfg)`` runs every check that can reject a config — before any process group,
allocation or file — and returns a ``Job``: the config, the parallel degrees, the tokenizer,
the model class, the model config and the model's parallelism plan, each made exactly once.
Everything after takes the ``Job`` (or the objects built from it):

    job = resolve(cfg)                                 # checks; model config and plan, once
    model = build_model(job, device)                   # the one-device reference model
    pm = build_parallel(job, mesh_type)                # this rank's parts, on meta
    loader, validation = build_loaders(job, dp_rank=pm.dp_rank)
    optimizer = build_optimizer(pm, job.cfg)

The runners — ``titan_train.trainer.train`` (real ranks) and ``titan_train.fake.run_fake``
(the fake backend) — are these calls in order; ``titan-train`` picks one of them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import titan_models
from titan_train.components import apply_overrides, parse_overrides
from titan_train.config import JobConfig, check_paths, validate
from titan_train.config_file import model_config_changes
from titan_train.data.tokenizers import Tokenizer, build_tokenizer
from titan_train.device import resolve_device
from titan_train.errors import ConfigError
from titan_train.fault_tolerance import replica_config
from titan_train.graph import check_graph, static_moe_shapes
from titan_train.layout import ParallelDims, build_mesh, check_plan
from titan_train.loaders import IMAGE_TEXT, check_data, loaders
from titan_train.lora import apply_lora_config, check_lora
from titan_train.low_precision import apply_quantize, check_low_precision
from titan_train.model_config import ModelClass, model_config
from titan_train.parallelize import ParallelModel, parallelize
from titan_train.run_folder import plan_run_folder

__all__ = [
    "Job",
    "build_loaders",
    "build_model",
    "build_optimizer",
    "build_parallel",
    "resolve",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """A job's config and everything resolved from it once (see the module doc)."""

    cfg: JobConfig
    dims: ParallelDims
    """Parallel degrees (``dp_shard=-1`` filled in from the world size)."""
    tokenizer: Tokenizer
    model_cls: ModelClass
    """The family's model class, built as ``model_cls(model_config)``."""
    model_config: titan_models.TransformerConfig
    """The family's config dataclass (flavour or HF folder, ``model.*`` fields applied)."""
    plan: titan_models.ModelPlan
    """The model's parallelism plan and what it supports."""

    def num_params(self) -> int:
        """Parameters of the whole model (counted on the meta device)."""
        with torch.device("meta"):
            return sum(p.numel() for p in self.model_cls(self.model_config).parameters())


def resolve(cfg: JobConfig, *, world_size: int | None = None) -> Job:
    """Every check that can reject ``cfg``, before any process group, allocation or file:
    ``ConfigError`` naming the field. ``world_size``: that of a job about to be launched
    (default: the fake world size, or torchrun's ``WORLD_SIZE``). With fault tolerance on, the
    job is this replica group's (its own run folder, ``fault_tolerance.replica_config``)."""
    cfg = replica_config(cfg)
    try:
        validate(cfg)
        check_paths(cfg)
        if cfg.metrics.wandb:
            try:
                import wandb  # noqa: F401
            except ImportError:
                raise ValueError(
                    "metrics.wandb needs the wandb package: pip install wandb (or drop "
                    "--metrics.wandb)"
                ) from None
        fake = cfg.comm.fake_world_size
        world = world_size or fake or int(os.environ.get("WORLD_SIZE", "1"))
        dims = ParallelDims.resolve(cfg, world)
        _check_supported(cfg, dims)
        tokenizer = build_tokenizer(cfg.data.tokenizer)
        model_cls, config = model_config(cfg, tokenizer)
        plan = titan_models.get_plan(config)
        check_plan(cfg, dims, plan)
        max_len = getattr(config, "max_seq_len", None)
        if max_len is not None and cfg.training.seq_len > max_len:
            raise ValueError(
                f"training.seq_len={cfg.training.seq_len} exceeds the model's max_seq_len="
                f"{max_len} ({cfg.model.family} {cfg.model.flavor}; raise it with "
                f"--model.config max_seq_len={cfg.training.seq_len})"
            )
        with torch.device("meta"):  # overrides checked on a model that allocates nothing
            meta_model = model_cls(config)
            apply_overrides(meta_model, cfg.model.overrides)
            check_lora(cfg, dims)
            check_low_precision(meta_model, cfg, dims)
            apply_lora_config(meta_model, cfg)
        check_data(cfg, tokenizer, config, dp_size=dims.dp)  # files, fields, a training split
        if not fake:
            resolve_device(cfg.training.device)
            # resume / overwrite rules, config changes (torchrun's ranks: see train)
            plan_run_folder(cfg, check_lock="LOCAL_RANK" not in os.environ)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return Job(cfg, dims, tokenizer, model_cls, config, plan)


def _check_supported(cfg: JobConfig, dims: ParallelDims) -> None:
    """Combinations the app cannot run yet, whatever the model."""
    if dims.pp > 1 and (cfg.compile.enabled or cfg.compile.mode == "local"):
        raise ValueError("compile.mode='local' with parallel.pp > 1 is not supported yet")
    check_graph(cfg, dims)
    chunked = any(n == "chunked_cross_entropy" for _, n in parse_overrides(cfg.model.overrides))
    if chunked and (dims.pp > 1 or dims.tp > 1):
        raise ValueError(
            "model.overrides output=chunked_cross_entropy needs parallel.pp=1 and parallel.tp=1 "
            "(the head must see whole rows of the vocabulary and the labels)"
        )
    if (dims.pp > 1 or dims.cp > 1) and cfg.data.source in IMAGE_TEXT:
        raise ValueError(
            f"data.source={cfg.data.source!r} with parallel.pp > 1 or parallel.cp > 1 is not supported "
            "yet: pipeline stages and sequence shards take token ids only, not the images "
            "(use parallel.pp=1, parallel.cp=1)"
        )
    if cfg.moe.grouped_gemm == "triton":
        check_triton_gemm(cfg)
    if cfg.moe.grouped_gemm == "cute":
        check_cute_gemm(cfg)
    if cfg.moe.dispatch == "symm_mem" and dims.ep == 1:
        raise ValueError(
            "moe.dispatch='symm_mem' exchanges tokens between expert-parallel ranks: it needs "
            f"parallel.ep > 1, got parallel.ep={dims.ep}"
        )
    if cfg.comm.fake_world_size and "LOCAL_RANK" in os.environ:
        raise ValueError(
            "comm.fake_world_size runs one process standing for a whole job: do not combine it "
            "with --nproc or torchrun"
        )


def check_triton_gemm(cfg: JobConfig) -> None:
    """``moe.grouped_gemm='triton'`` before any work: dist_moe's Triton grouped GEMM runs on
    CUDA devices (CPU tensors only under Triton's interpreter, ``TRITON_INTERPRET=1``)."""
    from dist_moe.kernels import resolve_backend

    if cfg.comm.fake_world_size:
        return  # fake mode: shapes only, on meta
    device = resolve_device(cfg.training.device)
    try:
        resolve_backend("triton", device, what="moe.grouped_gemm")
    except RuntimeError as e:
        raise ValueError(
            f"moe.grouped_gemm='triton' needs a CUDA device; training.device="
            f"{cfg.training.device!r} is {device.type} here (use moe.grouped_gemm='torch'): {e}"
        ) from None


def check_cute_gemm(cfg: JobConfig) -> None:
    """``moe.grouped_gemm='cute'`` before any work: dist_moe's CuTe kernel runs on SM90 / SM100
    GPUs in bf16, over equal per-expert groups (a capacity layout)."""
    need = "moe.grouped_gemm='cute' needs an SM90 (Hopper) or SM100 (Blackwell) CUDA GPU"
    if cfg.comm.fake_world_size:
        return  # fake mode: nothing runs a kernel
    if not torch.cuda.is_available():
        raise ValueError(f"{need}; this machine has no CUDA device (use moe.grouped_gemm='torch')")
    major, minor = torch.cuda.get_device_capability()
    if major not in (9, 10):
        raise ValueError(f"{need}; this one is sm_{major}{minor} (use moe.grouped_gemm='torch')")
    if cfg.training.mixed_precision != "bf16":
        raise ValueError(
            f"{need} and bf16 weights: set training.mixed_precision='bf16' (got "
            f"{cfg.training.mixed_precision!r})"
        )
    raise ValueError(
        "moe.grouped_gemm='cute' runs equal per-expert groups (dist_moe's capacity layout); "
        "the app's MoE layers are dropless, which the CuTe path does not take yet: use 'torch'"
    )


def grouped_gemm(model: nn.Module, gemm: str) -> None:
    """The grouped GEMM kernel of every MoE layer's routed experts (``moe.grouped_gemm``)."""
    import dist_moe

    if gemm not in ("torch", "triton", "cute"):  # validate() refused the rest
        raise ValueError(f"moe.grouped_gemm={gemm!r}: the MoE layers take torch, triton or cute")
    for m in model.modules():
        if isinstance(m, dist_moe.MoE):
            m.config = dataclasses.replace(m.config, grouped_gemm=gemm)
            m.experts.gemm = gemm


def build_model(job: Job, device: torch.device) -> nn.Module:
    """The whole model on one device, as one process would train it (the reference the
    parallel layouts are compared with: they hold pieces of exactly these weights)."""
    cfg = job.cfg
    if cfg.checkpoint.init_from_hf:
        changes = model_config_changes(job.model_config, cfg.model.config)
        model = titan_models.from_hf(
            cfg.checkpoint.init_from_hf, device=device, config_changes=changes
        )
        backend = cfg.model.attention_backend
        model.config = dataclasses.replace(model.config, attention_backend=backend)
    else:
        with torch.device("meta"):
            model = job.model_cls(job.model_config)
        model.init_weights(device=device, seed=cfg.training.seed)
    apply_overrides(model, cfg.model.overrides)
    if cfg.moe.static_shapes:
        static_moe_shapes(model)
    grouped_gemm(model, cfg.moe.grouped_gemm)
    apply_quantize(model, cfg)
    apply_lora_config(model, cfg)  # adapters start from training.seed, the base is frozen
    return model


def build_parallel(
    job: Job, mesh_type: str, *, edit: Callable[[nn.Module], None] | None = None
) -> ParallelModel:
    """This rank's model parts on the meta device (nothing allocated), parallelised over a
    mesh of ``mesh_type`` devices; the process group is the runner's, already made.
    ``edit(model)`` runs on the whole model before it is split (the fake backend's
    static-capacity MoE)."""
    mesh = build_mesh(job.dims, mesh_type)
    with torch.device("meta"):
        model = job.model_cls(job.model_config)
    apply_overrides(model, job.cfg.model.overrides)
    if job.cfg.moe.static_shapes:
        static_moe_shapes(model)
    grouped_gemm(model, job.cfg.moe.grouped_gemm)
    if edit is not None:
        edit(model)
    try:
        return parallelize(model, job.cfg, job.dims, mesh, job.plan)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def build_loaders(job: Job, *, dp_rank: int = 0, dp_size: int | None = None) -> tuple[Any, Any]:
    """Data-parallel rank ``dp_rank``'s training stream (of ``dp_size`` shards, default the
    job's data-parallel size) and the validation source."""
    size = job.dims.dp if dp_size is None else dp_size
    return loaders(job.cfg, job.tokenizer, job.model_config, dp_rank=dp_rank, dp_size=size)


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
