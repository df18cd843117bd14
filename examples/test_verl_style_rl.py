"""examples/verl_style_rl.py: a veRL-style RL step on an HF actor with titan_rl's pieces."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def verl_style_rl(example):
    pytest.importorskip("transformers")
    return example("verl_style_rl")


@pytest.fixture
def single_thread():
    """One intra-op thread, restored afterwards: this tiny actor gains nothing from two, and on
    a shared machine two-thread barriers made the test ~40x slower (150 s vs 4 s of wall)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("single_thread")
def test_rollout_and_actor_logprobs_are_bitwise_equal_and_the_reward_rises(verl_style_rl):
    history = verl_style_rl.train(steps=6)
    # batch-invariant rollout and recompute: the same bits, so TIS weights are exactly 1
    assert [m["max_abs_logprob_diff"] for m in history] == [0.0] * 6
    assert all(m["tis_weight_min"] == m["tis_weight_max"] == 1.0 for m in history)
    # the engine sampled every step with the weights the actor pushed after the step before
    assert [m["rollout_version"] for m in history] == list(range(6))
    first, last = history[0]["reward"], (history[-1]["reward"] + history[-2]["reward"]) / 2
    assert last > first + 0.1, (first, last)  # seeded: 0.031 -> ~0.22 here
