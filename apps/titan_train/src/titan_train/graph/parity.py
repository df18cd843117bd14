"""Parity check: the same job stepped eagerly and in graph mode, side by side, on the same
batches (what the tests and ``benchmarks/graph_vs_eager.py`` run; useful to check a config of
one's own: ``compare(out, recipe, steps, graph_argv, *argv)``)."""

from __future__ import annotations

import os
from typing import Any

import torch

SMALL = [  # short rows and batches: a few seconds per step on a loaded CPU
    "--training.batch-size", "2", "--training.seq-len", "16", "--training.grad-accum", "1",
    "--model.attention-backend", "sdpa", "--checkpoint.interval", "0",
    "--metrics.no-tensorboard", "--metrics.peak-flops", "1e11",
]  # fmt: skip


def build_job(out: str, recipe: str, *argv: str, small: bool = True) -> tuple[Any, Any, Any, Any]:
    """(cfg, parallel model, optimizer, loader) of ``recipe`` with ``argv``, materialised."""
    from titan_train.build import build_loaders, build_optimizer, build_parallel, resolve
    from titan_train.cli import parse_config
    from titan_train.device import device_type, init_process_group, resolve_device
    from titan_train.graph import build_graph_step
    from titan_train.materialize import materialize

    cfg = parse_config(
        ["--output-dir", out, "--name", "g", *(SMALL if small else []), *argv], recipe
    )
    job = resolve(cfg)
    device = resolve_device(cfg.training.device)
    init_process_group(device, cfg.comm.timeout_s)  # the runner's part (no-op when made)
    pm = build_parallel(job, device_type(cfg.training.device))
    materialize(pm, device, seed=cfg.training.seed)
    if cfg.compile.mode == "graph":
        pm.graph = build_graph_step(pm, cfg)
    loader, _ = build_loaders(job, dp_rank=pm.dp_rank)
    return cfg, pm, build_optimizer(pm, cfg), loader


def params(pm: Any) -> dict[str, torch.Tensor]:
    """This rank's parameters as plain tensors (DTensors: their local shards)."""
    out = {}
    for n, p in pm.named_parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        out[n] = t.detach().clone()
    return out


def compare(out: str, recipe: str, steps: int, graph_argv: list[str], *argv: str) -> dict:
    """Step an eager and a graph-mode copy of the same job on the same batches: per step,
    whether the losses are ``torch.equal``; at the end, whether every parameter is; and the
    graph runner's counters."""
    from titan_train.trainer import train_step

    torch.manual_seed(0)
    cfg_e, pm_e, opt_e, loader = build_job(os.path.join(out, "e"), recipe, *argv)
    cfg_g, pm_g, opt_g, _ = build_job(
        os.path.join(out, "g"), recipe, "--compile.mode", "graph", *graph_argv, *argv
    )
    from titan_train.device import resolve_device

    device = resolve_device(cfg_e.training.device)
    equal_losses = []
    for _ in range(steps):
        batch = next(loader).to(device)
        a = train_step(pm_e, opt_e, batch, cfg_e)
        b = train_step(pm_g, opt_g, batch, cfg_g)
        equal_losses.append(bool(torch.equal(a.loss, b.loss)))
    pe, pg = params(pm_e), params(pm_g)
    stats = pm_g.graph.stats
    gm = next(iter(pm_g.graph.graphs.values()))
    from titan_train.graph.collectives import count_collectives

    return {
        "losses": equal_losses,
        "params": all(torch.equal(pe[n], pg[n]) for n in pe) and pe.keys() == pg.keys(),
        "traces": stats.traces,
        "loaded": stats.loaded,
        "passes": list(stats.passes),
        "collectives": count_collectives(gm),
        "graph": pm_g.graph,
    }
