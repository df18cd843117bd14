"""Fixtures shared by the dist_moe tests: a MoE builder and a token-by-token reference MoE."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_moe import MoE, MoEConfig, PermuteConfig, RouterConfig


def _make_moe(
    *,
    dim=16,
    hidden_dim=8,
    num_experts=8,
    top_k=2,
    shared=0,
    permute=None,
    impl="auto",
    seed=0,
    **router,
) -> MoE:
    torch.manual_seed(seed)
    cfg = MoEConfig(
        dim=dim,
        hidden_dim=hidden_dim,
        router=RouterConfig(num_experts=num_experts, top_k=top_k, **router),
        shared_hidden_dim=shared,
        permute=permute if permute is not None else PermuteConfig(),
        experts_impl=impl,
    )
    moe = MoE(cfg)
    moe.reset_parameters(std=0.3)  # large enough that routing is not a coin toss
    return moe


def _reference_forward(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: out[t] = sum_k w[t, k] * expert_{e[t, k]}(x[t]) (+ shared), dropless."""
    x_TD = x.reshape(-1, x.shape[-1])
    route = moe.router(x_TD)
    ex = moe.experts
    outs = []
    for t in range(x_TD.shape[0]):
        acc = torch.zeros_like(x_TD[t])
        for k in range(route.indices.shape[1]):
            e = int(route.indices[t, k])
            h = F.silu(ex.w_gate[e] @ x_TD[t]) * (ex.w_up[e] @ x_TD[t])
            acc = acc + route.weights[t, k] * (ex.w_down[e] @ h)
        outs.append(acc)
    out = torch.stack(outs)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x_TD)
    return out.reshape(x.shape)


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.fixture
def make_moe():
    return _make_moe


@pytest.fixture
def reference_forward():
    return _reference_forward


@pytest.fixture
def grads():
    return _grads
