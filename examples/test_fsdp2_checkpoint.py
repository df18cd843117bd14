"""examples/fsdp2_checkpoint.py: FSDP2 state saved on 2 ranks loads bitwise on 3 and on 1."""

from __future__ import annotations

import pytest
import torch

from titan_testing import run_distributed


@pytest.mark.slow
def test_fsdp2_state_saved_on_2_ranks_loads_bitwise_on_3_ranks_and_1_process(example, tmp_path):
    fsdp2 = example("fsdp2_checkpoint")
    root = str(tmp_path / "checkpoints")
    saved = run_distributed(fsdp2.train_or_resume, 2, root, timeout=300)  # trains, saves
    assert (tmp_path / "checkpoints").is_dir() and saved[0].keys() == {"model", "optim"}
    resumed = run_distributed(fsdp2.train_or_resume, 3, root, timeout=300)  # resumes
    for r in (*saved[1:], *resumed):
        fsdp2.assert_equal(saved[0], r)  # every rank gathers the same full state
    fsdp2.assert_equal(saved[0], fsdp2.load_one_process(root))
    # It trained: AdamW state of every parameter, weights moved from their initial values.
    assert [s["step"].item() for s in saved[0]["optim"]["state"].values()] == [fsdp2.STEPS] * 6
    initial = fsdp2.build().state_dict()
    assert all(not torch.equal(w, initial[n]) for n, w in saved[0]["model"].items()), "untrained"
