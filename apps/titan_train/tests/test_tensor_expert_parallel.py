"""TP x EP (x CP) on gloo: the loss and every gradient of one step equal one process's (fp32).

Qwen3-MoE (routed experts) and DeepSeek-V3 (routed + shared experts, MLA by heads, MTP) at
TP 2 x EP 2 on two ranks; gpt-oss and Kimi K2.5 (images) there too, and Qwen3-MoE at
TP 2 x CP 2 x DP-shard 2 with EP 2 and EP 8 on eight ranks (slow).

Experts are split over ``ep`` while attention and the dense layers are tensor-parallel on the
same ranks: every ``tp`` rank routes every token, dispatches its slice of them, and the routed
outputs are gathered (``titan_train.layout``). One spawn per world size runs the app's own path
(build on meta, parallelise by the plan, materialise, one ``train_step``) for each layout; each
rank also runs the one-process reference on the batches of every data-parallel rank (the loss
is the mean over the global batch's targets). Gradients are compared in full: TP DTensors
gathered, flexshard's shards gathered by its full state dict, routed experts gathered over the
``ep`` group.
"""

from __future__ import annotations

import pytest
import torch

from titan_testing import run_distributed
from titan_train.cli import parse_config

TOLERANCE = 1e-5  # fp32
COMMON = [
    "--training.batch-size", "2", "--training.seq-len", "32", "--metrics.no-tensorboard",
    "--training.max-grad-norm", "0", "--parallel.dp-replicate", "1", "--parallel.pp", "1",
]  # fmt: skip
TP2_EP2 = ["--parallel.tp", "2", "--parallel.ep", "2", "--parallel.dp-shard", "1"]
WORLD2 = {  # name: (recipe, arguments); the ep group is the tp group
    "qwen3_moe_tp2_ep2": ("qwen3_moe_debug", TP2_EP2),
    # routed + shared experts, aux-loss-free bias, MLA by heads (the rope key's gradient
    # summed over tp), an MTP module
    "deepseek_v3_tp2_ep2": ("deepseek_v3_debug", TP2_EP2),
}
WORLD2_MORE = {
    "gpt_oss_tp2_ep2": ("gpt_oss_debug", TP2_EP2),  # biased experts, attention sinks
    "kimi_k25_tp2_ep2": ("kimi_k25_debug", TP2_EP2),  # DeepSeek-V3's decoder, with images
}
WORLD8 = {  # 8 = dp_shard 2 x cp 2 x tp 2; ep 2 inside each tp group, then ep 8 across all
    "qwen3_moe_tp2_cp2_ep2": (
        "qwen3_moe_debug",
        ["--parallel.tp", "2", "--parallel.cp", "2", "--parallel.ep", "2", "--parallel.dp-shard", "2"],
    ),
    "qwen3_moe_tp2_cp2_ep8": (
        "qwen3_moe_debug",
        ["--parallel.tp", "2", "--parallel.cp", "2", "--parallel.ep", "8", "--parallel.dp-shard", "2"],
    ),
}  # fmt: skip


