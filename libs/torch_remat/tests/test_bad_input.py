"""Bad policies, units and budgets fail with a ValueError naming them, before any work."""

from __future__ import annotations

import pytest
import torch

import torch_remat as tr


@pytest.mark.parametrize(
    ("make", "names"),
    [
        (lambda: tr.Selective(save=("matmull",)), ["Selective.save", "'matmull'"]),
        (lambda: tr.Selective(recompute=("aten.not_an_op",)), ["Selective.recompute"]),
        (lambda: tr.Selective(save=("mm.nonexistent_overload",)), ["'mm.nonexistent_overload'"]),
        (lambda: tr.Selective(save=("mm",), recompute=("mm",)), ["both save and recompute"]),
        (lambda: tr.Selective(matmul_every=0), ["Selective.matmul_every"]),
        (lambda: tr.EveryNth(0), ["EveryNth.n"]),
        (lambda: tr.EveryNth(2, tr.Budget(0.5)), ["EveryNth.inner"]),
        (lambda: tr.Budget(0), ["Budget.limit"]),
        (lambda: tr.Budget(-5), ["Budget.limit"]),
        (lambda: tr.Budget(0.0), ["Budget.limit"]),
        (lambda: tr.Budget(1.5), ["Budget.limit"]),
    ],
)
def test_bad_policy_is_a_value_error_naming_it(make, names):
    with pytest.raises(ValueError) as err:
        make()
    for name in names:
        assert name in str(err.value)


def test_op_names_accept_groups_overloads_and_call_indices():
    s = tr.Selective(save=("matmul", "aten.addmm", "mm.default", "bmm#2", "pointwise"))
    assert s.save[3] == "bmm#2"


def test_units_that_match_nothing_are_named(make_stack):
    model, _ = make_stack()
    with pytest.raises(ValueError, match=r"'blocks\.\*' matches no submodule"):
        tr.apply(model, tr.Full(), units="blocks.*")
    with pytest.raises(ValueError, match=r"\['attn\.\*'\] match none of the units"):
        tr.apply(model, {"attn.*": tr.Full()})
    with pytest.raises(ValueError, match="units must not nest"):
        tr.apply(model, tr.Full(), units=["layers.0", "layers.0.qkv"])
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        tr.apply(torch.nn.Linear(2, 2), tr.Full())
    assert not any(hasattr(m, "_torch_remat_policy") for m in model.modules())


def test_budgets_out_of_range_are_named(make_stack):
    model, tokens = make_stack(layers=2)
    total = tr.plan(model, (tokens,), 1.0).total_bytes
    with pytest.raises(ValueError, match=r"Budget.limit: \d+ bytes is larger than the no-remat"):
        tr.plan(model, (tokens,), total + 1)
    with pytest.raises(ValueError, match=r"Budget.limit: \d+ bytes is below \d+"):
        tr.plan(model, (tokens,), 1)
    with pytest.raises(ValueError, match="Budget needs sample_inputs"):
        tr.apply(model, tr.Budget(0.5))
    with pytest.raises(ValueError, match="selects among units"):
        tr.checkpoint(torch.sin, torch.ones(2, requires_grad=True), policy=tr.Budget(0.5))


def test_apply_twice_is_refused_and_remove_restores_the_module(make_stack):
    model, tokens = make_stack(layers=2, dropout=0.0)
    want = model(tokens)
    tr.apply(model, tr.Full())
    with pytest.raises(ValueError, match="already has a remat policy"):
        tr.apply(model, tr.Selective())
    assert tr.remove(model) == ["layers.0", "layers.1"]
    assert "forward" not in vars(model.layers[0])
    assert torch.equal(model(tokens), want)
