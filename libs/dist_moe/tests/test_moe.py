"""MoE layer and experts: grouped GEMM vs per-expert loop vs a per-token reference; bad input."""

import copy

import pytest
import torch

from dist_moe import GroupedExperts, MoEConfig, PermuteConfig, RouterConfig, SharedExperts
from titan_testing import requires_gpus

CONFIGS = {
    "softmax_top2_shared": dict(shared=12),
    "softmax_norm_alignment1": dict(norm_topk_prob=True, permute=PermuteConfig(alignment=1)),
    "sigmoid_grouped_deepseek": dict(
        num_experts=16,
        top_k=4,
        score_func="sigmoid",
        num_groups=4,
        topk_groups=2,
        norm_topk_prob=True,
        route_scale=2.5,
        shared=8,
    ),
    "static_shapes": dict(permute=PermuteConfig(alignment=8, static_shapes=True)),
    "capacity_with_drops": dict(permute=PermuteConfig(alignment=4, capacity_factor=0.5)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_grouped_gemm_forward_and_backward_equal_the_per_expert_loop(name, make_moe, grads):
    moe = make_moe(**CONFIGS[name])
    loop = copy.deepcopy(moe)
    loop.experts.impl = "loop"
    x = torch.randn(3, 11, 16)
    assert moe.experts.uses_grouped_mm(x)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn_like(x)
    y1, y2 = moe(x1), loop(x2)
    torch.testing.assert_close(y1, y2, rtol=0, atol=1e-5)
    (y1 * g).sum().backward()
    (y2 * g).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=1e-5)
    g1, g2 = grads(moe), grads(loop)
    assert g1.keys() == g2.keys() and "experts.w_gate" in g1 and "router.gate.weight" in g1
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=0, atol=1e-5, msg=n)


@pytest.mark.parametrize(
    "name", ["softmax_top2_shared", "sigmoid_grouped_deepseek", "static_shapes"]
)
def test_moe_equals_a_token_by_token_reference(name, make_moe, reference_forward, grads):
    moe = make_moe(**CONFIGS[name])
    x = torch.randn(2, 7, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    ref_moe = copy.deepcopy(moe)
    y, y_ref = moe(x), reference_forward(ref_moe, xr)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-5)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=1e-5)
    for n, gr in grads(ref_moe).items():
        torch.testing.assert_close(grads(moe)[n], gr, rtol=0, atol=1e-5, msg=n)


def test_capacity_mode_drops_only_overflowing_assignments(make_moe):
    moe = make_moe(permute=PermuteConfig(alignment=1, capacity_factor=1.0), force_balance=True)
    x = torch.randn(32, 16)
    # perfectly balanced routing fits exactly: nothing is dropped, same as dropless
    dropless = copy.deepcopy(moe)
    dropless.dispatcher.config = PermuteConfig(alignment=1)
    torch.testing.assert_close(moe(x), dropless(x), rtol=0, atol=1e-6)


def test_zero_tokens_and_empty_experts(make_moe, reference_forward):
    moe = make_moe()
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.tensor([0.0, 0, 0, 0, 0, 0, 50.0, 50.0]))
    x = torch.randn(5, 16, requires_grad=True)
    y = moe(x)  # every token goes to experts 6 and 7 only
    torch.testing.assert_close(y, reference_forward(moe, x), rtol=0, atol=1e-5)
    y.sum().backward()
    assert torch.all(moe.experts.w_gate.grad[:6] == 0)
    empty = moe(torch.randn(0, 16))
    assert empty.shape == (0, 16)


def test_bf16_grouped_gemm_runs_and_is_close_to_fp32(make_moe):
    moe = make_moe(shared=8)
    x = torch.randn(4, 16)
    y32 = moe(x)
    y16 = copy.deepcopy(moe).to(torch.bfloat16)(x.bfloat16())
    torch.testing.assert_close(y16.float(), y32, rtol=0.05, atol=0.05)


class _HostSync(RuntimeError):
    pass


