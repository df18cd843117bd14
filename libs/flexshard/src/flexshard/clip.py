"""Gradient clipping with the true global norm over every placement."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flexshard._runtime import param_info
from flexshard.placements import Replicate

__all__ = ["clip_grad_norm_", "global_grad_norm"]


def _reduce_groups(p: torch.Tensor, disjoint: Mapping[int, Any]) -> tuple:
    """Groups over which this parameter's local gradient is split (no group: replicated)."""
    info = param_info(p)
    groups: list = []
    if info is None:
        from torch.distributed.tensor import DTensor

        if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements):
            groups.append(_tp_group(p.device_mesh, p.placements))
    else:
        if not isinstance(info.placement, Replicate):
            groups.append(info.group)
        if info.dtensor is not None:
            mesh, placements, _, _ = info.dtensor
            if any(pl.is_shard() for pl in placements):
                groups.append(_tp_group(mesh, placements))
    if id(p) in disjoint:
        groups.append(disjoint[id(p)])
    return tuple(groups)


def _tp_group(mesh, placements):
    if mesh.ndim != 1:
        raise ValueError("flexshard.clip_grad_norm_: only 1-D tensor-parallel meshes are supported")
    return mesh.get_group()


def _local_grad(p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    assert g is not None  # called on parameters with a gradient
    from torch.distributed.tensor import DTensor

    if isinstance(g, DTensor):
        if isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
            # A replicated parameter applied to sharded activations (tensor-parallel QK-norm)
            # gets a partial gradient: sum it now, so the norm, the clip and the optimizer
            # all see the full gradient, the same on every rank.
            g = g.redistribute(p.device_mesh, p.placements)
            p.grad = g
        g = g.to_local()
    return g


def _disjoint_ids(disjoint: Mapping[Any, Iterable[torch.Tensor]] | None) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for group, params in (disjoint or {}).items():
        for p in params:
            out[id(p)] = group
    return out


@torch.no_grad()
def global_grad_norm(
    parameters: nn.Module | torch.Tensor | Iterable[torch.Tensor],
    norm_type: float = 2.0,
    *,
    extra_groups: Sequence[Any] = (),
    disjoint: Mapping[Any, Iterable[torch.Tensor]] | None = None,
) -> torch.Tensor:
    """The norm of the gradient of the whole (unsharded) model, identical on every rank.

    Sharded/owned pieces are summed over the mesh (each element lives on one rank);
    replicated ones count once. ``disjoint`` maps a process group to parameters that are
    different on each of its ranks although flexshard does not shard them over it (experts
    under expert parallelism: their contributions are summed over that group).
    ``extra_groups``: groups over which every contribution is summed (pipeline stages hold
    different parameters). A collective: every rank of the groups involved must call it.
    Forces no device-to-host synchronisation.
    """
    params = _as_list(parameters)
    norm_type = float(norm_type)
    by_id = _disjoint_ids(disjoint)
    # Every rank must issue the same collectives, even one holding no gradient of a group
    # (an Owned parameter's non-owner): groups come from placements, in parameter order.
    inf = math.isinf(norm_type)
    by_key: dict[tuple, list[torch.Tensor]] = {}
    device = None
    for p in params:
        if p.grad is None:
            continue
        g = _local_grad(p)
        device = g.device
        if g.numel():
            by_key.setdefault(_reduce_groups(p, by_id), []).append(g.detach())
    contrib: dict[tuple, torch.Tensor] = {}
    for key, grads in by_key.items():  # one fused norm kernel per group of gradients
        norms = torch.stack([n.float() for n in torch._foreach_norm(grads, norm_type)])
        contrib[key] = norms.max() if inf else norms.pow(norm_type).sum()
    keys = list(dict.fromkeys(_reduce_groups(p, by_id) for p in params))
    if device is None:
        device = params[0].device if params else torch.device("cpu")
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    total = torch.zeros((), dtype=torch.float32, device=device)
    for key in keys:
        v = contrib.get(key, torch.zeros((), dtype=torch.float32, device=device)).to(device)
        for grp in key:
            dist.all_reduce(v, op=op, group=grp)
        total = torch.maximum(total, v) if inf else total + v
    for grp in extra_groups:
        dist.all_reduce(total, op=op, group=grp)
    return total if inf else total ** (1.0 / norm_type)


def _as_list(parameters) -> list[torch.Tensor]:
    if isinstance(parameters, nn.Module):
        return list(parameters.parameters())
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    return list(parameters)


@torch.no_grad()
def clip_grad_norm_(
    parameters: nn.Module | torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    *,
    extra_groups: Sequence[Any] = (),
    disjoint: Mapping[Any, Iterable[torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Like ``torch.nn.utils.clip_grad_norm_`` on the unsharded model: scales every local
    gradient by ``min(1, max_norm / (global_norm + 1e-6))`` and returns the global norm
    (see :func:`global_grad_norm` for ``extra_groups`` and ``disjoint``). A collective over the mesh: every rank must call it with the
    same parameters. No device-to-host synchronisation unless ``error_if_nonfinite``."""
    params = _as_list(parameters)
    total = global_grad_norm(params, norm_type, extra_groups=extra_groups, disjoint=disjoint)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"flexshard.clip_grad_norm_: the total norm of order {norm_type} is non-finite "
            f"({total.item()}); set error_if_nonfinite=False to clip anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [_local_grad(p) for p in params if p.grad is not None]
    for dtype in {g.dtype for g in grads}:
        torch._foreach_mul_([g for g in grads if g.dtype == dtype], coef.to(dtype=dtype))
    return total
