"""Refusing ``DistributedDataParallel`` over parameters flexshard manages.

DDP's constructor broadcasts rank 0's parameters over every other rank's and its reducer
all-reduces their gradients. On a sharded module those parameters are the local shards:
every rank would silently train rank 0's slices, with no error. flexshard already reduces
gradients, so DDP has nothing to add. Two checks, neither patches DDP:

* Constructor. DDP reads ``module._ddp_params_and_buffers_to_ignore`` (via ``hasattr``, which
  lets anything but ``AttributeError`` through) before any communication. On a sharded module
  that name is a property (``FlexShardModule``) that raises unless every flexshard parameter
  is in the ignore list the caller set.
* Forward. A module sharded *inside* the one handed to DDP escapes the constructor. DDP marks
  its forward (``DistributedDataParallel._active_ddp_module``, the flag TorchDynamo reads);
  flexshard's pre-forward hooks raise when that DDP reduces any of their parameters. The
  shards were already overwritten then, so the message says to rebuild them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from flexshard._runtime import FlexShardState

_INSTEAD = (
    "flexshard already all-gathers parameters and reduces gradients over its mesh: do not wrap "
    "the module in DistributedDataParallel (nor let a framework do it). With a transformers "
    "Trainer or TRL trainer use flexshard.integrations.hf.FlexShardTrainerMixin; with "
    "Accelerate, flexshard.integrations.accelerate.FlexShardAccelerator; in your own loop call "
    "the sharded module directly"
)

_IGNORE_KEY = "_flexshard_ddp_ignore"


def _names(names: list[str]) -> str:
    return repr(names[:4])[:-1] + (f", ... ({len(names)} in all)]" if len(names) > 4 else "]")


def ddp_ignore_list(module: nn.Module) -> list[str]:
    """``module._ddp_params_and_buffers_to_ignore`` of a sharded module, or a RuntimeError when
    DDP would take any of its flexshard parameters."""
    from flexshard._runtime import param_info

    ignored = list(module.__dict__.get(_IGNORE_KEY, ()))
    skip = set(ignored)
    taken = [n for n, p in module.named_parameters() if n not in skip and param_info(p) is not None]
    if taken:
        raise RuntimeError(
            f"DistributedDataParallel over a flexshard-sharded {type(module).__name__}: its "
            f"constructor would broadcast rank 0's parameter shards over every other rank's "
            f"(shards {_names(taken)}), silently corrupting the weights. {_INSTEAD}."
        )
    return ignored


def set_ddp_ignore_list(module: nn.Module, names: object) -> None:
    module.__dict__[_IGNORE_KEY] = list(names)  # type: ignore[call-overload]


def check_not_reduced_by_ddp(state: FlexShardState) -> None:
    """Raise if a DDP forward is running and that DDP reduces parameters of ``state``."""
    ddp = DistributedDataParallel._active_ddp_module
    if ddp is None or ddp in state.ddp_allowed:
        return
    mine = {
        id(t)
        for st in state.all_states()
        for b in st.buckets
        for info in b.infos
        for t in (info.local, info.full)
        if t is not None
    }
    skip = set(getattr(ddp, "parameters_to_ignore", ()))
    taken = [n for n, p in ddp.module.named_parameters() if n not in skip and id(p) in mine]
    if taken:
        raise RuntimeError(
            f"flexshard-sharded {type(state.root).__name__} runs inside the forward of a "
            f"DistributedDataParallel that reduces its shards ({_names(taken)}). DDP's "
            f"constructor has already broadcast rank 0's shards over the other ranks': rebuild "
            f"or reload the model. {_INSTEAD}; wrap only modules whose parameters flexshard "
            f"does not manage, or list the sharded ones in _ddp_params_and_buffers_to_ignore."
        )
    state.ddp_allowed.add(ddp)
