"""LoRA fine-tuning in the app: adapters swapped in on the meta model, checks, the merged export.

``apply_lora_config`` swaps in titan_models' adapters (``lora.*``) wherever the model is built
(``build_model``, ``parallelize``, the throw-away meta model of ``prepare``), after the
component overrides, so every layout shards and initialises the same adapted model: the
adapters start from ``training.seed`` on every path (``adapter_inits``), the base from its
initialisation or the HF checkpoint. Everything but the adapters is frozen: the optimizer sees
the adapters only, flexshard reduces only their gradients, and checkpoints hold the adapters
(and the model's buffers) only; the base is rebuilt on resume from the run's config
(``model.*``, ``training.seed`` or ``checkpoint.init_from_hf``, which may not change within a
LoRA run).

``merged_state`` is the HF export's view of the weights: each adapted weight as
``W + (alpha / r) · B A``, computed per piece on the rank that holds it (the small adapters are
summed whole over the ranks first), adapters left out; the exported folder is a plain model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import titan_models
from titan_train.config import JobConfig
from titan_train.materialize import Chunks

__all__ = ["apply_lora_config", "check_lora", "lora_tensor_parallel", "merged_state"]


def apply_lora_config(model: nn.Module, cfg: JobConfig) -> list[str]:
    """Swap in the adapters ``cfg.lora`` asks for (no-op at rank 0); the swapped FQNs.
    ``ValueError`` naming the ``lora.`` field."""
    lora = cfg.lora
    if lora.rank == 0:
        return []
    try:
        return titan_models.apply_lora(
            model,
            rank=lora.rank,
            alpha=lora.alpha,
            targets=lora.targets,
            dropout=lora.dropout,
            seed=cfg.training.seed,
        )
    except ValueError as e:
        raise ValueError(str(e).replace("apply_lora: ", "lora.", 1)) from None


def check_lora(cfg: JobConfig, dims: Any) -> None:
    """Reject what LoRA does not support yet, naming the fields."""
    if cfg.lora.rank == 0:
        return
    if dims.tp > 1 and cfg.lora.dropout > 0:
        raise ValueError(
            f"lora.dropout={cfg.lora.dropout} with parallel.tp={dims.tp} is not supported yet "
            "(a dropout mask on tensor-parallel activations): use lora.dropout=0 or parallel.tp=1"
        )
    if cfg.quantize.linear != "none" or cfg.quantize.experts != "none":
        raise ValueError(
            f"lora.rank={cfg.lora.rank} with quantize.linear={cfg.quantize.linear!r} / "
            f"quantize.experts={cfg.quantize.experts!r} is not supported yet: use 'none'"
        )
    if cfg.optimizer.name != "adamw":
        raise ValueError(
            f"lora.rank={cfg.lora.rank} with optimizer.name={cfg.optimizer.name!r} is not "
            "supported yet: use 'adamw'"
        )


def lora_tensor_parallel(style: Any) -> Any:
    """The tensor-parallel style of a ``LoRALinear`` whose base gets ``style``: column-wise
    (base rows split) splits ``B``'s rows and replicates ``A``; row-wise (base columns split)
    splits ``A``'s columns and replicates ``B``, whose input is then a partial sum, reduced
    with the base's output. ``x Aᵀ Bᵀ`` is computed by DTensor on those layouts."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    colwise = isinstance(style, ColwiseParallel)
    if not colwise and not isinstance(style, RowwiseParallel):
        raise TypeError(f"no LoRA form of tensor-parallel style {type(style).__name__}")
    adapters = (
        {"lora_a": Replicate(), "lora_b": Shard(0)}
        if colwise
        else {
            "lora_a": Shard(1),
            "lora_b": Replicate(),
        }
    )

    def partition(name: str, module: nn.Module, mesh: Any) -> None:
        if "lora_a" not in module._parameters:  # called for every submodule (the dropout)
            return
        base = {n: module._parameters.pop(n) for n in list(adapters)}
        type(style)._partition_linear_fn(style, name, module, mesh)  # weight and bias
        for n, p in base.items():
            dist = distribute_tensor(p, mesh, [adapters[n]], src_data_rank=style.src_data_rank)
            module.register_parameter(n, nn.Parameter(dist, requires_grad=p.requires_grad))

    style._partition_linear_fn = partition
    return style


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
    full = _whole(adapters, device, pm.dims.world_size > 1)
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


def _whole(
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
    ``"cpu:gloo,cuda:nccl"``), else the CPU."""
    types = {entry.split(":")[0] for entry in str(dist.get_backend_config()).split(",")}
    return device if device.type in types else torch.device("cpu")
