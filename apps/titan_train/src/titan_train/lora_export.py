"""The merged LoRA export: ``merged_state`` is the HF export's view of the weights, each
adapted weight as ``W + (alpha / r) · B A``, computed per piece on the rank that holds it (the
small adapters are summed whole over the ranks first), adapters left out; the exported folder
is a plain model."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import titan_models
from titan_train.config import JobConfig
from titan_train.materialize import Chunks

__all__ = ["merged_state", "whole_adapters"]


def merged_state(pm: Any, state: dict[str, Any], cfg: JobConfig) -> dict[str, Any]:
    """``state`` (``materialize.global_state``) with every adapted weight's pieces replaced by
    those of ``W + s · B A`` and the adapters dropped; ``state`` itself without LoRA. On
    several ranks every rank calls it (one all-gather of names, two all-reduces), whether or
    not its pipeline stage holds adapters."""
    if cfg.lora.rank == 0:
        return state
    pairs: dict[str, tuple[str, str, float]] = {}
    for part in pm.parts:
        pairs |= titan_models.lora_weights(part)
    adapters = {k: v for k, v in state.items() if titan_models.is_lora_param(k)}
    device = next(p.device for part in pm.parts for p in part.parameters())
    full = whole_adapters(adapters, device, pm.dims.world_size > 1)
    out = {k: v for k, v in state.items() if k not in adapters}
    for weight, (a, b, scale) in pairs.items():
        entry = state[weight]
        chunks = [
            (offset, _merged_piece(t, offset, full[a], full[b], scale))
            for offset, t in entry.local_chunks()
        ]
        out[weight] = Chunks(entry.global_shape, entry.dtype, chunks)
    return out


def _merged_piece(
    w: torch.Tensor, offset: tuple[int, ...], a: torch.Tensor, b: torch.Tensor, scale: float
) -> torch.Tensor:
    """The piece of ``W + s · B A`` at ``offset`` (``W`` ``(..., out, in)``)."""
    lead = tuple(slice(o, o + n) for o, n in zip(offset[:-2], w.shape[:-2], strict=True))
    rows = slice(offset[-2], offset[-2] + w.shape[-2])
    cols = slice(offset[-1], offset[-1] + w.shape[-1])
    b_piece = b[(*lead, rows, slice(None))].to(w.device)
    a_piece = a[(*lead, slice(None), cols)].to(w.device)
    return w.detach() + titan_models.lora_delta(a_piece, b_piece, scale).to(w.dtype)


def whole_adapters(
    adapters: dict[str, Any], device: torch.device, distributed: bool
) -> dict[str, torch.Tensor]:
    """Every adapter of the whole model as one full fp32 tensor on every rank: each rank adds
    the pieces it holds into zeros, and the sum over ranks is divided by how many ranks hold
    each element (replicas of a piece count once)."""
    local = {k: (tuple(v.global_shape), v.local_chunks()) for k, v in adapters.items()}
    shapes = {k: s for k, (s, _) in local.items()}
    if distributed:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sorted(shapes.items()))
        shapes = dict(sorted({k: tuple(s) for rank in everyone for k, s in rank}.items()))
        device = _collective_device(device)
    sizes = [int(torch.Size(s).numel()) for s in shapes.values()]
    values = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
    counts = torch.zeros_like(values)
    views = dict(zip(shapes, values.split(sizes), strict=True))
    count_views = dict(zip(shapes, counts.split(sizes), strict=True))
    for key, (shape, chunks) in local.items():
        value, count = views[key].view(shape), count_views[key].view(shape)
        for offset, t in chunks:
            box = tuple(slice(o, o + n) for o, n in zip(offset, t.shape, strict=True))
            value[box] += t.detach().to(device, torch.float32)
            count[box] += 1
    if distributed:
        dist.all_reduce(values)
        dist.all_reduce(counts)
    values /= counts.clamp_(min=1)
    return {k: views[k].view(s) for k, s in shapes.items()}


def _collective_device(device: torch.device) -> torch.device:
    """``device`` when the default process group has a backend for its type (e.g.
    ``"cpu:gloo,cuda:nccl"``), else the first device type the group does have a backend for
    (a gloo-only group: its CPU)."""
    types = [entry.split(":")[0] for entry in str(dist.get_backend_config()).split(",")]
    return device if device.type in types else torch.device(types[0])
