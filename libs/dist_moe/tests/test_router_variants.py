"""Router score functions, gate bias, hash routing, clamped / biased experts: each equals its
published formula written out token by token (DeepSeek-V4, gpt-oss), forward and backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from dist_moe import (
    MoE,
    MoEConfig,
    PermuteConfig,
    RouterConfig,
    SharedExperts,
    SwiGLU,
    TopKRouter,
    hash_expert_table,
)


def _deepseek_v4_gate(x, weight, bias, top_k, route_scale, score):
    """DeepSeek-V4's learned router: scores, top-k of scores + bias, renormalised, scaled."""
    logits = F.linear(x, weight)
    scores = {
        "sqrtsoftplus": lambda t: F.softplus(t).sqrt(),
        "sigmoid": torch.sigmoid,
        "softmax": lambda t: t.softmax(-1),
    }[score](logits)
    indices = torch.topk(scores + bias, top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    return weights / (weights.sum(-1, keepdim=True) + 1e-20) * route_scale, indices


@pytest.mark.parametrize("score", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_deepseek_v4_scores_select_and_weigh_like_the_reference(score):
    torch.manual_seed(0)
    cfg = RouterConfig(
        num_experts=16, top_k=4, score_func=score, norm_topk_prob=True, route_scale=1.5
    )
    router = TopKRouter(32, cfg)
    router.reset_parameters(std=0.5)
    router.expert_bias.copy_(torch.randn(16) * 0.05)
    x = torch.randn(100, 32)
    out = router(x)
    w_ref, i_ref = _deepseek_v4_gate(x, router.gate.weight, router.expert_bias, 4, 1.5, score)
    mine, ref = out.indices.sort(-1), i_ref.sort(-1)
    assert torch.equal(mine.values, ref.values)
    torch.testing.assert_close(
        out.weights.gather(1, mine.indices), w_ref.gather(1, ref.indices), rtol=0, atol=1e-6
    )


def test_gate_bias_with_renormalised_softmax_equals_gpt_oss_top_k_softmax():
    torch.manual_seed(1)
    cfg = RouterConfig(num_experts=8, top_k=3, norm_topk_prob=True, gate_bias=True)
    router = TopKRouter(16, cfg)
    router.reset_parameters(std=0.5)
    with torch.no_grad():
        router.gate.bias.normal_(0, 0.5)
    x = torch.randn(64, 16)
    out = router(x)
    # gpt-oss: top-k of the biased logits, softmax over those k logits.
    logits = F.linear(x, router.gate.weight, router.gate.bias)
    top_v, top_i = logits.topk(3, dim=-1)
    assert torch.equal(out.indices, top_i)
    torch.testing.assert_close(out.weights, top_v.softmax(-1), rtol=0, atol=1e-6)
    out.weights.sum().backward()  # the bias is learned
    assert router.gate.bias.grad is not None


def test_hash_routing_looks_experts_up_by_token_and_weighs_them_with_the_gate():
    torch.manual_seed(2)
    vocab, experts, k = 50, 8, 2
    cfg = RouterConfig(
        num_experts=experts,
        top_k=k,
        score_func="sqrtsoftplus",
        norm_topk_prob=True,
        route_scale=1.5,
        hash_vocab_size=vocab,
    )
    router = TopKRouter(16, cfg)
    router.reset_parameters(std=0.5)
    table = router.expert_table
    assert table.shape == (vocab, k) and table.dtype == torch.int64
    assert all(len(set(row)) == k for row in table.tolist())  # distinct experts per token
    ids = torch.randint(0, vocab, (40,))
    x = torch.randn(40, 16)
    out = router(x, token_ids=ids)
    assert torch.equal(out.indices, table[ids])
    scores = F.softplus(F.linear(x, router.gate.weight)).sqrt().gather(1, table[ids])
    torch.testing.assert_close(
        out.weights, scores / scores.sum(-1, keepdim=True) * 1.5, rtol=0, atol=1e-6
    )
    with pytest.raises(ValueError, match="needs token_ids"):
        router(x)
    with pytest.raises(ValueError, match="token_ids must be an integer tensor"):
        router(x, token_ids=ids[:5])


def test_hash_expert_table_spreads_ids_evenly():
    table = hash_expert_table(4096, 16, 4, generator=torch.Generator().manual_seed(3))
    counts = torch.bincount(table.flatten(), minlength=16).float()
    assert counts.sum() == 4096 * 4
    assert counts.max() / counts.mean() < 1.1


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(score_func="relu"), "score_func"),
        (dict(hash_vocab_size=-1), "hash_vocab_size"),
        (dict(hash_vocab_size=10, bias_update_rate=0.1), "hash_vocab_size"),
        (dict(hash_vocab_size=10, num_groups=2, topk_groups=1), "hash_vocab_size"),
    ],
)
def test_bad_router_variant_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RouterConfig(num_experts=8, top_k=2, **kwargs)


