"""Cut a model made of an ordered list of units into pipeline stages."""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from titan_pipeline.actions import Schedule
from titan_pipeline.stage import PipelineStage

__all__ = ["balance", "build_stages", "split_units"]


def balance(costs: Sequence[float], num_stages: int) -> list[range]:
    """Contiguous ranges of unit indices, one per stage, minimising the largest stage cost.

    Exact (dynamic programming over cut points); ties go to the earliest cut, so the result
    is deterministic. Every stage gets at least one unit.
    """
    n = len(costs)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    if n < num_stages:
        raise ValueError(f"cannot cut {n} units into num_stages={num_stages}: need >= 1 unit each")
    if any(c < 0 for c in costs):
        raise ValueError(f"unit costs must be >= 0, got {list(costs)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: smallest max-stage cost of the first i units in k stages; cut[k][i]: last cut
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(num_stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    return [range(bounds[k], bounds[k + 1]) for k in range(num_stages)]


def split_units(
    units: Sequence[nn.Module], num_stages: int, *, costs: Sequence[float] | None = None
) -> list[nn.Sequential]:
    """Group ``units`` (embedding, blocks, head, ...) into ``num_stages`` ``nn.Sequential``.

    Balanced by ``costs`` (one per unit), by default each unit's parameter count.
    """
    if costs is None:
        costs = [sum(p.numel() for p in u.parameters()) for u in units]
    elif len(costs) != len(units):
        raise ValueError(f"costs has {len(costs)} entries; there are {len(units)} units")
    return [nn.Sequential(*(units[i] for i in r)) for r in balance(costs, num_stages)]


def build_stages(
    units: Sequence[nn.Module],
    schedule: Schedule,
    rank: int,
    *,
    group: dist.ProcessGroup | None = None,
    costs: Sequence[float] | None = None,
) -> list[PipelineStage]:
    """This rank's ``PipelineStage`` objects for ``schedule``, the units cut by ``split_units``.

    The schedule's stage -> rank mapping (a loop, or the V of ZBV and DualPipeV, where rank
    0 holds the first and the last stage) decides which stages this rank gets.
    """
    modules = split_units(units, schedule.num_stages, costs=costs)
    return [
        PipelineStage(modules[s], s, schedule.num_stages, group)
        for s in schedule.stages_of_rank(rank)
    ]
