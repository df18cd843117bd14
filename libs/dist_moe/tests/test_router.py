"""TopKRouter: selection rules, published formulas, aux-loss-free balancing, aux loss, stats."""

import math

import pytest
import torch

from dist_moe import MoE, MoEConfig, RouterConfig, TopKRouter, update_expert_biases


def _reference_select(choice, num_groups, topk_groups, top_k, group_score):
    """Straightforward per-token selection; ties go to the lower index."""
    e = len(choice)
    per = e // num_groups
    group_scores = []
    for g in range(num_groups):
        vals = sorted(choice[g * per : (g + 1) * per], reverse=True)
        group_scores.append(sum(vals[:2]) if group_score == "top2_sum" else vals[0])
    groups = sorted(range(num_groups), key=lambda g: (-group_scores[g], g))[:topk_groups]
    allowed = [i for i in range(e) if i // per in groups]
    return sorted(allowed, key=lambda i: (-choice[i], i))[:top_k]


@pytest.mark.parametrize("group_score", ["top2_sum", "max"])
@pytest.mark.parametrize(
    ("num_experts", "num_groups", "topk_groups", "top_k"),
    [(8, 1, 1, 2), (16, 4, 2, 4), (12, 3, 1, 3), (8, 8, 3, 3)],
)
def test_group_limited_selection_equals_reference_with_ties(
    num_experts, num_groups, topk_groups, top_k, group_score
):
    torch.manual_seed(0)
    cfg = RouterConfig(
        num_experts=num_experts,
        top_k=top_k,
        num_groups=num_groups,
        topk_groups=topk_groups,
        group_score=group_score,
    )
    router = TopKRouter(8, cfg)
    # Quarter-steps make many exact ties, in expert scores and in group scores.
    scores = torch.randint(0, 4, (300, num_experts)).float() / 4
    got = router.select(scores)
    for t in range(scores.shape[0]):
        want = _reference_select(scores[t].tolist(), num_groups, topk_groups, top_k, group_score)
        assert got[t].tolist() == want, t


def _deepseek_v3_gate(x, weight, bias, n_group, topk_group, top_k, route_scale):
    """DeepSeek-V3's published gate (inference/model.py, sigmoid branch)."""
    scores = torch.nn.functional.linear(x, weight).sigmoid()
    original = scores
    scores = scores + bias
    t = x.shape[0]
    group_scores = scores.view(t, n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
    idx = group_scores.topk(topk_group, dim=-1)[1]
    mask = scores.new_ones(t, n_group, dtype=torch.bool).scatter_(1, idx, False)
    scores = scores.view(t, n_group, -1).masked_fill_(mask.unsqueeze(-1), float("-inf")).flatten(1)
    indices = torch.topk(scores, top_k, dim=-1)[1]
    weights = original.gather(1, indices)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * route_scale, indices


def test_sigmoid_normalised_scaled_weights_match_deepseek_v3():
    torch.manual_seed(1)
    cfg = RouterConfig(
        num_experts=16,
        top_k=4,
        score_func="sigmoid",
        num_groups=4,
        topk_groups=2,
        norm_topk_prob=True,
        route_scale=2.5,
    )
    router = TopKRouter(32, cfg)
    router.reset_parameters(std=0.5)
    router.expert_bias.copy_(torch.randn(16) * 0.1)  # selection only
    x = torch.randn(200, 32)
    out = router(x)
    w_ref, i_ref = _deepseek_v3_gate(x, router.gate.weight, router.expert_bias, 4, 2, 4, 2.5)
    order, order_ref = out.indices.sort(-1), i_ref.sort(-1)
    assert torch.equal(order.values, order_ref.values)
    w = out.weights.gather(1, order.indices)
    w_r = w_ref.gather(1, order_ref.indices)
    torch.testing.assert_close(w, w_r, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.weights.sum(-1), torch.full((200,), 2.5), rtol=0, atol=1e-5)


def test_softmax_topk_with_and_without_renormalisation_matches_qwen3_moe():
    torch.manual_seed(2)
    x = torch.randn(64, 16)
    for norm in (False, True):
        router = TopKRouter(16, RouterConfig(num_experts=8, top_k=2, norm_topk_prob=norm))
        router.reset_parameters(std=0.5)
        out = router(x)
        probs = torch.softmax(torch.nn.functional.linear(x, router.gate.weight), -1)
        top_v, top_i = probs.topk(2, dim=-1)
        if norm:
            top_v = top_v / top_v.sum(-1, keepdim=True)
        assert torch.equal(out.indices, top_i)
        torch.testing.assert_close(out.weights, top_v, rtol=0, atol=1e-7)


def _skewed_router(rate):
    torch.manual_seed(3)
    d, e = 16, 8
    cfg = RouterConfig(num_experts=e, top_k=2, score_func="sigmoid", bias_update_rate=rate)
    router = TopKRouter(d, cfg)
    u = torch.randn(d)
    u = u / u.norm()
    with torch.no_grad():
        # Expert e's logit grows with e along u: high experts take most tokens.
        router.gate.weight.copy_(torch.randn(e, d) * 0.3 + torch.linspace(-2, 2, e)[:, None] * u)
    x = torch.randn(1024, d) + 1.5 * u
    return router, x


def test_fifty_bias_updates_move_max_over_mean_load_toward_one():
    router, x = _skewed_router(rate=0.01)
    router.train()
    router(x)
    before = router.load().max_over_mean
    history = []
    for _ in range(50):
        router.update_bias()
        router(x)
        history.append(router.load().max_over_mean)
    assert before > 2.5, before
    assert max(history[-10:]) < 1.2, history[-10:]
    assert abs(router.expert_bias.mean().item()) < 1e-6  # centred
    # Weights still come from the unbiased scores.
    out = router(x)
    scores = torch.sigmoid(torch.nn.functional.linear(x, router.gate.weight))
    torch.testing.assert_close(out.weights, scores.gather(1, out.indices))


def test_bias_update_uses_counts_accumulated_over_micro_batches_once_per_step():
    router_a, x = _skewed_router(rate=0.01)
    router_b, _ = _skewed_router(rate=0.01)
    router_a.train()
    router_b.train()
    bias0 = router_a.expert_bias.clone()
    for micro in x.chunk(4):  # gradient accumulation: 4 forwards, then one step
        router_a(micro)
    assert torch.equal(router_a.expert_bias, bias0), "forward must not touch the bias"
    router_b(x)  # the same tokens in one batch
    assert torch.equal(router_a.tokens_per_expert, router_b.tokens_per_expert)
    router_a.update_bias()
    router_b.update_bias()
    assert torch.equal(router_a.expert_bias, router_b.expert_bias)
    assert not torch.equal(router_a.expert_bias, bias0)
    assert router_a.tokens_per_expert.sum() == 0
    # A second update with no new tokens changes nothing.
    router_a.update_bias()
    assert torch.equal(router_a.expert_bias, router_b.expert_bias)
    # Eval forwards do not count.
    router_a.eval()
    router_a(x)
    assert router_a.tokens_per_expert.sum() == 0


def test_update_expert_biases_visits_every_router():
    cfg = MoEConfig(
        dim=8, hidden_dim=8, router=RouterConfig(num_experts=4, top_k=1, bias_update_rate=0.1)
    )
    model = torch.nn.Sequential(MoE(cfg), MoE(cfg))
    model.train()
    model(torch.randn(16, 8))
    assert update_expert_biases(model) == 2
    assert all(m.router.tokens_per_expert.sum() == 0 for m in model)


def test_force_balance_deals_assignments_round_robin():
    router = TopKRouter(8, RouterConfig(num_experts=4, top_k=2, force_balance=True))
    router.train()
    out = router(torch.randn(10, 8))
    assert out.counts.tolist() == [5, 5, 5, 5]
    assert out.indices[:2].tolist() == [[0, 1], [2, 3]]
    assert router.load().max_over_mean == 1.0
    assert out.weights.requires_grad  # the gate still gets gradients


def test_load_statistics_count_tokens_per_expert():
    router = TopKRouter(4, RouterConfig(num_experts=4, top_k=1))
    router.train()
    assert math.isnan(router.load().max_over_mean)
    out = router(torch.randn(20, 4))
    load = router.load()
    assert list(load.tokens_per_expert) == out.counts.tolist()
    assert sum(load.tokens_per_expert) == 20
    assert load.max_over_mean == max(load.tokens_per_expert) / 5


def _reference_seq_aux_loss(scores, indices, seq_len, top_k, alpha):
    e = scores.shape[1]
    total = 0.0
    n_seq = scores.shape[0] // seq_len
    for b in range(n_seq):
        s = scores[b * seq_len : (b + 1) * seq_len]
        i = indices[b * seq_len : (b + 1) * seq_len]
        f = torch.stack([(i == j).sum() for j in range(e)]).float() * e / (top_k * seq_len)
        p = (s / s.sum(-1, keepdim=True)).mean(0)
        total = total + (f * p).sum()
    return alpha * total / n_seq


def test_sequence_aux_loss_matches_formula_and_reaches_the_gate_through_moe_backward():
    torch.manual_seed(4)
    rc = RouterConfig(num_experts=8, top_k=2, score_func="sigmoid", seq_aux_loss_coef=0.01)
    moe = MoE(MoEConfig(dim=16, hidden_dim=8, router=rc))
    moe.router.reset_parameters(std=0.3)
    moe.train()
    x = torch.randn(3, 10, 16)
    out = moe.router(x.reshape(-1, 16), seq_len=10)
    scores = moe.router.scores(x.reshape(-1, 16))
    ref = _reference_seq_aux_loss(scores, out.indices, 10, 2, 0.01)
    torch.testing.assert_close(out.aux_loss, ref, rtol=1e-6, atol=0)

    g = torch.randn(3, 10, 16)
    (moe(x) * g).sum().backward()
    grad_attached = moe.router.gate.weight.grad.clone()
    assert moe.aux_loss is not None
    moe.zero_grad()
    moe.config.router.seq_aux_loss_coef = 0.0  # same module, aux loss added by hand
    y = moe(x)
    aux = moe.router(x.reshape(-1, 16), seq_len=10)
    aux_manual = _reference_seq_aux_loss(
        moe.router.scores(x.reshape(-1, 16)), aux.indices, 10, 2, 0.01
    )
    ((y * g).sum() + aux_manual).backward()
    torch.testing.assert_close(grad_attached, moe.router.gate.weight.grad, rtol=1e-5, atol=1e-8)


def _split_sequence_aux_loss(x: torch.Tensor) -> tuple[float, torch.Tensor, int]:
    import torch.distributed as dist

    from dist_moe import sequence_parallel_balance

    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(4)
    rc = RouterConfig(num_experts=8, top_k=2, score_func="sigmoid", seq_aux_loss_coef=0.01)
    router = TopKRouter(16, rc)
    router.reset_parameters(std=0.3)
    router.train()
    set_ = sequence_parallel_balance(router, dist.group.WORLD)
    s = x.shape[1] // n
    # Zig-zag-like: the rank holds two pieces of each row, not one run of it.
    pieces = [x[:, i * s // 2 : (i + 1) * s // 2] for i in (rank, 2 * n - 1 - rank)]
    local = torch.cat(pieces, dim=1).reshape(-1, 16)
    aux = router(local, seq_len=s).aux_loss
    aux.backward()
    return aux.item(), router.gate.weight.grad, set_


def test_sequence_aux_loss_over_a_sequence_split_across_ranks_equals_whole_sequences():
    """Context parallelism: the ranks' losses average to the whole rows' loss, and their
    gradients average (as data parallelism does) to its gradient."""
    from titan_testing import run_distributed

    x = torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(0))
    results = run_distributed(_split_sequence_aux_loss, 2, x, timeout=120)
    torch.manual_seed(4)
    rc = RouterConfig(num_experts=8, top_k=2, score_func="sigmoid", seq_aux_loss_coef=0.01)
    router = TopKRouter(16, rc)
    router.reset_parameters(std=0.3)
    router.train()
    ref = router(x.reshape(-1, 16), seq_len=16).aux_loss
    ref.backward()
    assert [r[2] for r in results] == [1, 1]
    mean_aux = sum(r[0] for r in results) / 2
    assert abs(mean_aux - ref.item()) <= 1e-7, (mean_aux, ref.item())
    mean_grad = sum(r[1] for r in results) / 2
    torch.testing.assert_close(mean_grad, router.gate.weight.grad, rtol=0, atol=1e-7)
    assert not torch.allclose(results[0][1], results[1][1])  # each rank's own tokens


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(num_experts=4, top_k=5), "top_k"),
        (dict(num_experts=6, top_k=2, num_groups=4), "num_groups"),
        (dict(num_experts=8, top_k=2, num_groups=4, topk_groups=5), "topk_groups"),
        (dict(num_experts=8, top_k=5, num_groups=4, topk_groups=2), "top_k"),
        (dict(num_experts=8, top_k=2, score_func="relu"), "score_func"),
        (dict(num_experts=0, top_k=1), "num_experts"),
        (dict(num_experts=8, top_k=2, route_scale=0.0), "route_scale"),
        (dict(num_experts=8, top_k=2, bias_update_rate=-1.0), "bias_update_rate"),
        (dict(num_experts=8, top_k=2, group_score="mean"), "group_score"),
    ],
)
def test_bad_router_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RouterConfig(**kwargs)
