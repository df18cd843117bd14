"""``CheckpointCallback``: torch_checkpointing's async checkpoints for a transformers Trainer.

One checkpoint is one ``CheckpointManager.save`` of these items:

- ``model``, ``optimizer`` (the torch optimizer inside Accelerate's wrapper), ``lr_scheduler``
  and, with fp16, the gradient ``scaler``. Replicated tensors (one process, DDP) are written
  by one rank, DTensor shards (FSDP2) by their owners: torch_checkpointing's protocol.
- ``trainer_state``: the ``TrainerState`` as the Trainer writes it to ``trainer_state.json``.
  It is the data position: the Trainer derives the epochs and batches to skip from its
  ``global_step``.
- ``rng``: per rank (``PerRank``), the Python, NumPy, torch CPU and accelerator generators.

Resuming goes through the Trainer's own resume path, so the batch skipping and the moment the
RNG is restored (after the skipped batches are drawn) are the Trainer's: ``resume(trainer)``
writes the checkpoint's ``trainer_state.json`` and ``rng_state.pth`` (what the Trainer reads
from its own checkpoints) into a temporary folder and returns it for
``train(resume_from_checkpoint=...)``. The Trainer would look there for weights too; instead
the weights, optimizer and scheduler are filled from the checkpoint at ``on_train_begin``,
once the Trainer has built and wrapped them.

When to save: where the Trainer would save (after the step's logging and evaluation, so the
RNG saved is the one its own resume would restore), at its save steps or every ``save_steps``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import tempfile
from typing import Any

import numpy as np
import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.training_args import ParallelMode

from .._errors import CheckpointError
from .._exchange import allgather_int64
from .._tree import PerRank
from ..manager import CheckpointManager
from ..policy import CheckpointPolicy

__all__ = ["CheckpointCallback"]

_TRAINER_STATE = "trainer_state.json"
# Accelerators whose generator the Trainer restores from its rng_state.pth; others we restore.
_TRAINER_DEVICES = ("cuda", "npu", "hpu", "mlu", "musa")


class CheckpointCallback(TrainerCallback):
    """Async torch_checkpointing checkpoints for a transformers ``Trainer``, resumed bit for bit.

    Args:
        root: folder of the checkpoints (with ``storage``: a sub-folder of it).
        save_steps: save every N optimizer steps; ``None``: at the Trainer's own save steps
            (``args.save_strategy`` ``"steps"`` or ``"epoch"``).
        hf_checkpoints: let the Trainer also write its own, synchronous ``checkpoint-N``
            folders (``push_to_hub``, ``load_best_model_at_end``); off by default: these
            checkpoints replace them, and a step blocks only while its state is staged.
        storage, policy, policy_fields: as for ``CheckpointManager`` (``keep_last=2``,
            ``async_mode="thread"``, ...).

    Pass it in ``callbacks=[...]`` and train with
    ``trainer.train(resume_from_checkpoint=callback.resume(trainer))``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None,
        *,
        save_steps: int | None = None,
        hf_checkpoints: bool = False,
        storage: Any = None,
        policy: CheckpointPolicy | None = None,
        **policy_fields: Any,
    ) -> None:
        if save_steps is not None and (
            isinstance(save_steps, bool) or not isinstance(save_steps, int) or save_steps < 1
        ):
            raise ValueError(
                f"CheckpointCallback: save_steps must be None (the Trainer's save steps) or an "
                f"int >= 1, got {save_steps!r}"
            )
        if root is None and storage is None:
            raise ValueError("CheckpointCallback: pass root=... (a folder) or storage=...")
        if not isinstance(hf_checkpoints, bool):
            raise TypeError(
                f"CheckpointCallback: hf_checkpoints must be a bool, got {hf_checkpoints!r}"
            )
        if policy is not None and not isinstance(policy, CheckpointPolicy):
            raise TypeError(
                f"CheckpointCallback: policy must be a CheckpointPolicy, got {type(policy).__name__}"
            )
        # An unknown field is a TypeError naming it; values are checked by CheckpointPolicy.
        self.policy = dataclasses.replace(policy or CheckpointPolicy(), **policy_fields)
        if self.policy.read_only:
            raise ValueError("CheckpointCallback: read_only=True cannot save; it must be False")
        self.root = root
        self.storage = storage
        self.save_steps = save_steps
        self.hf_checkpoints = hf_checkpoints
        self.manager: CheckpointManager | None = None
        """The ``CheckpointManager``, open from ``resume()`` until ``close()``."""
        self._trainer: Trainer | None = None
        self._resume_step: int | None = None
        self._resume_dir: tempfile.TemporaryDirectory | None = None
        self._device_rng: tuple[str, list[torch.Tensor]] | None = None
        self._pending = False
        self._last_saved: int | None = None

    # ------------------------------------------------------------------------ resume
    def resume(self, trainer: Trainer) -> str | None:
        """Bind to ``trainer`` and open the checkpoints; returns the folder to pass as
        ``trainer.train(resume_from_checkpoint=...)``, or ``None`` when there is none.

        Resumes from the newest intact checkpoint (a damaged newer one is skipped with a
        warning). Under torch.distributed every rank calls it; the RNG states are per rank,
        so resuming needs the world size that saved them.
        """
        if not isinstance(trainer, Trainer):
            raise TypeError(
                f"CheckpointCallback.resume: trainer must be a transformers Trainer (TRL's "
                f"trainers are), got {type(trainer).__name__}"
            )
        args = trainer.args
        if trainer.is_deepspeed_enabled:
            raise ValueError(
                "CheckpointCallback: DeepSpeed keeps its optimizer in its own engine and "
                "checkpoint format; use the Trainer's checkpoints with DeepSpeed"
            )
        strategy = getattr(args.save_strategy, "value", args.save_strategy)
        if self.save_steps is None and strategy not in ("steps", "epoch"):
            raise ValueError(
                f"CheckpointCallback: save_steps=None saves at the Trainer's save steps, but "
                f"args.save_strategy is {strategy!r}; allowed: 'steps', 'epoch' (or pass "
                f"CheckpointCallback(save_steps=N))"
            )
        if args.load_best_model_at_end and not self.hf_checkpoints:
            raise ValueError(
                "CheckpointCallback: args.load_best_model_at_end needs the Trainer's own "
                "checkpoints; pass hf_checkpoints=True"
            )
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        self._trainer = trainer
        self._drop_resume_dir()
        if self.manager is None:  # now, not in __init__: the Trainer's args set up the group
            self.manager = CheckpointManager(self.root, storage=self.storage, policy=self.policy)
        if self._agreed_latest_step() is None:
            return None
        position: dict[str, Any] = {"trainer_state": {}, "rng": PerRank(_rng_state())}
        step = self.manager.load(position, fallback=True)
        trainer_state, rng = position["trainer_state"], position["rng"].value
        if trainer_state.get("global_step") != step:
            raise CheckpointError(
                f"CheckpointCallback: checkpoint of step {step} holds the trainer state of "
                f"step {trainer_state.get('global_step')}"
            )
        folder = tempfile.TemporaryDirectory(prefix="torch_checkpointing-hf-resume-")
        with open(os.path.join(folder.name, _TRAINER_STATE), "w", encoding="utf-8") as f:
            f.write(json.dumps(trainer_state, indent=2, sort_keys=True) + "\n")
        name = "rng_state.pth" if args.world_size <= 1 else f"rng_state_{args.process_index}.pth"
        distributed = args.parallel_mode == ParallelMode.DISTRIBUTED
        torch.save(_trainer_rng_file(rng, distributed), os.path.join(folder.name, name))
        device = _accelerator()
        self._device_rng = None
        if device is not None and device not in _TRAINER_DEVICES and device in rng:
            self._device_rng = (device, rng[device])
        self._resume_step = step
        self._resume_dir = folder
        self._route_weight_loading(trainer)
        return folder.name

    def _agreed_latest_step(self) -> int | None:
        """The newest complete step, the same on every rank (one small collective), so that
        either all ranks load (a collective) or none does."""
        assert self.manager is not None
        latest = self.manager.latest_step()
        pg = self.manager._pg
        if pg is None or pg.size() == 1:
            return latest
        rows = allgather_int64(pg, [-1 if latest is None else latest])
        if any(r != rows[0] for r in rows):
            raise CheckpointError(
                f"CheckpointCallback: the ranks see different newest checkpoints under "
                f"{self.manager.storage!r} (per rank: {[r[0] for r in rows]}, -1: none); is "
                f"the folder on a filesystem every rank sees alike?"
            )
        return latest

    def _route_weight_loading(self, trainer: Trainer) -> None:
        """The Trainer loads weights from ``resume_from_checkpoint`` before building the
        optimizer; for our folder it skips that, and ``on_train_begin`` loads them instead."""
        load = getattr(trainer, "_load_from_checkpoint", None)
        if not callable(load):
            raise CheckpointError(
                "CheckpointCallback: this transformers Trainer has no _load_from_checkpoint; "
                "the supported versions are transformers>=5,<6"
            )
        if getattr(load, "_torch_checkpointing", None) is self:
            return

        def load_from_checkpoint(resume_from_checkpoint: str, model: Any = None) -> None:
            here = self._resume_dir
            if here is not None and os.path.abspath(resume_from_checkpoint) == here.name:
                return
            load(resume_from_checkpoint, model)

        load_from_checkpoint._torch_checkpointing = self  # type: ignore[attr-defined]
        trainer._load_from_checkpoint = load_from_checkpoint

    def _drop_resume_dir(self) -> None:
        if self._resume_dir is not None:
            self._resume_dir.cleanup()
            self._resume_dir = None

    # ------------------------------------------------------------------------- items
    def _items(self) -> dict[str, Any]:
        trainer = self._trainer
        assert trainer is not None
        optimizer = trainer.optimizer
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):  # Accelerate's AcceleratedOptimizer
            optimizer = inner
        items: dict[str, Any] = {
            "model": trainer.model,
            "optimizer": optimizer,
            "lr_scheduler": trainer.lr_scheduler,
        }
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            items["scaler"] = scaler
        return items

    def _save(self, state: Any) -> None:
        self._pending = False
        if state.global_step == self._last_saved or self.manager is None:
            return
        trainer = self._trainer
        assert trainer is not None
        if trainer.hp_search_backend is None:
            trainer.store_flos()  # as the Trainer's own save does (a collective when distributed)
        exported: dict[str, list[Any]] = {}
        for cb in [*trainer.callback_handler.callbacks, trainer.control]:
            if isinstance(cb, ExportableState):
                exported.setdefault(type(cb).__name__, []).append(cb.state())
        for name, states in exported.items():
            state.stateful_callbacks[name] = states[0] if len(states) == 1 else states
        items = self._items()
        items["trainer_state"] = dataclasses.asdict(state)
        items["rng"] = PerRank(_rng_state())
        self.manager.save(state.global_step, items)
        self._last_saved = state.global_step

    # ------------------------------------------------------------------------- hooks
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._trainer is None or self.manager is None:
            raise CheckpointError(
                "CheckpointCallback: call trainer.train(resume_from_checkpoint="
                "callback.resume(trainer)); resume() opens the checkpoints and returns None "
                "on a fresh run"
            )
        self._pending = False
        self._last_saved = None
        step, self._resume_step = self._resume_step, None
        if step is None:
            return
        if state.global_step != step:
            raise CheckpointError(
                f"CheckpointCallback: the Trainer starts at step {state.global_step}, but "
                f"resume() prepared step {step}; pass what resume() returned as "
                f"train(resume_from_checkpoint=...)"
            )
        self.manager.load(self._items(), step=step)
        if self._device_rng is not None:
            device, states = self._device_rng
            _set_device_rng(device, states)
        self._last_saved = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.save_steps is None:
            due = control.should_save
        else:
            due = state.global_step % self.save_steps == 0
        self._schedule(due, state, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._schedule(self.save_steps is None and control.should_save, state, control)

    def _schedule(self, due: bool, state: Any, control: Any) -> None:
        if not self.hf_checkpoints:
            control.should_save = False
        if not due:
            return
        self._pending = True
        # The Trainer logs, then evaluates, then would save: save after the last that runs.
        if not (control.should_log or control.should_evaluate):
            self._save(state)

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._pending and not control.should_evaluate:
            self._save(state)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._pending:
            self._save(state)

    # A save still pending here had its log skipped (nothing logged since the last step):
    # these hooks come before any batch of the next step is drawn.
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._pending:
            self._save(state)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._pending:
            self._save(state)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._pending:
            self._save(state)
        self._drop_resume_dir()
        error: Exception | None = None
        try:
            self.wait()
        except Exception as e:  # reported to the other ranks first, so none waits for us
            error = e
        pg = None if self.manager is None else self.manager._pg
        if pg is not None and pg.size() > 1:
            # Every rank's part is on disk once all have waited: past this barrier the last
            # checkpoint is complete for all, so a resume() later in this job sees it everywhere.
            failed = [r for r, (ok,) in enumerate(allgather_int64(pg, [error is None])) if not ok]
            if failed and error is None:
                raise CheckpointError(f"CheckpointCallback: ranks {failed} failed to write a save")
        if error is not None:
            raise error

    # -------------------------------------------------------------------------- misc
    def wait(self) -> None:
        """Block until every queued save is written; raise the first failure."""
        if self.manager is not None:
            self.manager.wait()

    def close(self) -> None:
        """Wait for queued saves, stop the writer and release the checkpoint folder's lock."""
        self._drop_resume_dir()
        if self.manager is not None:
            manager, self.manager = self.manager, None
            manager.close()


def _accelerator() -> str | None:
    if not torch.accelerator.is_available():
        return None
    device = torch.accelerator.current_accelerator()
    return None if device is None else device.type


def _rng_state() -> dict[str, Any]:
    """This process's generators: Python, NumPy (global), torch CPU, the accelerator's."""
    legacy = np.random.get_state(legacy=True)
    assert isinstance(legacy, tuple)  # a dict only for a non-MT19937 global bit generator
    kind, keys, pos, has_gauss, cached = legacy
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "cpu": torch.get_rng_state(),
    }
    device = _accelerator()
    if device is not None:
        module = torch.get_device_module(device)
        get_all = getattr(module, "get_rng_state_all", None)
        state[device] = list(get_all()) if get_all is not None else [module.get_rng_state()]
    return state


def _set_device_rng(device: str, states: list[torch.Tensor]) -> None:
    module = torch.get_device_module(device)
    set_all = getattr(module, "set_rng_state_all", None)
    if set_all is not None:
        set_all(states)
    else:
        module.set_rng_state(states[0])


def _trainer_rng_file(rng: dict[str, Any], distributed: bool) -> dict[str, Any]:
    """``rng`` in the layout of the Trainer's own ``rng_state.pth``."""
    np_state = rng["numpy"]
    out = {
        "python": rng["python"],
        "numpy": (
            np_state["kind"],
            np.asarray(np_state["keys"], dtype=np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        ),
        "cpu": rng["cpu"],
    }
    for device in _TRAINER_DEVICES:
        if device in rng:
            states = rng[device]
            out[device] = (
                states if distributed else states[torch.accelerator.current_device_index()]
            )
    return out
