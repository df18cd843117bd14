"""The ranks a bucket is laid out over: a 1-D mesh or process group, or a 2-D HSDP mesh."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass
class GroupInfo:
    """The ranks a bucket is laid out over (``group``) and, under HSDP, the replicas of this
    rank's shard (``replicate_group``); gradients are divided by ``divide`` once reduced."""

    group: Any
    rank: int
    world: int
    replicate_group: Any = None
    replicate_world: int = 1
    divide: float = 1.0


def group_info(mesh: Any) -> GroupInfo:
    """Resolve ``mesh`` (None, a 1-D or 2-D DeviceMesh, or a ProcessGroup) and check
    membership. A 2-D mesh is HSDP: shard over its last dimension, replicate over its first.
    Uses no tensor op on the mesh, so it also works under ``FakeTensorMode``."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("flexshard.shard: torch.distributed is not initialised")
    me = dist.get_rank()
    if mesh is dist.GroupMember.NON_GROUP_MEMBER or (
        isinstance(mesh, int) and mesh == dist.GroupMember.NON_GROUP_MEMBER
    ):
        raise ValueError(
            f"flexshard.shard: mesh (a process group from new_group) does not contain the "
            f"current rank {me}"
        )
    replicate = None
    if mesh is None:
        group = dist.group.WORLD
    else:
        from torch.distributed.device_mesh import DeviceMesh

        if isinstance(mesh, DeviceMesh):
            if mesh.ndim not in (1, 2):
                raise ValueError(
                    f"flexshard.shard: mesh must be 1-D (the data-parallel dimension, e.g. "
                    f"mesh['dp_shard']) or 2-D (dp_replicate, dp_shard) for HSDP, got a "
                    f"{mesh.ndim}-D mesh with dims {mesh.mesh_dim_names}"
                )
            if mesh.get_coordinate() is None:
                raise ValueError(
                    f"flexshard.shard: mesh {mesh} does not contain the current rank {me}"
                )
            group = mesh.get_group(mesh.ndim - 1)
            if mesh.ndim == 2:
                replicate = mesh.get_group(0)
        elif isinstance(mesh, dist.ProcessGroup):
            group = mesh
        else:
            raise ValueError(
                f"flexshard.shard: mesh must be None, a 1-D or 2-D DeviceMesh or a ProcessGroup, "
                f"got {type(mesh).__name__}"
            )
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"flexshard.shard: mesh does not contain the current rank {me}")
    ranks = dist.get_process_group_ranks(group)
    if me not in ranks:
        raise ValueError(f"flexshard.shard: mesh {ranks} does not contain the current rank {me}")
    world = dist.get_world_size(group)
    replicas = dist.get_world_size(replicate) if replicate is not None else 1
    return GroupInfo(
        group,
        dist.get_rank(group),
        world,
        replicate_group=replicate if replicas > 1 else None,
        replicate_world=replicas,
        divide=float(world * replicas),
    )
