"""Sharded and full state dicts.

A sharded state dict maps each key of ``module.state_dict()`` to:

* a :class:`ShardedParam` for ``Shard`` / ``Owned`` / ``BlockShard`` parameters — the
  sharded-tensor protocol of ``docs/design.md``: ``global_shape``, ``dtype`` and
  ``local_chunks()`` (global offset, tensor). The chunk tensors *alias* the local
  parameters, so a checkpoint loader that fills them in place loads the model directly;
* a plain tensor for ``Replicate`` parameters (every rank holds the same values) and for
  buffers; a ``DTensor`` for replicated parameters that are tensor-parallel DTensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flexshard._layout import CommStats
from flexshard._runtime import FlexShardModule, ParamInfo, param_info
from flexshard.placements import Placement, Replicate

__all__ = [
    "ShardedParam",
    "full_state_dict",
    "load_full_state_dict",
    "load_sharded_state_dict",
    "sharded_state_dict",
]


class ShardedParam:
    """A parameter as this rank holds it: ``global_shape``, ``dtype``, ``local_chunks()``.

    ``local_chunks()`` returns ``[(offset, tensor), ...]``: the offset of each chunk in the
    global tensor and the chunk itself (a view of the live parameter; empty list when this
    rank holds nothing of it). ``placement`` says how the parameter is laid out.
    """

    __slots__ = ("_chunks", "dtype", "global_shape", "placement")

    def __init__(
        self,
        global_shape: tuple[int, ...],
        dtype: torch.dtype,
        chunks: list[tuple[tuple[int, ...], torch.Tensor]],
        placement: Placement | None = None,
    ) -> None:
        self.global_shape = tuple(int(s) for s in global_shape)
        self.dtype = dtype
        self._chunks = list(chunks)
        self.placement = placement

    def local_chunks(self) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        return list(self._chunks)

    def __repr__(self) -> str:
        shapes = [(o, tuple(t.shape)) for o, t in self._chunks]
        return f"ShardedParam(global_shape={self.global_shape}, dtype={self.dtype}, chunks={shapes}, placement={self.placement})"

    def __getstate__(self):
        return {k: getattr(self, k) for k in self.__slots__}

    def __setstate__(self, state):
        for k, v in state.items():
            object.__setattr__(self, k, v)


def _state(module: nn.Module):
    if not isinstance(module, FlexShardModule):
        raise ValueError("flexshard: module was not sharded with flexshard.shard")
    return module.flexshard_state


def tp_offset(info: ParamInfo) -> tuple[int, ...]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    assert info.dtensor is not None  # a DTensor parameter
    mesh, placements, shape, _ = info.dtensor
    _, off = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(off)


def _entry(info: ParamInfo) -> Any:
    local = info.local.detach()
    if isinstance(info.placement, Replicate):
        if info.dtensor is not None:
            from torch.distributed.tensor import DTensor

            mesh, placements, shape, stride = info.dtensor
            return DTensor.from_local(
                local, mesh, placements, run_check=False, shape=shape, stride=stride
            )
        return local
    chunks = info.local_chunks()
    shape = tuple(info.shape)
    if info.dtensor is not None:
        base = tp_offset(info)
        chunks = [(tuple(a + b for a, b in zip(o, base, strict=True)), t) for o, t in chunks]
        shape = tuple(info.dtensor[2])
    return ShardedParam(shape, info.dtype, chunks, info.placement)


def _entries(module: nn.Module) -> list[tuple[str, torch.Tensor, ParamInfo | None]]:
    _state(module)
    return [(k, v, param_info(v)) for k, v in module.state_dict(keep_vars=True).items()]


def sharded_state_dict(module: nn.Module) -> dict[str, Any]:
    """Keys of ``module.state_dict()``; sharded parameters as :class:`ShardedParam`.
    No communication."""
    out: dict[str, Any] = {}
    for key, value, info in _entries(module):
        out[key] = value.detach() if info is None else _entry(info)
    return out


def _gather_bucket_full(bucket, device=None) -> list[torch.Tensor]:
    """Full tensors (master dtype) of every parameter of ``bucket``; a collective."""
    layout = bucket.layout
    dtype = bucket.infos[0].dtype
    dev = device or bucket.device
    flat = torch.empty(layout.full_numel, dtype=dtype, device=dev)
    locals_ = [i.local.detach().to(dtype) for i in bucket.infos]
    p = layout.issue_gather(locals_, flat, dtype, None, CommStats())
    layout.finish_gather(p, flat)
    return [layout.out_view(flat, i) for i in range(len(bucket.infos))]


def full_state_dict(
    module: nn.Module, rank0_only: bool = True, cpu_offload: bool = True
) -> dict[str, torch.Tensor]:
    """Every entry of ``module.state_dict()`` as a full (unsharded) tensor in the master
    dtype. A collective over the mesh (and over tensor-parallel meshes for DTensors).
    ``rank0_only``: only group rank 0 gets the dict, the others get ``{}``."""
    st = _state(module)
    keep = not rank0_only or st.g.rank == 0
    cache: dict[int, list[torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value, info in _entries(module):
        if info is None:
            t = value.detach()
        else:
            b = info.bucket
            if isinstance(info.placement, Replicate):
                t = info.local.detach()
            else:
                # by identity: a nested sharded module (experts) numbers its buckets from 0
                if id(b) not in cache:
                    cache[id(b)] = _gather_bucket_full(b)
                t = cache[id(b)][info.index]
            if info.dtensor is not None:
                from torch.distributed.tensor import DTensor

                mesh, placements, shape, stride = info.dtensor
                t = DTensor.from_local(
                    t, mesh, placements, run_check=False, shape=shape, stride=stride
                ).full_tensor()
        if keep:
            t = t.detach()
            out[key] = t.cpu().clone() if cpu_offload else t.clone()
    return out


def _local_of_full(info: ParamInfo, full: torch.Tensor) -> torch.Tensor:
    if info.dtensor is not None:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        mesh, placements, shape, _ = info.dtensor
        lshape, off = compute_local_shape_and_global_offset(shape, mesh, placements)
        for d, (o, n) in enumerate(zip(off, lshape, strict=True)):
            full = full.narrow(d, o, n)
    dev = info.local.device
    return info.bucket.layout.local_from_full(info.index, full.to(dev, info.dtype))


def _check_keys(expected: list[str], got: Mapping[str, Any], strict: bool, what: str) -> None:
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in set(expected)]
    if strict and (missing or unexpected):
        raise ValueError(
            f"flexshard.{what}: state dict does not match the module: missing keys "
            f"{missing[:10]}, unexpected keys {unexpected[:10]}"
        )


@torch.no_grad()
def load_full_state_dict(
    module: nn.Module,
    state_dict: Mapping[str, torch.Tensor] | None,
    rank0_only: bool = False,
    strict: bool = True,
) -> None:
    """Load full tensors (as from :func:`full_state_dict`) into the local shards.

    ``rank0_only=False``: every rank passes the full dict (no communication).
    ``rank0_only=True``: only group rank 0's ``state_dict`` is read; it is broadcast."""
    st = _state(module)
    entries = _entries(module)
    keys = [k for k, _, _ in entries]
    if rank0_only:
        dev = st.buckets[0].device  # NCCL needs the flag on the device
        ok = torch.tensor([1], dtype=torch.int32, device=dev)
        if st.g.rank == 0:
            try:
                # rank 0 must have every key: the others expect a broadcast for each
                _check_keys(keys, state_dict or {}, True, "load_full_state_dict")
            except ValueError:
                ok.zero_()
                dist.broadcast(ok, group=st.g.group, group_src=0)
                raise
        dist.broadcast(ok, group=st.g.group, group_src=0)
        if not ok.item():
            raise ValueError(
                "flexshard.load_full_state_dict: rank 0's state dict does not match the module"
            )
    else:
        if state_dict is None:
            raise ValueError("flexshard.load_full_state_dict: state_dict is None")
        _check_keys(keys, state_dict, strict, "load_full_state_dict")
    for key, value, info in entries:
        shape = tuple(info.dtensor[2]) if info is not None and info.dtensor else None
        if shape is None:
            shape = tuple(info.shape) if info is not None else tuple(value.shape)
        dtype = info.dtype if info is not None else value.dtype
        if rank0_only:
            dev = value.device if info is None else info.local.device
            if st.g.rank == 0:
                assert state_dict is not None  # every key checked on rank 0 above
                src = state_dict[key].detach().to(dev, dtype).contiguous()
            else:
                src = torch.empty(shape, dtype=dtype, device=dev)
            dist.broadcast(src, group=st.g.group, group_src=0)
        else:
            assert state_dict is not None  # checked above
            if key not in state_dict:
                continue
            src = state_dict[key].detach()
            if tuple(src.shape) != shape:
                raise ValueError(
                    f"flexshard.load_full_state_dict: {key!r} has shape {tuple(src.shape)}, "
                    f"expected the full shape {shape}"
                )
        if info is None:
            value.detach().copy_(src)
        else:
            info.local.detach().copy_(_local_of_full(info, src))


