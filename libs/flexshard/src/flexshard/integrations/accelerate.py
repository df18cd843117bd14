"""flexshard inside Hugging Face Accelerate: an ``Accelerator`` that leaves sharded models to
flexshard.

On several processes ``Accelerator.prepare`` wraps a model in ``DistributedDataParallel``,
whose constructor would overwrite every rank's shards with rank 0's (flexshard refuses that
with an error). ``FlexShardAccelerator`` (or any ``Accelerator`` passed to :func:`adopt`)
treats a model sharded by ``flexshard.shard`` as one that reduces its own gradients:

* ``prepare`` / ``prepare_model``: Accelerate's autocast, compile and device placement, no DDP.
* ``clip_grad_norm_``: :func:`flexshard.clip_grad_norm_`, the norm of the whole model's
  gradient (``torch.nn.utils.clip_grad_norm_`` would see only this rank's shards).
* ``no_sync`` / ``accumulate``: unchanged; Accelerate already calls the model's ``no_sync``,
  which is flexshard's.
* ``get_state_dict`` / ``save_model``: full tensors from :func:`flexshard.full_state_dict` (a
  collective: call them on every rank), written by the main process.
* ``save_state`` / ``load_state``: refused, as they would save rank 0's shards and optimizer
  state as if they were the whole. Checkpoint with ``flexshard.sharded_state_dict`` and
  ``sharded_optim_state_dict`` and a distributed checkpointer instead.

Other models go through Accelerate unchanged. accelerate is imported on first use of
``FlexShardAccelerator`` or ``adopt``, never by ``import flexshard``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from flexshard._runtime import FlexShardModule, param_info
from flexshard.clip import clip_grad_norm_
from flexshard.state_dict import full_state_dict

__all__ = ["FlexShardAccelerator", "adopt", "is_flexshard_model"]  # noqa: F822 (lazy, below)


def is_flexshard_model(model: nn.Module) -> bool:
    """Whether ``model`` itself was sharded by ``flexshard.shard``. A model with sharded
    submodules but unsharded parameters of its own is a ValueError: a framework would wrap it
    in DDP, which cannot take the sharded ones."""
    if isinstance(model, FlexShardModule):
        return True
    inner = [n for n, m in model.named_modules() if isinstance(m, FlexShardModule)]
    if inner:
        raise ValueError(
            f"flexshard.integrations: {type(model).__name__} has flexshard-sharded submodules "
            f"{inner[:4]} but is not sharded itself; also shard the whole model "
            f"(flexshard.shard(model) after its submodules: nested sharding) so that flexshard "
            f"reduces every gradient and no DDP is needed"
        )
    return False


class FlexShardAcceleratorMethods:
    """The overrides, mixed in before an ``Accelerator`` class (see the module docstring)."""

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        if is_flexshard_model(model):
            # Accelerate's evaluation mode is everything but the DDP/FSDP wrap.
            evaluation_mode = True
        return super().prepare_model(  # type: ignore[misc]
            model, device_placement=device_placement, evaluation_mode=evaluation_mode
        )

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        params = [parameters] if isinstance(parameters, nn.Parameter) else list(parameters)
        if any(param_info(p) is not None for p in params):
            self.unscale_gradients()  # type: ignore[attr-defined]
            return clip_grad_norm_(params, max_norm, norm_type)
        return super().clip_grad_norm_(params, max_norm, norm_type)  # type: ignore[misc]

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        inner = self.unwrap_model(model) if unwrap else model  # type: ignore[attr-defined]
        if is_flexshard_model(inner):
            return full_state_dict(inner, rank0_only=True, cpu_offload=True)
        return super().get_state_dict(model, unwrap=unwrap)  # type: ignore[misc]

    def _refuse_sharded(self, what: str) -> None:
        sharded = [m for m in self._models if is_flexshard_model(self.unwrap_model(m))]  # type: ignore[attr-defined]
        if sharded:
            raise ValueError(
                f"FlexShardAccelerator.{what}: a prepared model is flexshard-sharded; Accelerate's "
                f"{what} would treat rank 0's parameter and optimizer shards as the whole state. "
                f"Checkpoint flexshard.sharded_state_dict(model) and "
                f"flexshard.sharded_optim_state_dict(model, optimizer) with a distributed "
                f"checkpointer (torch.distributed.checkpoint), or save_model() for full weights"
            )

    def save_state(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_sharded("save_state")
        return super().save_state(*args, **kwargs)  # type: ignore[misc]

    def load_state(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_sharded("load_state")
        return super().load_state(*args, **kwargs)  # type: ignore[misc]


_CLASSES: dict[type, type] = {}


def _with_methods(cls: type) -> type:
    if issubclass(cls, FlexShardAcceleratorMethods):
        return cls
    if cls not in _CLASSES:
        name = (
            "FlexShardAccelerator" if cls.__name__ == "Accelerator" else f"FlexShard{cls.__name__}"
        )
        _CLASSES[cls] = type(name, (FlexShardAcceleratorMethods, cls), {"__module__": __name__})
    return _CLASSES[cls]


def adopt(accelerator: Any) -> Any:
    """Give an existing ``Accelerator`` (e.g. the one a ``Trainer`` built) the flexshard
    behaviour in place, by switching it to a subclass with the methods above; returns it."""
    from accelerate import Accelerator

    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"flexshard.integrations.accelerate.adopt: expected an accelerate.Accelerator, got "
            f"{type(accelerator).__name__}"
        )
    accelerator.__class__ = _with_methods(type(accelerator))
    return accelerator


def __getattr__(name: str) -> Any:
    # FlexShardAccelerator subclasses accelerate.Accelerator: built on first access, so that
    # importing this module does not import accelerate.
    if name == "FlexShardAccelerator":
        from accelerate import Accelerator

        return _with_methods(Accelerator)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
