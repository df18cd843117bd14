"""Expert parallelism under tensor parallelism over gloo: ``expert_parallel(..., token_group=)``
equals the same MoE run locally (1e-5).

Four ranks in two "tensor-parallel" pairs ({0, 1}, {2, 3}); each pair holds one input,
replicated on both ranks. Experts are split either over all four ranks (EP spans the pairs)
or over each pair (EP = the pair). The reference runs each pair's input once on one process:
every rank's output, input gradient, router and shared-expert gradients must be its pair's
(whole, with no reduction over the pair), and an expert's gradient the sum over the pairs
whose tokens reach its copy. One spawn runs every case.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from dist_moe import MoE, MoEConfig, PermuteConfig, RouterConfig, expert_parallel
from titan_testing import run_distributed

CASES = {  # tokens of each pair, routing and permutation
    "shared_experts_sigmoid_grouped": dict(
        tokens=[10, 6],
        router=dict(score_func="sigmoid", num_groups=4, topk_groups=2, norm_topk_prob=True),
        shared=8,
    ),
    "uneven_split_softmax": dict(tokens=[7, 5], router={}, shared=0),
    "fewer_tokens_than_ranks": dict(tokens=[1, 3], router={}, shared=8),
    "capacity_mode": dict(
        tokens=[8, 8],  # capacity mode: every rank of the ep group holds as many tokens
        router={},
        shared=0,
        # static shapes; a capacity that drops nothing (drops depend on each rank's tokens)
        permute=PermuteConfig(alignment=4, capacity_factor=8.0),
    ),
}


def _build(seed: int, case: dict) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(
        MoEConfig(
            dim=16,
            hidden_dim=8,
            router=RouterConfig(num_experts=8, top_k=3, **case["router"]),
            shared_hidden_dim=case["shared"],
            permute=case.get("permute", PermuteConfig()),
        )
    )
    moe.reset_parameters(std=0.3)
    return moe.train()


def _run(seed: int, case: dict, pair: int, tp_group, ep_group, ep_pairs: list[int]) -> dict:
    full = _build(seed, case)
    inputs = [
        torch.randn(t, 16, generator=torch.Generator().manual_seed(100 + p))
        for p, t in enumerate(case["tokens"])
    ]
    upstream = [torch.randn(t, 16, generator=torch.Generator().manual_seed(200 + p)) for p, t in enumerate(case["tokens"])]  # fmt: skip
    refs = []
    for x, g in zip(inputs, upstream, strict=True):
        ref = copy.deepcopy(full)
        x = x.clone().requires_grad_()
        y = ref(x)
        (y * g).sum().backward()
        refs.append((y.detach(), x.grad, {n: p.grad for n, p in ref.named_parameters()}))

    moe = copy.deepcopy(full)
    placement = expert_parallel(moe, ep_group, token_group=tp_group)
    x = inputs[pair].clone().requires_grad_()
    y = moe(x)
    (y * upstream[pair]).sum().backward()
    out, xgrad, grads = refs[pair]
    errs = {"out": (y - out).abs().max().item(), "x.grad": (x.grad - xgrad).abs().max().item()}
    for n, p in moe.named_parameters():
        if n.startswith("experts."):  # summed over the pairs whose tokens reach this copy
            want = placement.shard(sum(refs[q][2][n] for q in ep_pairs))
        else:  # router, shared experts: the pair's whole gradient on both of its ranks
            want = grads[n]
        errs[n] = (p.grad - want).abs().max().item()
    return errs


def _all_cases() -> tuple[dict, str]:
    rank = dist.get_rank()
    pair = rank // 2
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp_group = pairs[pair]
    results = {}
    for i, (name, case) in enumerate(CASES.items()):
        results[f"{name}/ep_over_pairs"] = _run(i, case, pair, tp_group, None, [0, 1])
        results[f"{name}/ep_in_pair"] = _run(i, case, pair, tp_group, tp_group, [pair])
    moe = _build(0, CASES["capacity_mode"])
    expert_parallel(moe, tp_group, token_group=tp_group)
    try:  # checked on every rank before any collective
        moe(torch.randn(7, 16))
        error = ""
    except ValueError as e:
        error = str(e)
    return results, error


def test_token_split_dispatch_over_tensor_parallel_pairs_equals_one_process():
    for rank, (results, error) in enumerate(run_distributed(_all_cases, 4, timeout=300)):
        for case, errs in results.items():
            for what, err in errs.items():
                assert err <= 1e-5, f"rank {rank} {case} {what}: {err}"
        assert "7 tokens must split evenly over the 2 ranks" in error, error
