"""The ``fault_tolerance`` section of the job config (torch-free, like ``config``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(kw_only=True, slots=True)
class FaultToleranceConfig:
    """Fault-tolerant replica groups through torchft (``titan_train.fault_tolerance``): the
    replicate axis of HSDP becomes replica groups, each sharded inside by flexshard; a lost
    group is dropped from the next step, a restarted one heals from a live peer."""

    enable: bool = False
    """Train as one replica group of a fault-tolerant job (run folder
    ``<output_dir>/<name>/replica-<id>``)."""
    replica_id: int = 0
    """This replica group's index in [0, group_size): its data shard and run folder."""
    group_size: int = 1
    """Replica groups of the job (at most): the data is split over group_size x dp ranks."""
    min_replicas: int = 1
    """Live replica groups a step needs in order to commit."""
    lighthouse: str = ""
    """torchft lighthouse address (``titan-train lighthouse``), e.g. http://host:29510; empty:
    $TORCHFT_LIGHTHOUSE."""
    local_replicas: int = 0
    """> 0: launch this many replica groups on this host (each of --nproc ranks) with a
    lighthouse of their own, restarting a group that dies."""
    max_restarts: int = 3
    """local_replicas: restarts of each replica group before it is given up."""
    sync_steps: int = 1
    """1: gradients averaged over the live groups every step. H > 1: DiLoCo: H inner steps per
    group, then an outer SGD step on the averaged pseudo-gradient."""
    outer_lr: float = 0.7
    """DiLoCo outer learning rate (0.7 with momentum 0.9: the DiLoCo paper's, for H in the
    hundreds). For short intervals (H of a few steps) plain averaging, outer_lr 1 with
    outer_momentum 0, tracks synchronous training far closer (``benchmarks/diloco.py``)."""
    outer_momentum: float = 0.9
    """DiLoCo outer momentum, Nesterov when > 0; 0 with outer_lr 1 averages the weights."""
    process_group: Literal["gloo", "nccl"] = "gloo"
    """torchft process group across the replica groups."""
    timeout_s: float = 60.0
    """Timeout of reaching the lighthouse, a quorum, the cross-replica collectives, commits
    and healing, in seconds."""


def validate_fault_tolerance(cfg: Any) -> None:
    """Reject fault-tolerance settings no job can run with (part of ``config.validate``)."""
    ft, p = cfg.fault_tolerance, cfg.parallel
    for name in ("group_size", "sync_steps"):
        if getattr(ft, name) < 1:
            raise ValueError(f"fault_tolerance.{name}={getattr(ft, name)} must be >= 1")
    for name in ("timeout_s", "outer_lr"):
        if not (math.isfinite(getattr(ft, name)) and getattr(ft, name) > 0):
            raise ValueError(
                f"fault_tolerance.{name}={getattr(ft, name)} must be a finite number > 0"
            )
    if not 0.0 <= ft.outer_momentum < 1.0:
        raise ValueError(f"fault_tolerance.outer_momentum={ft.outer_momentum} must be in [0, 1)")
    for name in ("local_replicas", "max_restarts"):
        if getattr(ft, name) < 0:
            raise ValueError(f"fault_tolerance.{name}={getattr(ft, name)} must be >= 0")
    if not (ft.enable or ft.local_replicas):
        return
    if ft.local_replicas:  # the launcher numbers its groups
        n, what = ft.local_replicas, "fault_tolerance.local_replicas"
    else:
        n, what = ft.group_size, "fault_tolerance.group_size"
        if not 0 <= ft.replica_id < n:
            raise ValueError(
                f"fault_tolerance.replica_id={ft.replica_id} must be in [0, {what}={n})"
            )
    if not 1 <= ft.min_replicas <= n:
        raise ValueError(
            f"fault_tolerance.min_replicas={ft.min_replicas} must be in [1, {what}={n}]"
        )
    others = {"parallel.dp_replicate": p.dp_replicate, "parallel.tp": p.tp, "parallel.pp": p.pp}
    others |= {"parallel.ep": p.ep, "comm.fake_world_size": cfg.comm.fake_world_size}
    used = [f"{k}={v}" for k, v in others.items() if v not in (0, 1)]
    if used:
        raise ValueError(
            f"fault tolerance composes with parallel.dp_shard and parallel.cp inside each replica "
            f"group (the groups are the replicate axis), not with {', '.join(used)} yet"
        )
    if ft.sync_steps > 1 and cfg.training.skip_nonfinite:
        raise ValueError(
            "fault_tolerance.sync_steps > 1 (DiLoCo) with training.skip_nonfinite is not supported: "
            "a skipped inner step would put the replica groups' syncs out of step"
        )