def test_swiglu_clamps_gain_and_offset_follow_the_formula():
    g = torch.linspace(-12, 12, 97)
    u = torch.linspace(9, -9, 97)
    gpt_oss = SwiGLU(limit=7.0, alpha=1.702, up_offset=1.0)
    gc, uc = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
    torch.testing.assert_close(gpt_oss(g, u), gc * torch.sigmoid(1.702 * gc) * (uc + 1))
    v4 = SwiGLU(limit=10.0)
    torch.testing.assert_close(v4(g, u), F.silu(g.clamp(max=10.0)) * u.clamp(-10.0, 10.0))
    torch.testing.assert_close(SwiGLU()(g, u), F.silu(g) * u)
    with pytest.raises(ValueError, match="SwiGLU.limit"):
        SwiGLU(limit=0.0)


def _gpt_oss_moe(impl: str, **permute) -> MoE:
    torch.manual_seed(4)
    cfg = MoEConfig(
        dim=16,
        hidden_dim=8,
        router=RouterConfig(num_experts=8, top_k=2, norm_topk_prob=True, gate_bias=True),
        activation=SwiGLU(limit=1.0, alpha=1.702, up_offset=1.0),  # small limit: clamps bite
        expert_bias=True,
        experts_impl=impl,
        permute=PermuteConfig(**permute),
    )
    moe = MoE(cfg)
    moe.reset_parameters(std=0.3)
    with torch.no_grad():
        for name in ("b_gate", "b_up", "b_down"):
            getattr(moe.experts, name).normal_(0, 0.3)
    return moe


def _reference(moe: MoE, x_TD: torch.Tensor) -> torch.Tensor:
    """gpt-oss's expert loop, token by token: (act(x W_gu + b_gu)) W_d + b_d, weighted."""
    route = moe.router(x_TD)
    ex = moe.experts
    out = []
    for t in range(x_TD.shape[0]):
        acc = torch.zeros_like(x_TD[t])
        for k in range(route.indices.shape[1]):
            e = int(route.indices[t, k])
            gate = ex.w_gate[e] @ x_TD[t] + ex.b_gate[e]
            up = ex.w_up[e] @ x_TD[t] + ex.b_up[e]
            h = ex.activation(gate, up)
            acc = acc + route.weights[t, k] * (ex.w_down[e] @ h + ex.b_down[e])
        out.append(acc)
    return torch.stack(out)


@pytest.mark.parametrize(
    ("impl", "permute"),
    [("grouped_mm", {}), ("loop", {}), ("grouped_mm", {"static_shapes": True})],
)
def test_biased_clamped_experts_equal_the_token_by_token_reference(impl, permute):
    moe = _gpt_oss_moe(impl, **permute)
    ref = copy.deepcopy(moe)
    x = torch.randn(30, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y, y_ref = moe(x), _reference(ref, xr)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-5)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=1e-5)
    for name, p in moe.named_parameters():
        q = dict(ref.named_parameters())[name]
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-5, msg=name)
    assert moe.experts.b_down.grad.abs().sum() > 0


def test_clamped_shared_expert_and_hash_moe_layer():
    torch.manual_seed(5)
    cfg = MoEConfig(
        dim=16,
        hidden_dim=8,
        shared_hidden_dim=8,
        router=RouterConfig(num_experts=4, top_k=2, score_func="sqrtsoftplus", hash_vocab_size=32),
        activation=SwiGLU(limit=0.5),
    )
    moe = MoE(cfg)
    moe.reset_parameters(std=0.5)
    shared = moe.shared_experts
    x = torch.randn(2, 5, 16)
    ids = torch.randint(0, 32, (2, 5))
    expected_shared = shared.w_down(
        F.silu(shared.w_gate(x).clamp(max=0.5)) * shared.w_up(x).clamp(-0.5, 0.5)
    )
    routed = moe(x, token_ids=ids) - expected_shared
    route = moe.router(x.reshape(-1, 16), token_ids=ids.reshape(-1))
    assert torch.equal(route.indices, moe.router.expert_table[ids.reshape(-1)])
    ex = moe.experts
    for t in range(10):
        acc = torch.zeros(16)
        for k in range(2):
            e = int(route.indices[t, k])
            h = ex.activation(
                ex.w_gate[e] @ x.reshape(-1, 16)[t], ex.w_up[e] @ x.reshape(-1, 16)[t]
            )
            acc = acc + route.weights[t, k] * (ex.w_down[e] @ h)
        torch.testing.assert_close(routed.reshape(-1, 16)[t], acc, rtol=0, atol=1e-5)
    assert isinstance(SharedExperts(4, 4, activation=SwiGLU(limit=1.0)).activation, SwiGLU)