def _full_grads(pm) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient (a collective)."""
    from torch.distributed.tensor import DTensor

    import flexshard

    part = pm.parts[0]
    names = {n for n, p in part.named_parameters() if p.grad is not None}
    if pm.sharded:  # load the gradients into the shards, gather them, put the weights back
        params = [p for p in part.parameters() if p.grad is not None]
        saved = [p.detach().clone() for p in params]
        for p in params:
            p.detach().copy_(p.grad)
        full = flexshard.full_state_dict(part, rank0_only=False, cpu_offload=False)
        for p, w in zip(params, saved, strict=True):
            p.detach().copy_(w)
        grads = {n: full[n].clone() for n in names}
    else:
        grads = {
            n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
            for n, p in part.named_parameters()
            if n in names
        }
    # Routed experts are each ep rank's slice (after flexshard's gather over experts_dp):
    # gathered over the expert-parallel group, in its rank order.
    for name, experts, placement in pm.experts:
        for leaf, _ in experts.named_parameters():
            key = f"{name}.{leaf}"
            if key in grads:
                piece = grads[key].contiguous()
                pieces = [torch.empty_like(piece) for _ in range(placement.ep_size)]
                torch.distributed.all_gather(pieces, piece, group=pm.group("ep"))
                grads[key] = torch.cat(pieces)
    return grads


def _one_layout(out: str, name: str, recipe: str, argv: list[str]) -> dict:
    from titan_train.build import (
        build_loaders,
        build_model,
        build_optimizer,
        build_parallel,
        resolve,
    )
    from titan_train.data.packing import Batch
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
        pm, build_optimizer(pm, cfg), batch, cfg, on_grads=lambda: grads.update(_full_grads(pm))
    )

    reference = build_model(job, torch.device("cpu"))
    batches = [next(build_loaders(job, dp_rank=r)[0]) for r in range(job.dims.dp)]
    # one forward over the global batch: the balance loss is a mean over its sequences
    fields = ("input_ids", "labels", "document_ids", "positions")
    whole = (
        batches[0]
        if len(batches) == 1
        else Batch(*(torch.cat([getattr(b, f) for b in batches]) for f in fields))
    )
    ref_loss = loss_sum(reference, whole) / whole.num_target_tokens
    ref_loss.backward()
    ref = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert set(grads) == set(ref), sorted(set(grads) ^ set(ref))
    diffs = {n: (grads[n] - ref[n]).abs().max().item() for n in ref}
    experts = [n for n in ref if ".experts." in n]
    return {
        "loss": step.loss.item(),
        "ref_loss": ref_loss.item(),
        "grads": max(diffs.values()),
        "worst": sorted(diffs, key=diffs.get)[-3:],
        "expert_grads": max(diffs[n] for n in experts),
        "grad_scale": max(g.abs().max().item() for g in ref.values()),
        "dp_cp": job.dims.dp_cp,
        "split": sorted({type(m.dispatcher).__name__ for m in _moes(pm.parts[0])}),
        # every tp rank routes all of its data-parallel rank's tokens, as one process does
        "counts": step.expert_counts.tolist(),
        "ref_counts": [m.router.tokens_per_expert.tolist() for m in _moes(reference)],
    }


def _moes(model: torch.nn.Module) -> list:
    import dist_moe

    return [m for m in model.modules() if isinstance(m, dist_moe.MoE)]


def _layouts(out: str, layouts: dict) -> dict:
    return {name: _one_layout(out, name, recipe, argv) for name, (recipe, argv) in layouts.items()}


def _check(ranks: list[dict], layouts: dict) -> None:
    for name in layouts:
        for r in ranks:
            got = r[name]
            print(name, got)
            assert abs(got["loss"] - got["ref_loss"]) <= TOLERANCE, (name, got)
            assert got["grads"] <= TOLERANCE, (name, got)
            assert got["grad_scale"] > 100 * TOLERANCE  # the comparison is not of zeros
            assert got["expert_grads"] <= TOLERANCE, (name, got)
            assert got["split"] == ["TokenSplitDispatcher"], (name, got)
            if got["dp_cp"] == 1:  # one data shard: this rank's counts are the whole batch's
                assert got["counts"] == got["ref_counts"], (name, got)


def test_tp2_x_ep2_on_the_same_two_ranks_equals_one_process(tmp_path):
    _check(run_distributed(_layouts, 2, str(tmp_path), WORLD2, timeout=600), WORLD2)


@pytest.mark.slow  # two more families: ~70 s on the shared 2-core machine
@pytest.mark.extended  # the TP x EP path of the fast test, over two more families
def test_tp2_x_ep2_of_gpt_oss_and_kimi_k25_equals_one_process(tmp_path):
    pytest.importorskip("transformers")  # Kimi K2.5's image processor
    _check(run_distributed(_layouts, 2, str(tmp_path), WORLD2_MORE, timeout=600), WORLD2_MORE)


@pytest.mark.slow  # 8 ranks on the shared 2-core machine
def test_tp2_x_cp2_x_ep_on_eight_ranks_equals_one_process(tmp_path):
    _check(run_distributed(_layouts, 8, str(tmp_path), WORLD8, timeout=900), WORLD8)
