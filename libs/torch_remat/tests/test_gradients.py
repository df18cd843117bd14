"""Every policy gives the gradients of the plain run, bit for bit in fp32, dropout included.

Bitwise is the right bar: recomputation runs the same kernels on the same inputs with the RNG
state restored, so any difference would be a bug, not rounding.
"""

from __future__ import annotations

import pytest
import torch

import torch_remat as tr

POLICIES = {
    "full": tr.Full(),
    "selective": tr.Selective(save=("matmul", "attention")),
    "every_other_matmul": tr.Selective(save=("matmul", "attention"), matmul_every=2),
    "save_mm_recompute_pointwise": tr.Selective(save=("mm",), recompute=("pointwise",)),
    "every_2nd_layer": tr.EveryNth(2, tr.Selective()),
    "offload": tr.Offload(),
    "per_unit_dict": {"layers.0": tr.Offload(), "layers.1": tr.Full(), "layers.2": tr.Full()},
    "per_unit_callable": lambda fqn: tr.Full() if fqn.endswith("3") else None,
}


def _grads(model, tokens, *, micro_steps: int = 1) -> list[torch.Tensor]:
    torch.manual_seed(1234)  # the dropout masks
    for _ in range(micro_steps):
        model(tokens).square().mean().backward()
    return [p.grad for p in model.parameters()]


def _assert_bitwise(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), (g - w).abs().max()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_gradients_equal_plain_run_with_dropout(make_stack, name):
    want = _grads(*make_stack())
    model, tokens = make_stack()
    applied = tr.apply(model, POLICIES[name])
    assert any(p is not None for p in applied.values())
    _assert_bitwise(_grads(model, tokens), want)


def test_gradient_accumulation_over_micro_steps_matches(make_stack):
    want = _grads(*make_stack(), micro_steps=3)
    model, tokens = make_stack()
    tr.apply(model, tr.Selective(matmul_every=2), units="layers.*")
    _assert_bitwise(_grads(model, tokens, micro_steps=3), want)


def test_budget_policy_gradients_equal_plain_run(make_stack):
    want = _grads(*make_stack())
    model, tokens = make_stack()
    applied = tr.apply(model, tr.Budget(0.5), sample_inputs=(tokens,))
    assert all(isinstance(p, (tr.Full, tr.Selective)) for p in applied.values())
    _assert_bitwise(_grads(model, tokens), want)


def test_checkpoint_function_matches_plain_call():
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)

    def fn(x, *, scale):
        return torch.nn.functional.dropout(torch.tanh(x @ w) * scale, 0.5) @ w

    for policy in (tr.Full(), tr.Selective(save=("mm#0",)), tr.Offload()):
        grads = []
        for remat in (False, True):
            torch.manual_seed(7)
            y = tr.checkpoint(fn, x, scale=2.0, policy=policy) if remat else fn(x, scale=2.0)
            grads.append(torch.autograd.grad(y.sum(), (x, w)))
        _assert_bitwise(grads[1], grads[0])


@pytest.mark.parametrize("policy", [tr.Full(), tr.Selective(save=("mm",)), tr.Offload()])
def test_region_inside_a_forward_matches_plain_run(make_stack, policy):
    """A span of code (the MLP half of every block) under ``with region(policy)``."""
    want = _grads(*make_stack())
    model, tokens = make_stack()
    for block in model.layers:
        block.mlp_region = policy
    _assert_bitwise(_grads(model, tokens), want)