@torch.no_grad()
def load_sharded_state_dict(
    module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True
) -> None:
    """Load a sharded state dict of the same layout (as from :func:`sharded_state_dict`,
    possibly filled in place by a checkpoint loader). A plain full-shape tensor is also
    accepted for any parameter. No communication."""
    entries = _entries(module)
    _check_keys([k for k, _, _ in entries], state_dict, strict, "load_sharded_state_dict")
    for key, value, info in entries:
        if key not in state_dict:
            continue
        src = state_dict[key]
        if info is None:
            value.detach().copy_(src)
            continue
        target = _entry(info)
        if hasattr(src, "local_chunks") and hasattr(src, "global_shape"):
            if tuple(src.global_shape) != tuple(target.global_shape):
                raise ValueError(
                    f"flexshard.load_sharded_state_dict: {key!r} has global shape "
                    f"{tuple(src.global_shape)}, expected {tuple(target.global_shape)}"
                )
            have = {tuple(o): t for o, t in src.local_chunks()}
            for off, t in target.local_chunks():
                s = have.get(tuple(off))
                if s is None or tuple(s.shape) != tuple(t.shape):
                    raise ValueError(
                        f"flexshard.load_sharded_state_dict: {key!r}: no chunk at offset "
                        f"{tuple(off)} of shape {tuple(t.shape)} in the given state dict (it "
                        f"was saved with another layout: reshard with a checkpoint loader or "
                        f"use load_full_state_dict)"
                    )
                if s.data_ptr() != t.data_ptr():
                    t.copy_(s)
        else:
            from torch.distributed.tensor import DTensor

            if isinstance(src, DTensor):
                src = src.to_local()
                if isinstance(info.placement, Replicate):
                    info.local.detach().copy_(src)
                    continue
                raise ValueError(
                    f"flexshard.load_sharded_state_dict: {key!r}: a DTensor for a sharded "
                    f"parameter; pass a ShardedParam or a full tensor"
                )
            src = src.detach()
            full_shape = tuple(info.dtensor[2]) if info.dtensor else tuple(info.shape)
            if tuple(src.shape) == tuple(info.local.shape) and isinstance(
                info.placement, Replicate
            ):
                info.local.detach().copy_(src)
            elif tuple(src.shape) == full_shape:
                info.local.detach().copy_(_local_of_full(info, src))
            else:
                raise ValueError(
                    f"flexshard.load_sharded_state_dict: {key!r} has shape {tuple(src.shape)}, "
                    f"expected a ShardedParam or the full shape {full_shape}"
                )
