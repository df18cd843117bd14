"""examples/trl_grpo_titan_logprobs.py: TRL's GRPOTrainer with titan_rl's rollouts and
log-probs, bitwise equal on every token."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def single_thread():
    """One intra-op thread, restored afterwards: the tiny model gains nothing from two, and
    two-thread barriers on a shared machine are slow."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("single_thread")
def test_rollout_old_and_new_logprobs_are_bitwise_equal_inside_trl(example, tmp_path):
    pytest.importorskip("trl")
    module = example("trl_grpo_titan_logprobs")
    trainer = module.train(steps=4, output_dir=str(tmp_path))
    module.check(trainer)  # rollout == old and same-weights new == old: max |diff| exactly 0.0
    by_check: dict[str, list[dict]] = {}
    for record in trainer.parity:
        by_check.setdefault(record["check"], []).append(record)
    # 4 optimizer steps = 2 generation batches of 2 steps: every batch and step was checked.
    assert {k: len(v) for k, v in by_check.items()} == {
        "rollout_vs_old": 2,
        "new_vs_old_same_weights": 2,
        "new_vs_old_after_a_step": 2,
    }
    assert all(r["tokens"] > 0 for r in trainer.parity)
    # The comparisons can fail: after an optimizer step the log-probs move, and TRL's own
    # forward is not the sampler's bits (the gap titan's path closes).
    assert all(r["max_abs_diff"] > 0 for r in by_check["new_vs_old_after_a_step"])
    assert all(r["trl_forward_vs_rollout"] > 0 for r in by_check["rollout_vs_old"])
    # TRL trained: the loss is logged and the policy's weights moved (after-step diffs above).
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2, 3, 4]
