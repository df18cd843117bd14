"""Static shapes: every rank agrees on each stage's output shape and dtype before a step.

Receive buffers are allocated with these shapes. They are found once per microbatch shape by
running each stage's module on meta tensors in stage order (or its ``output_spec``), and
shared by the stage's owner; bad input found on any rank is raised on every rank before any
activation is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from titan_pipeline.actions import Schedule
from titan_pipeline.stage import PipelineStage, device_of

_MAX_DIMS = 8
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)

_T = TypeVar("_T")


def stage_output_meta(
    schedule: Schedule,
    local: dict[int, PipelineStage],
    microbatches: Sequence[torch.Tensor] | None,
    rank: int,
    group: dist.ProcessGroup | None,
    problem: str | None,
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every stage's output, the same on every rank.

    In the first run of a stage layout, one one-element all-reduce shares whether any rank
    found a problem in its inputs (so every rank raises the same ``ValueError`` instead of
    some waiting forever); the shape is then broadcast from the first stage's rank, and each
    stage in turn computes its output shape (its ``output_spec``, or its module on meta
    tensors) and its owner broadcasts the result, or the error that says the stages do not
    fit. The exchanged tensors live on the stages' device (NCCL takes no host tensors). Later
    runs with the same microbatch shape reuse the agreed shapes with no collective and no
    host read; a run with another shape agrees again, which needs every rank to see the
    change: pass the microbatches on every rank when their shape can change between runs.
    The agreed shape is kept on this rank's first stage object, so every rank's stages must
    take part in the same runs (they do when each rank builds its stages once and calls
    ``run`` with them each step).
    """
    distributed = dist.is_initialized() and schedule.num_ranks > 1
    first = schedule.stage_to_rank[0]
    key = None
    if problem is None and microbatches and (rank == first or microbatches[0] is not None):
        mb = microbatches[0]
        if mb.dim() > _MAX_DIMS or mb.dtype not in _DTYPES:
            problem = (
                f"rank {rank}: microbatches must have at most {_MAX_DIMS} dims and a dtype in "
                f"{list(_DTYPES)}, got shape {list(mb.shape)} dtype {mb.dtype}"
            )
        else:
            key = (tuple(mb.shape), mb.dtype)
    holder = next(iter(local.values()))
    layout = schedule.stage_to_rank
    agreed = holder._agreed_shape.get(layout)
    if agreed is not None and problem is None and key in (None, agreed):
        # Steady state: the shapes agreed in an earlier run of this layout still hold for
        # this rank's inputs (or it has none): no collective and no host read.
        return holder._shape_cache[(layout, agreed)]
    needs_shape = agreed is None or key != agreed
    # problems (at most num_ranks) + (num_ranks + 1) * ranks that need the shape sent
    device = device_of(local.values())  # on the stages' device: NCCL takes no host tensors
    flag = torch.tensor(
        [int(problem is not None) + (schedule.num_ranks + 1) * int(needs_shape)], device=device
    )
    if distributed:
        dist.all_reduce(flag, group=group)
    total = int(flag)
    ranks_needing_shape, problems = divmod(total, schedule.num_ranks + 1)
    if problems:
        messages: list[str | None] = [problem]
        if distributed:
            messages = [None] * schedule.num_ranks
            dist.all_gather_object(messages, problem, group=group)
        raise ValueError("; ".join(p for p in messages if p is not None))
    if not ranks_needing_shape:
        return holder._shape_cache[(layout, agreed)]
    code = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=device)  # [ndim, dtype, shape...]
    if rank == first:
        assert key is not None  # the first stage's rank holds the (checked) microbatches
        shape, dtype = key
        code[0], code[1] = len(shape), _DTYPES.index(dtype)
        code[2 : 2 + len(shape)] = torch.tensor(shape)
    if distributed:
        dist.broadcast(code, src=global_rank(first, group), group=group)
    key = (tuple(code[2 : 2 + int(code[0])].tolist()), _DTYPES[int(code[1])])

    def share(obj: _T, owner_rank: int) -> _T:
        if not distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=global_rank(owner_rank, group), group=group)
        return box[0]

    if (layout, key) not in holder._shape_cache:
        shape, dtype = key
        metas: list[tuple[tuple[int, ...], torch.dtype]] = []
        for s, owner_rank in enumerate(layout):
            result = _stage_meta(local[s], shape, dtype) if owner_rank == rank else None
            result = share(result, owner_rank)
            if isinstance(result, str):
                what = "the microbatches" if s == 0 else f"the output of stage {s - 1}"
                raise ValueError(
                    f"stage {s} (rank {owner_rank}) cannot take {what}: input shape "
                    f"{list(shape)} dtype {dtype}; each stage's output shape must match the "
                    f"next stage's input ({result})"
                )
            assert result is not None  # the owner's result, shared
            shape, dtype = result
            metas.append((shape, dtype))
        holder._shape_cache[(layout, key)] = metas
    holder._agreed_shape[layout] = key
    return holder._shape_cache[(layout, key)]


def _stage_meta(
    stage: PipelineStage, shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[tuple[int, ...], torch.dtype] | str:
    if stage.output_spec is None:
        return _meta_forward(stage.module, shape, dtype)
    try:
        out_shape, out_dtype = stage.output_spec(shape, dtype)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return tuple(out_shape), out_dtype


def _meta_forward(
    module: nn.Module, shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[tuple[int, ...], torch.dtype] | str:
    """Output shape and dtype of ``module`` on an input of ``shape``, or the error text."""
    state = {n: t.to("meta") for n, t in module.named_parameters()}
    state.update({n: t.to("meta") for n, t in module.named_buffers()})
    x = torch.empty(shape, dtype=dtype, device="meta")
    try:
        with torch.no_grad():
            out = torch.func.functional_call(module, state, (x,))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    if not isinstance(out, torch.Tensor):
        return f"a stage must return one tensor, got {type(out).__name__}"
    return tuple(out.shape), out.dtype


def global_rank(group_rank: int, group: dist.ProcessGroup | None) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)
