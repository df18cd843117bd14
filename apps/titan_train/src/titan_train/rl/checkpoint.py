"""Checkpoints of an RL job: the trainer (every rank's shards of the model and the optimizer
state, through torch_checkpointing) and the controller (data position, weight version, the
rollouts the work buffer already holds), saved at the same step.

The trainer's part is written by each trainer rank (``trainer.run(save_trainer, ...)`` on
actors, or this process), the controller's by this process, in ``checkpoints/trainer`` and
``checkpoints/controller``. A resume takes the newest step both hold intact.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import flexshard
from torch_checkpointing import CheckpointManager

_MANAGERS: dict[str, CheckpointManager] = {}


class _Model:
    """The model item: flexshard's sharded pieces (filled in place on load), or the tensors."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        if isinstance(self.model, flexshard.FlexShardModule):
            return flexshard.sharded_state_dict(self.model)
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(self.model, flexshard.FlexShardModule):
            self.model.load_state_dict(state)
        # Sharded pieces were filled in place by torch_checkpointing.


class _Optimizer:
    """The optimizer item: state keyed by parameter name, moments as sharded pieces."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        flexshard.init_optim_state(self.optimizer)  # a fresh optimizer: targets to load into
        if not isinstance(self.model, flexshard.FlexShardModule):
            return self.optimizer.state_dict()
        return flexshard.sharded_optim_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(self.model, flexshard.FlexShardModule):
            flexshard.load_sharded_optim_state_dict(self.model, self.optimizer, state)
        else:
            self.optimizer.load_state_dict(state)


def _manager(root: str | Path) -> CheckpointManager:
    key = str(root)
    if key not in _MANAGERS:
        _MANAGERS[key] = CheckpointManager(key, keep_last=2)
    return _MANAGERS[key]


def _trainer_state(learner: Any) -> dict[str, Any]:
    return {
        "model": _Model(learner.model),
        "optim": _Optimizer(learner.model, learner.optimizer),
        "version": learner.version,
    }


def save_trainer(learner: Any, root: str, step: int) -> None:
    """Save this trainer rank's part of step ``step`` (asynchronously: returns once staged)."""
    _manager(root).save(step, _trainer_state(learner))


def load_trainer(learner: Any, root: str, step: int) -> int:
    """Load step ``step`` into this rank's model and optimizer; returns the weight version."""
    state = _trainer_state(learner)
    _manager(root).load(state, step)
    learner.version = int(state["version"])
    return learner.version


def close_trainer(learner: Any, root: str) -> None:
    """Wait for this rank's queued saves and release the root."""
    manager = _MANAGERS.pop(str(root), None)
    if manager is not None:
        manager.close()


class ControllerCheckpoints:
    """The controller's checkpoints (this process): ``step-<n>/`` with ``state.json`` (plain
    values, tensors by reference) and ``tensors.safetensors``, written to a temporary folder
    and renamed into place, so a folder that exists is complete. The newest two are kept."""

    def __init__(self, root: Path, keep_last: int = 2) -> None:
        self.root, self.keep_last = Path(root), keep_last

    def save(self, step: int, state: dict[str, Any]) -> None:
        tensors: dict[str, torch.Tensor] = {}
        skeleton = _flatten(state, tensors)
        tmp = self.root / f".step-{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "tensors.safetensors"))
        (tmp / "state.json").write_text(json.dumps(skeleton))
        final = self.root / f"step-{step}"
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in self.steps()[: -self.keep_last]:
            shutil.rmtree(self.root / f"step-{old}", ignore_errors=True)

    def steps(self) -> list[int]:
        """Steps with a complete controller checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.glob("step-*"):
            if (path / "state.json").is_file() and path.name[5:].isdigit():
                found.append(int(path.name[5:]))
        return sorted(found)

    def load(self, step: int) -> dict[str, Any]:
        folder = self.root / f"step-{step}"
        tensors = load_file(str(folder / "tensors.safetensors"))
        return _unflatten(json.loads((folder / "state.json").read_text()), tensors)


def _flatten(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = value.detach().cpu()
        return {"__tensor__": key}
    if isinstance(value, dict):
        return {
            "__dict__": [[_flatten(k, tensors), _flatten(v, tensors)] for k, v in value.items()]
        }
    if isinstance(value, (list, tuple)):
        return {
            "__list__": [_flatten(v, tensors) for v in value],
            "tuple": isinstance(value, tuple),
        }
    return value


def _unflatten(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if "__tensor__" in value:
            return tensors[value["__tensor__"]]
        if "__dict__" in value:
            return {_unflatten(k, tensors): _unflatten(v, tensors) for k, v in value["__dict__"]}
        items = [_unflatten(v, tensors) for v in value["__list__"]]
        return tuple(items) if value["tuple"] else items
    return value


def trainer_steps(root: Path) -> list[int]:
    """Steps with an intact trainer checkpoint under ``root``."""
    if not root.is_dir():
        return []
    return CheckpointManager(str(root), read_only=True).steps()
