"""Saved-activation bytes as ``measure`` counts them, per policy, and the planner's budgets."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch_remat as tr

MiB = 2.0**20


def test_measure_counts_exactly_the_tensors_autograd_keeps():
    # Linear saves its input (excluded: a step input) and weight (excluded: a parameter);
    # ReLU saves its output: 4 x 16 fp32 = 256 bytes, and that is all.
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU())
    m = tr.measure(model, (torch.randn(4, 8),), steps=1, warmup=0)
    assert m.saved_bytes == 4 * 16 * 4
    assert m.offloaded_bytes == 0
    assert m.peak_bytes >= m.saved_bytes
    assert m.step_time_s > 0


def test_saved_bytes_none_gt_selective_gt_full_and_offload_leaves_nothing(make_stack):
    everything = ["embed", "layers.*", "norm", "head"]
    results = {}
    for name, policy, units in [
        ("none", None, None),
        ("selective", tr.Selective(), None),
        ("every_other_mm", tr.Selective(matmul_every=2), None),
        ("full", tr.Full(), None),
        ("offload", tr.Offload(), everything),
    ]:
        model, tokens = make_stack(layers=4, dim=64, seq=32)
        if policy is not None:
            tr.apply(model, policy, units)
        results[name] = tr.measure(model, (tokens,), steps=1, warmup=0)
    for name, m in results.items():
        print(
            f"{name:>15}: saved {m.saved_bytes / MiB:7.3f} MiB, offloaded "
            f"{m.offloaded_bytes / MiB:7.3f} MiB, peak {m.peak_bytes / MiB:7.3f} MiB"
        )
    saved = {k: m.saved_bytes for k, m in results.items()}
    assert saved["none"] > saved["selective"] > saved["every_other_mm"] > saved["full"] > 0
    assert saved["offload"] == 0
    # Offload keeps what no-remat keeps, one copy per storage, only elsewhere; plus the token
    # ids the embedding saves, which measure() does not count in place (they are the input).
    assert results["offload"].offloaded_bytes == saved["none"] + tokens.nbytes
    assert results["full"].peak_bytes < results["none"].peak_bytes


def _region_saved_bytes(make_stack, policy: tr.Policy | None) -> int:
    model, tokens = make_stack(layers=2, dim=64, seq=32)
    for block in model.layers:
        block.mlp_region = policy
    return tr.measure(model, (tokens,), steps=1, warmup=0).saved_bytes


def test_region_keeps_less_than_the_plain_span_and_selective_adds_its_ops(make_stack):
    plain = _region_saved_bytes(make_stack, None)
    full = _region_saved_bytes(make_stack, tr.Full())
    mm = _region_saved_bytes(make_stack, tr.Selective(save=("mm",)))
    print(f"region: plain {plain}, Full {full}, Selective(mm) {mm} bytes")
    assert full < mm < plain
    # Selective adds the MLP's matmul outputs: per token 2*64 (gate) + 2*64 (up) + 64 (down)
    # floats, for 2 layers x 2 x 32 tokens.
    assert mm - full == 2 * 2 * 32 * (128 + 128 + 64) * 4


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_budget_lands_within_ten_percent_below_the_budget(make_stack, fraction):
    model, tokens = make_stack(layers=4, dim=64, seq=32)
    total = tr.measure(model, (tokens,), steps=1, warmup=0).saved_bytes
    plan = tr.plan(model, (tokens,), fraction)
    assert plan.total_bytes == total
    tr.apply(model, plan.policies)
    got = tr.measure(model, (tokens,), steps=1, warmup=0).saved_bytes
    budget = fraction * total
    print(
        f"budget {fraction:.0%}: {got} of {budget:.0f} bytes ({got / budget:.3f}), plan said {plan.planned_bytes}"
    )
    assert 0.9 * budget <= got <= budget
    assert got == plan.planned_bytes
    assert plan.recompute_seconds < plan.full_recompute_seconds


def test_budget_in_bytes_through_apply(make_stack):
    model, tokens = make_stack()
    total = tr.measure(model, (tokens,), steps=1, warmup=0).saved_bytes
    tr.apply(model, tr.Budget(total // 3), sample_inputs=(tokens,))
    got = tr.measure(model, (tokens,), steps=1, warmup=0).saved_bytes
    assert 0.9 * (total // 3) <= got <= total // 3


def test_plan_table_lists_each_op_call_with_its_decision(make_stack):
    model, tokens = make_stack(layers=2)
    plan = tr.plan(model, (tokens,), tr.Budget(0.5), units="layers.*")
    text = str(plan)
    print(plan.table(max_rows=12))
    assert "decision" in text.splitlines()[1]
    assert {r.unit for r in plan.rows} == {"layers.0", "layers.1"}
    assert any(r.save for r in plan.rows) and any(not r.save for r in plan.rows)
    assert any(r.op.startswith("mm#") for r in plan.rows)
    saved = {r.op for r in plan.rows if r.unit == "layers.0" and r.save}
    assert set(plan.policies["layers.0"].save) == saved


def test_full_budget_leaves_the_model_alone(make_stack):
    model, tokens = make_stack(layers=2)
    plan = tr.plan(model, (tokens,), 1.0)
    assert set(plan.policies.values()) == {None}
