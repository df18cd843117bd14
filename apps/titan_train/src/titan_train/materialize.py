"""Give each rank the pieces of the model it holds, and nothing more.

The model is built and parallelised on the meta device; ``materialize`` allocates this rank's
local tensors on its device (``to_empty``: flexshard adopts the new shards, DTensors keep their
layout) and fills them either from the model's layout-independent initialisation or from an
HF checkpoint read piece by piece. Both go through one view of this rank's state,
``global_state``: every entry as global shape + (global offset, local tensor) chunks (the
sharded-tensor protocol of docs/design.md), whatever split it: flexshard, tensor parallelism,
expert parallelism or the pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import titan_models
from titan_train.parallelize import ParallelModel


class Chunks:
    """A state-dict entry as the sharded-tensor protocol: ``global_shape``, ``dtype``,
    ``local_chunks()``; chunks alias the live tensors (filling them fills the model)."""

    __slots__ = ("_chunks", "dtype", "global_shape")

    def __init__(
        self,
        global_shape: tuple[int, ...],
        dtype: torch.dtype,
        chunks: Sequence[tuple[tuple[int, ...], torch.Tensor]],
    ) -> None:
        self.global_shape = tuple(global_shape)
        self.dtype = dtype
        self._chunks = chunks

    def local_chunks(self) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        return list(self._chunks)


def global_state(pm: ParallelModel) -> dict[str, Any]:
    """This rank's parameters and buffers (persistent or not) under their FQNs in the whole
    model, each as ``Chunks`` with global offsets."""
    experts = {f"{fqn}.": placement for fqn, _, placement in pm.experts}
    out: dict[str, Any] = {}
    for part in pm.parts:
        if pm.sharded:
            import flexshard

            state = flexshard.sharded_state_dict(part)
        else:
            state = part.state_dict(keep_vars=True)
        for name, buffer in part.named_buffers():
            state.setdefault(name, buffer)  # non-persistent buffers start at zero too
        for key, value in state.items():
            entry = _as_chunks(value)
            for prefix, placement in experts.items():
                if key.startswith(prefix):  # this rank's experts start at expert `first`
                    entry = _shifted(entry, placement.first_local_expert, placement.num_experts)
            out[key] = entry
    return out


def _as_chunks(value: Any) -> Chunks:
    if hasattr(value, "local_chunks"):
        return Chunks(value.global_shape, value.dtype, value.local_chunks())
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        return Chunks(tuple(value.shape), value.dtype, [(tuple(offset), value.to_local())])
    tensor = value.detach()
    return Chunks(tuple(tensor.shape), tensor.dtype, [((0,) * tensor.dim(), tensor)])


def _shifted(entry: Chunks, first: int, total: int) -> Chunks:
    """An expert weight's entry in the global (all experts) tensor."""
    chunks = [((o[0] + first, *o[1:]), t) for o, t in entry.local_chunks()]
    return Chunks((total, *entry.global_shape[1:]), entry.dtype, chunks)


@torch.no_grad()
def materialize(
    pm: ParallelModel,
    device: torch.device,
    *,
    seed: int,
    hf_path: str = "",
    fill: bool = True,
) -> None:
    """Allocate this rank's pieces on ``device`` and fill them: from ``hf_path`` (only the
    byte ranges this rank holds are read) or the model's initialisation for ``seed`` (the
    same full weights for any layout). ``fill=False`` (fake mode) only allocates."""
    for part in pm.parts:
        part.to_empty(device=device)
        if hasattr(part, "_tie"):
            part._tie()
    if not fill:
        return
    state = global_state(pm)
    inits: dict[str, titan_models.Init] = {}
    for part in pm.parts:
        inits |= part.param_inits()
    if hf_path:
        for part in pm.parts:
            for buffer in part.buffers():
                buffer.zero_()  # those the checkpoint holds are overwritten next
        adapters = {k: v for k, v in state.items() if titan_models.is_lora_param(k)}
        titan_models.load_hf_state({k: v for k, v in state.items() if k not in adapters}, hf_path)
        titan_models.init_state(adapters, inits, seed=seed)  # LoRA adapters on the HF base
        return
    titan_models.init_state(state, inits, seed=seed)


def local_bytes(pm: ParallelModel, *, optimizer: str, bf16: bool) -> dict[str, int]:
    """What this rank will hold before the first activation: its parameters and gradients
    (the local shards, plus the largest bucket gathered for compute) and its optimizer state
    (AdamW: two fp32 moments per element; Muon: one), for the parameters that train. Read off
    the meta model."""
    params = sum(_local_numel(p) * p.element_size() for p in pm.parameters())
    trained = [p for p in pm.parameters() if p.requires_grad]
    states = 2 if optimizer == "adamw" else 1
    elements = sum(_local_numel(p) for p in trained)
    return {
        "params": params,
        "grads": sum(_local_numel(p) * p.element_size() for p in trained),
        "optimizer": states * 4 * elements,
        "gathered": _largest_gathered(pm) * (2 if bf16 else 4),
    }


def _local_numel(p: nn.Parameter) -> int:
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.numel()


def _largest_gathered(pm: ParallelModel) -> int:
    if not pm.sharded:
        return 0
    sizes = [
        bucket.layout.full_numel
        for part in pm.flexshard_parts()
        for state in part.flexshard_state.all_states()
        for bucket in state.buckets
    ]
    return 2 * max(sizes, default=0)  # the bucket in use and the prefetched one
