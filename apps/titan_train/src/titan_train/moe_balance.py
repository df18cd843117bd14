"""MoE routing balance in the train loop: the step's tokens per expert, the logged load
ratios, and the aux-loss-free bias update (dist_moe) over every data-parallel rank."""

from __future__ import annotations

import torch

from titan_train.parallelize import ParallelModel


def expert_counts(pm: ParallelModel) -> torch.Tensor | None:
    """This step's tokens per expert of every MoE layer this rank routes, ``(layers, E)`` on
    the device (taken before the bias update resets them); None without MoE layers."""
    import dist_moe

    counts = [
        m.router.tokens_per_expert
        for part in pm.parts
        for m in part.modules()
        if isinstance(m, dist_moe.MoE)
    ]
    return torch.stack(counts).float() if counts else None


def moe_load(counts: torch.Tensor | None) -> dict[str, float]:
    """Routing balance: max and mean over MoE layers of max/mean load (reads ``counts`` on
    the host: call it at log steps only)."""
    if counts is None:
        return {}
    mean = counts.mean(1)
    ratios = (counts.amax(1) / mean)[mean > 0].tolist()  # a layer that saw no token: left out
    if not ratios:
        return {}
    return {"moe_load_max": max(ratios), "moe_load_mean": sum(ratios) / len(ratios)}


def update_expert_biases(pm: ParallelModel) -> None:
    """Aux-loss-free balancing: one bias update per step from the loads of every DP rank."""
    import dist_moe

    group = pm.group("dp_cp")  # every rank's tokens (None: one process)
    for part in pm.parts:
        dist_moe.update_expert_biases(part, group)
