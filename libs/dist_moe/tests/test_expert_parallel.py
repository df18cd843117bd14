"""Expert parallelism over gloo: AllToAllDispatcher equals the same MoE run locally (1e-5),
and its static-shape (padded, sync-free) exchange equals the dynamic one bitwise.

One ``run_distributed`` call per world size runs every case (spawning ranks costs seconds).
The reference is the same MoE with all experts on one process: each rank's output and input
gradient come from running it on that rank's tokens; an expert's gradient is the sum over all
ranks' tokens; router and shared-expert gradients are per rank (they are data-parallel).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from dist_moe import (
    AllToAllDispatcher,
    ExpertPlacement,
    MoE,
    MoEConfig,
    PermuteConfig,
    RouterConfig,
    SwiGLU,
    SymmMemDispatcher,
    expert_parallel,
)
from titan_testing import requires_gpus, run_distributed

CASES = {
    "dropless_uneven_tokens_shared": dict(
        tokens=[5, 11, 0, 7], moe=dict(num_experts=8, top_k=2, shared=8)
    ),
    "dropless_zero_tokens_for_some_experts": dict(
        tokens=[6, 9, 4, 13],
        bias={0: 40.0, 1: 40.0, 4: 40.0},  # everyone routes to experts 0, 1, 4 only
        moe=dict(num_experts=8, top_k=3),
    ),
    "deepseek_sigmoid_grouped_static_shapes": dict(
        tokens=[10, 3, 8, 1],
        max_tokens=10,  # static blocks for uneven token counts
        moe=dict(
            num_experts=8,
            top_k=3,
            score_func="sigmoid",
            num_groups=4,
            topk_groups=2,
            norm_topk_prob=True,
            route_scale=2.5,
            permute=PermuteConfig(alignment=4, static_shapes=True),
        ),
    ),
    "gpt_oss_biased_clamped_experts": dict(
        tokens=[9, 4, 6, 2],
        moe=dict(
            num_experts=8,
            top_k=2,
            norm_topk_prob=True,
            gate_bias=True,
            activation=SwiGLU(limit=1.0, alpha=1.702, up_offset=1.0),
            expert_bias=True,
        ),
    ),
    "capacity_mode_with_drops": dict(
        tokens=[12, 12, 12, 12],
        bias={3: 1.0},
        moe=dict(num_experts=8, top_k=2, permute=PermuteConfig(alignment=4, capacity_factor=1.0)),
    ),
}


def _build(
    seed, num_experts, top_k, shared=0, permute=None, activation=None, expert_bias=False, **router
):
    torch.manual_seed(seed)
    cfg = MoEConfig(
        dim=16,
        hidden_dim=8,
        router=RouterConfig(num_experts=num_experts, top_k=top_k, bias_update_rate=0.01, **router),
        shared_hidden_dim=shared,
        permute=permute or PermuteConfig(),
        activation=activation or SwiGLU(),
        expert_bias=expert_bias,
    )
    moe = MoE(cfg)
    moe.reset_parameters(std=0.3)
    if expert_bias:  # the biases travel with their experts (sharded, gradients summed)
        with torch.no_grad():
            for name in ("b_gate", "b_up", "b_down"):
                getattr(moe.experts, name).normal_(0, 0.3)
    return moe


def _max_err(a, b):
    return (a - b).abs().max().item() if a.numel() else 0.0


def _run_case(case_seed, case, device="cpu", dispatcher="all_to_all"):
    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens = case["tokens"][:ws]
    full = _build(case_seed, **case["moe"]).to(device)
    with torch.no_grad():
        for e, b in case.get("bias", {}).items():
            full.router.expert_bias[e] = b
    full.train()
    inputs, upstream = [], []
    for r, t in enumerate(tokens):
        inputs.append(
            torch.randn(t, 16, generator=torch.Generator().manual_seed(100 + r)).to(device)
        )
        upstream.append(
            torch.randn(t, 16, generator=torch.Generator().manual_seed(200 + r)).to(device)
        )

    # reference: one process, all experts, every rank's tokens in turn
    ref = copy.deepcopy(full)
    ref_out, ref_xgrad, ref_grads = [], [], []
    for x, g in zip(inputs, upstream, strict=True):
        ref.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_()
        y = ref(x)
        (y * g).sum().backward()
        ref_out.append(y.detach())
        ref_xgrad.append(x.grad)
        ref_grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})

    ep = copy.deepcopy(full)
    if "max_tokens" in case and dispatcher == "all_to_all":
        cfg = ep.config
        dispatcher = AllToAllDispatcher(
            cfg.router.num_experts, None, cfg.permute, max_tokens=case["max_tokens"]
        )
    placement = expert_parallel(ep, dispatcher=dispatcher)
    x = inputs[rank].clone().requires_grad_()
    y = ep(x)
    (y * upstream[rank]).sum().backward()

    errs = {"out": _max_err(y, ref_out[rank]), "x.grad": _max_err(x.grad, ref_xgrad[rank])}
    for n, p in ep.named_parameters():
        if n.startswith("experts."):
            want = placement.shard(sum(gr[n] for gr in ref_grads))
        else:
            want = ref_grads[rank][n]
        errs[n] = _max_err(p.grad, want)
    # the bias rule sees the counts of all ranks (one all-reduce) and matches the reference
    ep.router.update_bias()
    ref.router.update_bias()  # ref counted every rank's tokens itself
    errs["expert_bias"] = _max_err(ep.router.expert_bias, ref.router.expert_bias)
    return errs


def _static_minus_dynamic(top_k: int) -> dict[str, float]:
    """Largest difference between the static-shape (padded, sync-free) exchange and the
    dynamic one (split sizes read on the host) on the same tokens: outputs, input and
    parameter gradients. Dropless both: equal token counts, no drop."""
    rank = dist.get_rank()
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(300 + rank))
    g = torch.randn(12, 16, generator=torch.Generator().manual_seed(400 + rank))
    got = []
    for static in (False, True):
        moe = _build(7, num_experts=8, top_k=top_k, shared=8)
        moe.config.permute = PermuteConfig(alignment=4, static_shapes=static)
        expert_parallel(moe)
        xi = x.clone().requires_grad_()
        y = moe(xi)
        (y * g).sum().backward()
        got.append([y, xi.grad, *(p.grad for p in moe.parameters())])
    names = ["out", "x.grad", *(n for n, _ in moe.named_parameters())]
    return {n: _max_err(a, b) for n, a, b in zip(names, *got, strict=True)}


def _all_cases():
    ws = dist.get_world_size()
    results = {name: _run_case(i, case) for i, (name, case) in enumerate(CASES.items())}
    bitwise = {k: _static_minus_dynamic(k) for k in (2, 6)}  # top 6 > 4 local experts at ep 2
    moe = _build(0, num_experts=8, top_k=2)
    expert_parallel(moe)
    assert isinstance(moe.dispatcher, AllToAllDispatcher)
    # bad input fails on every rank before any collective (a collective would hang here)
    errors = []
    try:
        AllToAllDispatcher(ws + 1 if ws > 1 else 3, None)
    except ValueError as e:
        errors.append(str(e))
    try:
        moe(torch.randn(4, 15))
    except ValueError as e:
        errors.append(str(e))
    try:
        ExpertPlacement(num_experts=6, ep_size=4, ep_rank=0)
    except ValueError as e:
        errors.append(str(e))
    return results, errors, bitwise


def _check(world_size):
    per_rank = run_distributed(_all_cases, world_size, timeout=300)
    for rank, (results, errors, bitwise) in enumerate(per_rank):
        for top_k, errs in bitwise.items():
            assert all(err == 0.0 for err in errs.values()), (rank, top_k, errs)
        for case, errs in results.items():
            for what, err in errs.items():
                assert err <= 1e-5, f"rank {rank} {case} {what}: {err}"
        assert len(errors) == 3, errors
        assert "num_experts" in errors[0] and "ep_size" in errors[0]
        assert "x must have shape" in errors[1]
        assert "num_experts=6" in errors[2]


def test_ep2_all_to_all_matches_single_process_moe():
    _check(2)


def test_ep4_all_to_all_matches_single_process_moe():
    _check(4)


def _cuda_cases(dispatcher):
    names = CASES if dispatcher == "all_to_all" else ["capacity_mode_with_drops"]
    return {n: _run_case(i, CASES[n], "cuda", dispatcher) for i, n in enumerate(names)}


def _check_cuda(dispatcher):
    per_rank = run_distributed(_cuda_cases, 2, dispatcher, backend="nccl", timeout=300)
    for rank, results in enumerate(per_rank):
        for case, errs in results.items():
            for what, err in errs.items():
                assert err <= 1e-5, f"rank {rank} {case} {what}: {err}"


@pytest.mark.gpu
@requires_gpus(2)
def test_ep2_all_to_all_over_nccl_matches_single_process_moe():
    _check_cuda("all_to_all")


@pytest.mark.gpu
@requires_gpus(2)
def test_ep2_symm_mem_matches_single_process_moe():
    _check_cuda("symm_mem")


def test_symm_mem_dispatcher_without_symmetric_memory_says_what_it_needs():
    # no process group at all here; test_symm_mem.py checks a gloo group and the emulation
    with pytest.raises(ValueError, match="CUDA devices and an NCCL process group"):
        SymmMemDispatcher(8, None, PermuteConfig(capacity_factor=1.0))