@pytest.mark.parametrize(
    "permute",
    [
        PermuteConfig(alignment=8, static_shapes=True),
        PermuteConfig(alignment=8, capacity_factor=1.25),
    ],
    ids=["static_shapes", "capacity"],
)
def test_static_layouts_never_read_a_device_value_back_to_the_host(permute, make_moe, monkeypatch):
    # CPU proxy for "no host sync on the GPU path": every Python-level read-back raises.
    moe = make_moe(shared=8, permute=permute, score_func="sigmoid", num_groups=4, topk_groups=2)
    moe.train()
    x = torch.randn(2, 9, 16, requires_grad=True)

    def refuse(*args, **kwargs):
        raise _HostSync("host read-back")

    for name in ("item", "tolist", "__int__", "__bool__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    y = moe(x)
    (y * y).sum().backward()
    monkeypatch.undo()
    assert x.grad is not None and moe.experts.w_gate.grad is not None
    with pytest.raises(_HostSync):  # the check bites: the dynamic layout does read back
        monkeypatch.setattr(torch.Tensor, "__int__", refuse)
        moe.dispatcher.config = PermuteConfig(alignment=8)
        moe(x)


@pytest.mark.gpu
@requires_gpus(1)
@pytest.mark.parametrize("static", [True, False], ids=["static_shapes", "capacity"])
def test_static_layouts_do_not_synchronise_on_cuda(static, make_moe):
    permute = (
        PermuteConfig(alignment=8, static_shapes=True)
        if static
        else PermuteConfig(alignment=8, capacity_factor=1.25)
    )
    moe = make_moe(dim=64, hidden_dim=32, shared=32, permute=permute).cuda().bfloat16()
    x = torch.randn(4, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe(x).float().square().sum().backward()  # warm-up (lazy init may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe(x).float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_grouped_experts_fall_back_to_the_loop_for_unaligned_dims():
    ex = GroupedExperts(dim=6, hidden_dim=5, num_experts=2)
    x = torch.randn(4, 6)
    assert not ex.uses_grouped_mm(x)
    out = ex(x, torch.tensor([1, 4], dtype=torch.int32))
    torch.testing.assert_close(out[1:], ex.forward_loop(x, torch.tensor([1, 4]))[1:])
    ex.impl = "grouped_mm"
    with pytest.raises(RuntimeError, match="grouped GEMM unavailable"):
        ex(x, torch.tensor([1, 4], dtype=torch.int32))


def test_shared_experts_with_gate():
    torch.manual_seed(0)
    se = SharedExperts(8, 4, gate=True)
    x = torch.randn(3, 8)
    plain = se.w_down(torch.nn.functional.silu(se.w_gate(x)) * se.w_up(x))
    torch.testing.assert_close(se(x), torch.sigmoid(se.gate(x)) * plain)


@pytest.mark.parametrize(
    ("x", "match"),
    [
        (torch.randn(16), "shape"),
        (torch.randn(1, 2, 3, 16), "shape"),
        (torch.randn(4, 15), "shape"),
        (torch.ones(4, 16, dtype=torch.int64), "dtype"),
        (torch.randn(4, 16, dtype=torch.float64), "dtype"),
    ],
)
def test_bad_input_raises_value_error_naming_x(x, match, make_moe):
    moe = make_moe()
    with pytest.raises(ValueError, match=rf"x.*{match}|{match}.*x"):
        moe(x)


def test_bad_moe_config_names_the_field():
    rc = RouterConfig(num_experts=4, top_k=2)
    with pytest.raises(ValueError, match="hidden_dim"):
        MoEConfig(dim=8, hidden_dim=0, router=rc)
    with pytest.raises(ValueError, match="experts_impl"):
        MoEConfig(dim=8, hidden_dim=8, router=rc, experts_impl="cutlass")
    with pytest.raises(ValueError, match="shared_hidden_dim"):
        MoEConfig(dim=8, hidden_dim=8, router=rc, shared_hidden_dim=-1)
