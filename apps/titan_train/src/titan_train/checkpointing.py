"""What a checkpoint of a training job holds, resuming from one, and the final HF export.

Checkpoints go through ``torch_checkpointing``; the model and optimizer are saved as sharded
pieces (flexshard's protocol objects, DTensors) where they can be resharded, and per rank
where they differ per rank in ways a reshard cannot express (pipeline stages, experts, HSDP
replicas, the data position and RNG).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import titan_models
from titan_train.config import JobConfig
from titan_train.errors import ConfigError
from titan_train.materialize import global_state
from titan_train.parallelize import ParallelModel
from titan_train.run_folder import RunFolderPlan

__all__ = ["ConfigError", "TrainState", "checkpoint_state", "export_hf", "resume"]


class TrainState:
    """Progress that a checkpoint must restore besides model, optimizer and data: the step and
    every random generator (host, Python, and the training device's)."""

    def __init__(self, device: torch.device) -> None:
        self.step = 0
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"step": self.step, "rng": torch.get_rng_state()}
        state["python"] = list(random.getstate()[1])
        if self.device.type == "cuda":
            state["device_rng"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        torch.set_rng_state(state["rng"])
        random.setstate((3, tuple(int(x) for x in state["python"]), None))
        if self.device.type == "cuda" and "device_rng" in state:
            torch.cuda.set_rng_state(state["device_rng"], self.device)


class ModelState:
    """The model's checkpoint item: sharded pieces (flexshard's protocol objects, DTensors)
    of every local part under the unsplit model's FQNs. ``per_rank``: this rank's pieces as
    plain tensors (what a ``PerRank`` item holds), keyed ``fqn@offset``; they alias the live
    shards, so loading fills them in place too. ``adapters_only``: the LoRA adapters and the
    buffers, no base weight (the base is rebuilt from the run's config)."""

    def __init__(
        self, pm: ParallelModel, *, per_rank: bool = False, adapters_only: bool = False
    ) -> None:
        self.pm, self.per_rank, self.adapters_only = pm, per_rank, adapters_only

    def state_dict(self) -> dict[str, Any]:
        import flexshard

        out: dict[str, Any] = {}
        for part in self.pm.parts:
            state = flexshard.sharded_state_dict(part) if self.pm.sharded else part.state_dict()
            if self.adapters_only:
                base = {n for n, _ in part.named_parameters(remove_duplicate=False)}
                base = {n for n in base if not titan_models.is_lora_param(n)}
                state = {k: v for k, v in state.items() if k not in base}
            out.update(state)
        if not self.per_rank:
            return out
        plain: dict[str, Any] = {}
        for fqn, value in out.items():
            if hasattr(value, "local_chunks"):
                for offset, chunk in value.local_chunks():
                    plain[f"{fqn}@{','.join(map(str, offset))}"] = chunk
            else:
                plain[fqn] = value.to_local() if hasattr(value, "to_local") else value
        return plain

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # torch_checkpointing fills sharded pieces and tensors in place.
        pass


class OptimizerState:
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


def checkpoint_state(
    pm: ParallelModel,
    optimizer: Any,
    scheduler: Any,
    loader: Any,
    state: TrainState,
    *,
    adapters_only: bool = False,
) -> dict[str, Any]:
    """What a checkpoint holds. On several ranks, what differs per rank (data position, RNG,
    optimizer state of local shards, pipeline stages' weights) is saved per rank.
    ``adapters_only`` (LoRA): the model item holds the adapters and buffers, no base weight
    (the optimizer holds the adapters' state only anyway)."""
    if pm.dims.world_size == 1:
        return {
            "model": ModelState(pm, adapters_only=True) if adapters_only else pm.parts[0],
            "optim": optimizer,
            "lr": scheduler,
            "data": loader,
            "train": state,
        }
    from torch_checkpointing import PerRank

    # Stages and experts differ per rank; HSDP replicas hold duplicate shards.
    per_rank = pm.dims.pp > 1 or bool(pm.experts) or pm.dims.dp_replicate > 1
    if per_rank:
        model = PerRank(ModelState(pm, per_rank=True, adapters_only=adapters_only))
    else:
        model = ModelState(pm, adapters_only=adapters_only)
    if pm.sharded and not per_rank:  # reshardable, like the parameters
        optim = OptimizerState(pm.parts[0], optimizer)
    else:
        optim = PerRank(optimizer)
    return {
        "model": model,
        "optim": optim,
        "lr": scheduler,
        "data": PerRank(loader),
        "train": PerRank(state),
    }


def resume(cfg: JobConfig, plan: RunFolderPlan, stateful: dict[str, Any]) -> Any:
    """The checkpoint manager (None without checkpoints), after loading the checkpoint the
    plan resumes from (or the newest intact one below it, when that one turns out damaged:
    a warning names what was skipped, nothing is deleted). A checkpoint that does not fit this
    job (another model, another layout), or a root another live job holds, is a
    ``ConfigError`` and nothing is written."""
    if cfg.checkpoint.interval == 0:
        return None
    from torch_checkpointing import (
        CheckpointLockedError,
        CheckpointManager,
        CorruptCheckpointError,
        StateMismatchError,
    )

    root = plan.run_dir / "checkpoints"
    try:
        ckpt = CheckpointManager(
            root, async_mode=cfg.checkpoint.async_mode, keep_last=cfg.checkpoint.keep_last
        )
    except CheckpointLockedError as e:
        raise ConfigError(str(e)) from None
    if plan.resume_step is None:
        return ckpt
    step = plan.resume_step
    try:
        ckpt.load(stateful, step, fallback=True)
    except StateMismatchError as e:
        ckpt.close()
        diff = [*e.missing[:2], *e.unexpected[:2]]
        diff += [f"{name} ({ours} here, {theirs} saved)" for name, ours, theirs in e.mismatched[:2]]
        raise ConfigError(
            f"checkpoint step {step} in {root} does not fit this job "
            f"({cfg.model.family} {cfg.model.flavor}): {len(e.missing)} missing, "
            f"{len(e.unexpected)} unexpected, {len(e.mismatched)} mismatched entries, e.g. "
            f"{', '.join(diff)}; use another --name, or --checkpoint.no-resume --overwrite"
        ) from None
    except CorruptCheckpointError as e:
        ckpt.close()
        raise ConfigError(
            f"no intact checkpoint to resume from in {root} ({e}); the damaged ones were left "
            "in place: move them aside, or start over with --checkpoint.no-resume --overwrite"
        ) from None
    return ckpt


def export_hf(
    pm: ParallelModel,
    model_config: titan_models.TransformerConfig,
    path: Path,
    cfg: JobConfig | None = None,
) -> None:
    """HF safetensors of the final weights, written by every rank at once from the pieces it
    holds (flexshard shards, tensor-parallel slices); see ``write_hf``. With ``cfg.lora`` on,
    the adapters are merged into their weights first (a plain model)."""
    state = global_state(pm)
    if cfg is not None:
        from titan_train.lora_export import merged_state

        state = merged_state(pm, state, cfg)
    write_hf(state, model_config, path)


def write_hf(
    state: Mapping[str, Any], model_config: titan_models.TransformerConfig, path: Path
) -> None:
    """``state`` (FQN -> whole tensor or this rank's pieces) as an HF folder: titan_models maps
    it to HF keys (``hf_export``) and ``torch_checkpointing.save_hf`` writes every rank's
    pieces into the files in place, nothing gathered. ``config.json`` comes last, so a folder
    that has one is complete."""
    from torch_checkpointing import save_hf

    export = titan_models.hf_export(state, model_config)
    save_hf(export.tensors, path, transforms=export.transforms)
    if not dist.is_initialized() or dist.get_rank() == 0:
        partial = path / ".config.json.partial"
        partial.write_text(json.dumps(export.config, indent=2) + "\n")
        partial.replace(path / "config.json")
    if dist.is_initialized():
        dist.barrier()
