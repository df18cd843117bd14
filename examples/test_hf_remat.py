"""examples/hf_remat.py: torch_remat on a transformers Llama, against no remat."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def hf_remat(example):
    pytest.importorskip("transformers")
    return example("hf_remat")


def test_the_loop_measures_plans_and_trains_an_hf_llama(hf_remat):
    with pytest.warns(UserWarning, match="key/value cache"):  # HF's use_cache=True default
        r = hf_remat.train(steps=4)
    saved = r["saved_bytes"]
    assert saved["every other matmul"] < saved["none"]
    # the planned policies keep what the plan predicted, within the budget of half
    assert r["planned_measured"] == r["planned_bytes"] <= r["budget_bytes"] == saved["none"] // 2
    assert r["losses"][-1] < r["losses"][0]


def test_every_policy_gives_the_no_remat_loss_and_gradients_bitwise(hf_remat):
    with pytest.warns(UserWarning, match="key/value cache"):  # said again per test by pytest
        report = hf_remat.compare()
    none = report.pop("none")["saved_bytes"]
    assert len(report) == 4
    for name, r in report.items():
        assert r["loss_diff"] == 0 and r["max_grad_diff"] == 0, (name, r)
        assert r["saved_bytes"] < none, name
    assert report["Full"]["saved_bytes"] == min(r["saved_bytes"] for r in report.values())
