"""Optimizer state as sharded tensors, so a checkpoint reshards it like the parameters.

An optimizer stepping flexshard's local parameters keeps per-parameter state of the local
shape (AdamW's ``exp_avg`` / ``exp_avg_sq``, Muon's ``momentum_buffer``). Such a tensor has
exactly its parameter's layout, so it is described by a :class:`ShardedParam` with the
parameter's global shape and chunk offsets, its chunks aliasing the live state: a loader that
fills them in place (torch_checkpointing, at any world size or placement) loads the optimizer.

Layout of :func:`sharded_optim_state_dict`::

    {"state": {fqn: {name: ShardedParam | tensor | value}},
     "param_groups": [{hyper-parameter: value, ..., "params": [fqn, ...]}]}

Keys are parameter FQNs, not positions, so they mean the same thing on every world size.
Scalar state (``step``) and state of replicated or unmanaged parameters stay plain values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from flexshard._runtime import param_info
from flexshard.placements import Replicate
from flexshard.state_dict import ShardedParam, tp_offset

__all__ = ["init_optim_state", "load_sharded_optim_state_dict", "sharded_optim_state_dict"]


def _names(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    names = {id(p): n for n, p in module.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    "flexshard.sharded_optim_state_dict: the optimizer holds a parameter of "
                    f"shape {tuple(p.shape)} that is not a parameter of the module"
                )
    return names


def _like_param(p: torch.Tensor, value: Any) -> Any:
    """``value`` as a ShardedParam when it has the local parameter's layout."""
    info = param_info(p)
    if (
        info is None
        or isinstance(info.placement, Replicate)
        or not isinstance(value, torch.Tensor)
        or tuple(value.shape) != tuple(info.local.shape)
    ):
        return value
    chunks = info.bucket.layout.local_chunks(info.index, value.detach())
    shape = tuple(info.shape)
    if info.dtensor is not None:
        base = tp_offset(info)
        chunks = [(tuple(a + b for a, b in zip(o, base, strict=True)), t) for o, t in chunks]
        shape = tuple(info.dtensor[2])
    return ShardedParam(shape, value.dtype, chunks, info.placement)


def sharded_optim_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter FQN, sharded state as :class:`ShardedParam`
    aliasing the live tensors (see the module docstring). Call :func:`init_optim_state` first
    when loading into a fresh optimizer. No communication."""
    names = _names(module, optimizer)
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for group in optimizer.param_groups:
        groups.append(
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [names[id(p)] for p in group["params"]],
            }
        )
        for p in group["params"]:
            if p in optimizer.state:
                state[names[id(p)]] = {k: _like_param(p, v) for k, v in optimizer.state[p].items()}
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def init_optim_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state of a fresh optimizer (so there is something to load into): one step
    with zero gradients and learning rate 0, which leaves the parameters unchanged (decoupled
    weight decay is scaled by the learning rate). No-op when the state exists."""
    if optimizer.state:
        return
    saved = []
    for group in optimizer.param_groups:
        saved.append(group["lr"])
        group["lr"] = 0.0
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr
            for p in group["params"]:
                p.grad = None


@torch.no_grad()
def load_sharded_optim_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> None:
    """Load a dict of :func:`sharded_optim_state_dict`'s layout, typically the one that dict
    returned, filled in place by a checkpoint loader: chunks already in place are skipped,
    other tensors are copied, plain values and hyper-parameters are set."""
    names = _names(module, optimizer)
    by_name = {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
    groups = state_dict["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"flexshard.load_sharded_optim_state_dict: {len(groups)} param groups given, the "
            f"optimizer has {len(optimizer.param_groups)}"
        )
    for given, group in zip(groups, optimizer.param_groups, strict=True):
        want = [names[id(p)] for p in group["params"]]
        if list(given["params"]) != want:
            raise ValueError(
                "flexshard.load_sharded_optim_state_dict: a param group lists "
                f"{list(given['params'])[:4]}..., the optimizer's lists {want[:4]}..."
            )
        group.update({k: v for k, v in given.items() if k != "params"})
    for fqn, entries in state_dict["state"].items():
        if fqn not in by_name:
            raise ValueError(
                f"flexshard.load_sharded_optim_state_dict: state for unknown parameter {fqn!r}"
            )
        live = optimizer.state[by_name[fqn]]
        for k, v in entries.items():
            target = live.get(k)
            if target is None and isinstance(v, torch.Tensor | ShardedParam):
                raise ValueError(
                    f"flexshard.load_sharded_optim_state_dict: the optimizer has no {k!r} state "
                    f"for {fqn!r}; call flexshard.init_optim_state(optimizer) first"
                )
            if isinstance(v, ShardedParam) or hasattr(v, "local_chunks"):
                mine = _like_param(by_name[fqn], target)
                have = {tuple(o): t for o, t in v.local_chunks()}
                for off, t in mine.local_chunks():
                    src = have.get(tuple(off))
                    if src is None:
                        raise ValueError(
                            f"flexshard.load_sharded_optim_state_dict: {fqn}.{k}: no chunk at "
                            f"offset {tuple(off)} (saved with another layout: reshard it with "
                            "a checkpoint loader)"
                        )
                    if src.data_ptr() != t.data_ptr():
                        t.copy_(src)
            elif isinstance(v, torch.Tensor) and isinstance(target, torch.Tensor):
                if v.data_ptr() != target.data_ptr():
                    target.copy_(v)
            else:
                live[k] = v
