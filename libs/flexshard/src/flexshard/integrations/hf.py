"""flexshard inside a transformers ``Trainer`` or a TRL trainer (``SFTTrainer``, ...).

Put :class:`FlexShardTrainerMixin` first in the bases of a trainer class and pass it a model
already sharded by ``flexshard.shard``::

    class FlexShardSFTTrainer(FlexShardTrainerMixin, SFTTrainer):
        pass

The trainer's Accelerator becomes a ``FlexShardAccelerator``
(:mod:`flexshard.integrations.accelerate`): no DDP around the model, flexshard reduces the
gradients (its ``no_sync`` across accumulation micro-steps) and clips by the global norm,
and the optimizer the trainer builds from ``model.parameters()`` steps this rank's shards.
``save_model`` and checkpoints gather the full weights (every rank takes part; the main
process writes them with ``save_pretrained``). Refused, with a ValueError naming the argument:
checkpoints with optimizer state (``save_only_model=False``: the trainer would save rank 0's
optimizer shards as the whole state), ``load_best_model_at_end``, ``resume_from_checkpoint``
(both load full weights into the shards), and FSDP or DeepSpeed (flexshard replaces them).

transformers is not imported here; accelerate only when the trainer builds its Accelerator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from flexshard.integrations.accelerate import adopt, is_flexshard_model
from flexshard.state_dict import full_state_dict

__all__ = ["FlexShardTrainerMixin"]


def _value(x: Any) -> Any:
    return getattr(x, "value", x)  # transformers' str enums (SaveStrategy) and plain strings


def _check_args(args: Any) -> None:
    save = _value(getattr(args, "save_strategy", "no"))
    if save != "no" and not getattr(args, "save_only_model", False):
        raise ValueError(
            f"FlexShardTrainerMixin: save_strategy={save!r} with save_only_model=False: the "
            f"trainer's checkpoints would hold rank 0's optimizer shards as the whole optimizer "
            f"state. Pass save_only_model=True (the model is gathered and saved whole) or "
            f"save_strategy='no'; for resumable checkpoints save flexshard.sharded_state_dict and "
            f"flexshard.sharded_optim_state_dict with a distributed checkpointer"
        )
    if getattr(args, "load_best_model_at_end", False):
        raise ValueError(
            "FlexShardTrainerMixin: load_best_model_at_end=True would load full weights into "
            "flexshard's shards; set it to False and load the saved model with "
            "flexshard.load_full_state_dict"
        )
    for field in ("fsdp", "deepspeed"):
        if getattr(args, field, None):
            raise ValueError(
                f"FlexShardTrainerMixin: {field}={getattr(args, field)!r}; flexshard shards the "
                f"model itself, unset {field}"
            )


if TYPE_CHECKING:
    from transformers import Trainer as _TrainerBase  # the mixin's partner, for type checks
else:
    _TrainerBase = object


class FlexShardTrainerMixin(_TrainerBase):
    """Makes a transformers / TRL trainer train a flexshard-sharded model (see the module
    docstring). Put it first in the bases: ``class T(FlexShardTrainerMixin, SFTTrainer)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        model = kwargs.get("model", args[0] if args else None)
        if not isinstance(model, nn.Module) or not is_flexshard_model(model):
            raise ValueError(
                f"{type(self).__name__}: model must be a module sharded by flexshard.shard "
                f"(build it on every rank, then flexshard.shard(model)), got "
                f"{type(model).__name__}"
            )
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            _check_args(training_args)
        super().__init__(*args, **kwargs)
        _check_args(self.args)  # the defaults a trainer filled in

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        adopt(self.accelerator)

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint:
            raise ValueError(
                f"FlexShardTrainerMixin: resume_from_checkpoint={resume_from_checkpoint!r}: the "
                f"trainer's checkpoints hold full weights and no sharded optimizer state; resume "
                f"from flexshard.sharded_state_dict / sharded_optim_state_dict checkpoints"
            )
        return super().train(None, *args, **kwargs)  # type: ignore[misc]

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # Every rank enters Trainer._save (the non-writers return early inside it), so the
        # gather, a collective, happens here on all of them.
        if state_dict is None and is_flexshard_model(self.model):  # type: ignore[attr-defined]
            state_dict = full_state_dict(self.model, rank0_only=True, cpu_offload=True)  # type: ignore[attr-defined]
        super()._save(output_dir, state_dict=state_dict)  # type: ignore[misc]
