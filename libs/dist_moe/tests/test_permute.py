"""Permutation: exact inverse, aligned groups, dropless (dynamic, static) and capacity modes."""

import pytest
import torch

from dist_moe import PermuteConfig, permute, plan_permutation, unpermute, unpermute_and_combine

MODES = [
    PermuteConfig(alignment=1),
    PermuteConfig(alignment=4),
    PermuteConfig(alignment=8, static_shapes=True),
    PermuteConfig(alignment=4, capacity_factor=100.0),  # capacity mode that drops nothing
]


def _indices(t, k, e, *, skip_experts=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([i for i in range(e) if i not in skip_experts])
    # k distinct experts per token, drawn from the allowed ones (some experts get zero tokens)
    keys = torch.rand(t, len(allowed), generator=g)
    return allowed[keys.argsort(-1)[:, :k]]


@pytest.mark.parametrize("config", MODES, ids=str)
def test_permute_then_unpermute_is_the_identity(config):
    idx = _indices(29, 3, 8, skip_experts=(2, 5))
    x = torch.randn(29, 12)
    plan = plan_permutation(idx, 8, config)
    rows = permute(x, plan)
    assert rows.shape == (plan.num_rows, 12)
    assert torch.equal(unpermute(rows, plan), x[:, None].expand(29, 3, 12))
    # combine with weights 1 sums the K copies
    torch.testing.assert_close(unpermute_and_combine(rows, plan), 3 * x)


@pytest.mark.parametrize("config", MODES, ids=str)
def test_groups_are_aligned_and_hold_their_experts_tokens_in_token_order(config):
    e, k = 8, 2
    idx = _indices(41, k, e, skip_experts=(0, 7), seed=1)
    plan = plan_permutation(idx, e, config)
    ends = plan.group_ends.tolist()
    starts = [0, *ends[:-1]]
    assert ends[-1] <= plan.num_rows
    flat = idx.reshape(-1).tolist()
    for ex in range(e):
        size = ends[ex] - starts[ex]
        assert size % config.alignment == 0
        group = plan.row_assignment[starts[ex] : ends[ex]].tolist()
        want = [a for a in range(len(flat)) if flat[a] == ex]
        assert group[: len(want)] == want  # token order
        assert all(a == -1 for a in group[len(want) :])  # then zero padding
    assert plan.counts.tolist() == [flat.count(ex) for ex in range(e)]
    assert all(a == -1 for a in plan.row_assignment[ends[-1] :].tolist())  # slack rows
    rows = permute(torch.randn(41, 4), plan)
    assert torch.all(rows[plan.row_assignment < 0] == 0)


def test_static_shapes_size_the_buffer_from_shapes_alone():
    idx = _indices(50, 2, 8)
    dyn = plan_permutation(idx, 8, PermuteConfig(alignment=8))
    sta = plan_permutation(idx, 8, PermuteConfig(alignment=8, static_shapes=True))
    assert sta.num_rows == 100 + 8 * 7 + 4  # N + E * (A - 1), rounded up to A
    assert torch.equal(dyn.group_ends, sta.group_ends)
    assert torch.equal(dyn.slot, sta.slot)
    assert dyn.num_rows == int(dyn.group_ends[-1])


def test_capacity_mode_drops_overflow_in_token_order():
    # 6 tokens, top-1, all to expert 0 except token 4 -> expert 1; capacity = ceil(1.0*6/2)=3
    idx = torch.tensor([[0], [0], [0], [0], [1], [0]])
    plan = plan_permutation(idx, 2, PermuteConfig(alignment=1, capacity_factor=1.0))
    assert plan.num_rows == 6
    assert plan.group_ends.tolist() == [3, 6]
    assert plan.slot.tolist() == [0, 1, 2, -1, 3, -1]
    assert plan.counts.tolist() == [5, 1]
    x = torch.arange(6.0)[:, None].expand(6, 3).contiguous()
    back = unpermute(permute(x, plan), plan)[:, 0]
    assert torch.equal(back[:, 0], torch.tensor([0.0, 1, 2, 0, 4, 0]))
    # capacity is rounded up to the alignment
    plan8 = plan_permutation(idx, 2, PermuteConfig(alignment=8, capacity_factor=1.0))
    assert plan8.group_ends.tolist() == [8, 16]


def test_permute_and_combine_gradients_match_autograd_of_dense_ops():
    torch.manual_seed(0)
    idx = _indices(9, 2, 4, skip_experts=(1,))
    plan = plan_permutation(idx, 4, PermuteConfig(alignment=4, capacity_factor=0.75))
    assert (plan.slot < 0).any()  # some drops are exercised
    x = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    w = torch.rand(9, 2, dtype=torch.float64, requires_grad=True)
    y = torch.randn(plan.num_rows, 5, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x: permute(x, plan), (x,))
    torch.autograd.gradcheck(lambda y, w: unpermute_and_combine(y, plan, w), (y, w))


def test_negative_indices_are_not_routed():
    idx = torch.tensor([[2, -1], [-1, -1], [0, 2], [-1, 0]])
    for cfg in (PermuteConfig(alignment=2), PermuteConfig(alignment=1, capacity_factor=2.0)):
        plan = plan_permutation(idx, 3, cfg)
        assert plan.counts.tolist() == [2, 0, 2]
        assert (plan.slot[idx.reshape(-1) < 0] == -1).all()
        x = torch.randn(4, 3)
        back = unpermute(permute(x, plan), plan)
        want = torch.where((idx >= 0)[..., None], x[:, None].expand(4, 2, 3), 0.0)
        assert torch.equal(back, want)
    assert plan_permutation(idx, 3, PermuteConfig(alignment=2)).num_rows == 4


def test_plan_rejects_indices_that_are_not_2d():
    with pytest.raises(ValueError, match="indices_TK"):
        plan_permutation(torch.zeros(5, dtype=torch.long), 4, PermuteConfig())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(alignment=0), "alignment"),
        (dict(alignment=2.0), "alignment"),
        (dict(capacity_factor=0.0), "capacity_factor"),
        (dict(kernels="cuda"), "kernels"),
    ],
)
def test_bad_permute_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PermuteConfig(**kwargs)
