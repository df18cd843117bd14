"""examples/hf_llama_flexshard.py: a transformers Llama sharded by flexshard on 2 ranks,
checkpointed and resumed with torch_checkpointing, equals one process bit for bit."""

from __future__ import annotations

import pytest
import torch

from titan_testing import run_distributed


@pytest.mark.slow
def test_sharded_hf_llama_resumed_from_its_checkpoint_equals_one_process(example, tmp_path):
    llama = example("hf_llama_flexshard")
    root = str(tmp_path / "ckpt")
    got = run_distributed(llama.train_and_resume, 2, root, num_threads=1, timeout=600)
    assert (tmp_path / "ckpt").is_dir()  # the resume really read a checkpoint
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' kernels
    try:
        want = llama.one_process()
    finally:
        torch.set_num_threads(threads)
    for rank in got:
        llama.check(rank, want)  # bitwise weights, losses to 1e-6, loss fell
    initial = llama.build().state_dict()
    assert all(not torch.equal(w, initial[n]) for n, w in got[0]["model"].items()), "untrained"
