"""``torch_checkpointing.integrations.hf.CheckpointCallback`` with a transformers ``Trainer``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from torch_checkpointing import CheckpointError, CheckpointManager

RUN = Path(__file__).resolve().parent / "_hf_train_run.py"
DDP_RUN = Path(__file__).resolve().parent / "_hf_ddp_run.py"


def _steps(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_trainer_killed_after_step_5_resumes_bitwise_like_an_uninterrupted_run(tmp_path):
    # Guards the reported gap: no callback saved the RNG and the data position, so a resumed
    # run trained on other batches with other noise. Here every step's loss, grad norm, LR and
    # RNG digest (NEFTune noise makes the loss depend on the CPU RNG) and the final weights
    # must equal an uninterrupted run's, bit for bit; the Trainer's batch skipping brings the
    # data loader back to mid-epoch (step 5 of 6) and on across the epoch boundary.
    ref, killed, resumed, root = (tmp_path / n for n in ("ref", "killed", "resumed", "ckpt"))
    plain = subprocess.Popen([sys.executable, str(RUN), str(ref)], stderr=subprocess.PIPE)
    first = subprocess.Popen(
        [sys.executable, str(RUN), str(killed), "--checkpoints", str(root), "--kill-at", "5"],
        stderr=subprocess.PIPE,
        text=True,
    )
    _, first_err = first.communicate(timeout=600)
    assert first.returncode == -9, first_err  # SIGKILLed once step 5's checkpoint committed
    assert "Traceback" not in first_err, first_err  # nor did its orphaned writer complain
    assert CheckpointManager(root, read_only=True).steps() == [5]
    second = subprocess.run(
        [sys.executable, str(RUN), str(resumed), "--checkpoints", str(root)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert second.returncode == 0, second.stderr
    _, plain_err = plain.communicate(timeout=600)
    assert plain.returncode == 0, plain_err

    want = _steps(ref)
    assert [s["step"] for s in want] == list(range(1, 11))
    assert [s["step"] for s in _steps(killed)] == [1, 2, 3, 4, 5]
    assert [s["step"] for s in _steps(resumed)] == [6, 7, 8, 9, 10]  # resumed, not restarted
    assert _steps(killed) + _steps(resumed) == want  # floats compared exactly
    final, reference = (
        load_file(resumed / "final.safetensors"),
        load_file(ref / "final.safetensors"),
    )
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[k], reference[k]) for k in reference)
    # Our checkpoints replaced the Trainer's own (it wrote checkpoint-5/-10 in the plain run).
    assert sorted(p.name for p in (ref / "trainer").iterdir()) == ["checkpoint-10", "checkpoint-5"]
    assert not list((killed / "trainer").iterdir()) and not list((resumed / "trainer").iterdir())
    assert CheckpointManager(root, read_only=True).steps() == [5, 10]


@pytest.mark.slow
@pytest.mark.extended  # the one-process kill and resume runs in CI
def test_ddp_ranks_save_their_own_state_and_resume_bitwise(tmp_path):
    # Two gloo ranks under torchrun: each saves its own RNG (NEFTune noise differs per rank)
    # and its share of the replicated weights; a run stopped after step 3 and resumed logs
    # the uninterrupted run's steps 4-6 and ends with its weights, on both ranks.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    out = subprocess.run(
        [*launch, str(DDP_RUN), str(tmp_path)], capture_output=True, text=True, timeout=900, env=env
    )
    assert out.returncode == 0, out.stderr[-4000:]
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [row[0] for row in r["first"]] == [1, 2, 3]
        assert [row[0] for row in r["second"]] == [4, 5, 6]
        assert r["first"] + r["second"] == r["ref"] and r["weights_equal"], r
    (step3,) = (tmp_path / "ckpt").glob("step-000000000003.*")
    names = {p.name for p in step3.iterdir()}
    assert {"rng-00000.safetensors", "rng-00001.safetensors", "done-00001.json"} <= names


def test_importing_the_integration_does_not_import_transformers():
    code = (
        "import sys, torch_checkpointing.integrations.hf; "
        "assert 'transformers' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def _trainer(tmp_path, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    fields = {"save_strategy": "steps", "save_steps": 5, **overrides}
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"), report_to="none", use_cpu=True, **fields
    )
    ids = torch.arange(8).view(2, 4)
    data = [{"input_ids": row, "labels": row} for row in ids]
    return Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=data)


def test_bad_settings_are_refused_before_any_checkpoint(tmp_path):
    from torch_checkpointing.integrations.hf import CheckpointCallback

    with pytest.raises(ValueError, match=r"save_steps must be None .* or an int >= 1, got 0"):
        CheckpointCallback(tmp_path, save_steps=0)
    with pytest.raises(ValueError, match=r"pass root=\.\.\. \(a folder\) or storage="):
        CheckpointCallback(None)
    with pytest.raises(TypeError, match="keep_lats"):
        CheckpointCallback(tmp_path, keep_lats=2)
    with pytest.raises(ValueError, match="keep_last must be None or an int >= 1"):
        CheckpointCallback(tmp_path, keep_last=0)
    cb = CheckpointCallback(tmp_path / "a")
    with pytest.raises(TypeError, match="trainer must be a transformers Trainer"):
        cb.resume(object())
    with pytest.raises(ValueError, match=r"args.save_strategy is 'no'; allowed: 'steps', 'epoch'"):
        cb.resume(_trainer(tmp_path, save_strategy="no"))
    assert not (tmp_path / "a").exists()  # nothing opened, no folder made
    trainer = _trainer(tmp_path)
    trainer.add_callback(cb)
    with pytest.raises(CheckpointError, match=r"call trainer.train\(resume_from_checkpoint="):
        trainer.train()  # resume() never called: refused at on_train_begin, before a step
