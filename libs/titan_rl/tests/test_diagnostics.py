"""Diagnostics by hand."""

from __future__ import annotations

import math

import pytest
import torch

from titan_rl import logprob_diagnostics, reward_diagnostics


def test_identical_logprobs_give_zero_gap_and_full_ess():
    lp = torch.randn(3, 4)
    d = logprob_diagnostics(lp, lp, torch.ones(3, 4, dtype=torch.bool))
    assert d == {"kl_generator_trainer": 0.0, "max_abs_logprob_diff": 0.0, "ess": 1.0}


def test_logprob_gap_by_hand():
    trainer = torch.tensor([[math.log(2.0), 0.0, 5.0]])
    rollout = torch.zeros(1, 3)
    mask = torch.tensor([[True, True, False]])
    d = logprob_diagnostics(trainer, rollout, mask)
    # w = [2, 1]: k3 = [2 - 1 - log 2, 0]; ESS = 9 / (2 * 5)
    assert d["kl_generator_trainer"] == pytest.approx((1 - math.log(2.0)) / 2)
    assert d["max_abs_logprob_diff"] == pytest.approx(math.log(2.0))
    assert d["ess"] == pytest.approx(0.9)


def test_reward_and_length_statistics():
    d = reward_diagnostics(torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([2, 4, 6, 8]))
    assert d["reward_mean"] == 0.5 and d["reward_std"] == 0.5
    assert (d["length_min"], d["length_mean"], d["length_max"]) == (2.0, 5.0, 8.0)
