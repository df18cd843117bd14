"""Qwen3-VL on gloo: FSDP 2 and TP 2 give the loss and gradients of one process, with images;
so does Kimi K2.5 at EP 2 (its routed experts over the two FSDP ranks).

One spawn of two ranks runs the app's own path (build on meta, parallelise by the plan,
materialise, one ``train_step`` on packed shapes batches: images of different sizes, several
samples per row) for each layout. Each rank also runs the single-process reference: under
FSDP 2 on both ranks' batches (each DP rank reads every other sample; the loss is the mean
over the global batch's targets), under TP 2 on the one batch both ranks read. Gradients are
compared in full (flexshard's full state dict of the gradients; TP DTensors gathered); fp32.
The app refuses tied embeddings under TP, so the TP case unties the debug model's head.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch

from titan_testing import run_distributed
from titan_train.cli import parse_config

pytest.importorskip("transformers")  # the HF image processor of the shapes data
TOLERANCE = 1e-5  # fp32
LAYOUTS = {  # name: (recipe, arguments)
    "fsdp2": ("qwen3_vl_debug", ["--parallel.dp-shard", "2"]),
    "tp2": ("qwen3_vl_debug", ["--parallel.tp", "2", "--parallel.dp-shard", "1"]),
    "kimi_k25_ep2": ("kimi_k25_debug", ["--parallel.dp-shard", "2", "--parallel.ep", "2"]),
}
COMMON = ["--training.batch-size", "2", "--metrics.no-tensorboard", "--training.max-grad-norm", "0"]


def _full_grads(pm) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient (a collective)."""
    from torch.distributed.tensor import DTensor

    import flexshard

    part = pm.parts[0]
    grads = {}
    if pm.sharded:  # load the gradients into the shards, gather them, put the weights back
        params = [p for p in part.parameters() if p.grad is not None]
        saved = [p.detach().clone() for p in params]
        for p in params:
            p.detach().copy_(p.grad)
        full = flexshard.full_state_dict(part, rank0_only=False, cpu_offload=False)
        for p, w in zip(params, saved, strict=True):
            p.detach().copy_(w)
        names = {n for n, p in part.named_parameters() if p.grad is not None}
        grads = {n: full[n].clone() for n in names}
        # Routed experts under EP are each rank's slice (outside flexshard when every expert
        # lives on one rank): gather them over the expert-parallel group, in rank order.
        for name, experts, placement in pm.experts:
            for leaf, p in experts.named_parameters():
                pieces = [torch.empty_like(p.grad) for _ in range(placement.ep_size)]
                torch.distributed.all_gather(pieces, p.grad.contiguous(), group=pm.group("ep"))
                grads[f"{name}.{leaf}"] = torch.cat(pieces)
        return grads
    for n, p in part.named_parameters():
        if p.grad is not None:
            g = p.grad
            grads[n] = g.full_tensor() if isinstance(g, DTensor) else g.clone()
    return grads


def _layouts_against_one_process(out: str) -> dict:
    import titan_train.build as build

    tied = build.model_config

    def untied(cfg, tokenizer):
        model_cls, config = tied(cfg, tokenizer)
        return model_cls, dataclasses.replace(config, tie_embeddings=False)

    results: dict = {}
    for name, (recipe, argv) in LAYOUTS.items():
        with contextlib.ExitStack() as stack:
            if name == "tp2":
                stack.enter_context(mock.patch.object(build, "model_config", untied))
            results[name] = _one_layout(out, name, recipe, argv)
    return results


def _one_layout(out: str, name: str, recipe: str, argv: list[str]) -> dict:
    from titan_train.build import (
        build_loaders,
        build_model,
        build_optimizer,
        build_parallel,
        resolve,
    )
    from titan_train.losses import loss_sum
    from titan_train.materialize import materialize
    from titan_train.trainer import train_step

    cfg = parse_config(["--output-dir", f"{out}/{name}", *COMMON, *argv], recipe=recipe)
    job = resolve(cfg)
    pm = build_parallel(job, "cpu")
    materialize(pm, torch.device("cpu"), seed=cfg.training.seed)
    batch = next(build_loaders(job, dp_rank=pm.dp_rank)[0])
    grads: dict = {}
    step = train_step(
        pm,
        build_optimizer(pm, cfg),
        batch,
        cfg,
        on_grads=lambda: grads.update(_full_grads(pm)),
    )

    reference = build_model(job, torch.device("cpu"))
    batches = [next(build_loaders(job, dp_rank=r)[0]) for r in range(job.dims.dp)]
    assert all(b.images.grids for b in batches)
    tokens = sum(b.num_target_tokens for b in batches)
    ref_loss = sum(loss_sum(reference, b) for b in batches) / tokens
    ref_loss.backward()
    ref = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert set(grads) == set(ref), sorted(set(grads) ^ set(ref))
    diffs = {n: (grads[n] - ref[n]).abs().max().item() for n in ref}
    worst = max(diffs.values())
    visual = max((grads[n] - ref[n]).abs().max().item() for n in ref if n.startswith("visual."))
    return {
        "tied": reference.config.tie_embeddings,
        "loss": step.loss.item(),
        "ref_loss": ref_loss.item(),
        "grads": worst,
        "worst": sorted(diffs, key=diffs.get)[-3:],
        "visual_grads": visual,
        "images": [len(b.images.grids) for b in batches],
        "grad_scale": max(g.abs().max().item() for g in ref.values()),
    }


@pytest.mark.slow  # one spawn of 2 ranks, three layouts: ~60-90 s on the shared 2-core machine
def test_fsdp2_tp2_of_qwen3_vl_and_ep2_of_kimi_k25_equal_one_process_with_images(tmp_path):
    ranks = run_distributed(_layouts_against_one_process, 2, str(tmp_path), timeout=600)
    for name in LAYOUTS:
        for r in ranks:
            got = r[name]
            print(name, got)
            assert abs(got["loss"] - got["ref_loss"]) <= TOLERANCE, (name, got)
            assert got["grads"] <= TOLERANCE and got["visual_grads"] <= TOLERANCE, (name, got)
            assert got["grad_scale"] > 100 * TOLERANCE  # the comparison is not of zeros
    assert ranks[0]["fsdp2"]["tied"] and not ranks[0]["tp2"]["tied"]
    assert ranks[0]["fsdp2"]["images"] == ranks[1]["fsdp2"]["images"]  # both saw the global batch
