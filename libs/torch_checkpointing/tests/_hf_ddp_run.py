"""Two-rank DDP (gloo) run of a transformers ``Trainer`` with ``CheckpointCallback``.

``python -m torch.distributed.run --nproc-per-node 2 _hf_ddp_run.py OUT``: an uninterrupted
6-step run, then a run stopped after step 3 and one resumed from its checkpoint; each rank
writes ``OUT/rank<r>.json`` with both runs' logged steps and whether the final weights match.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from torch_checkpointing.integrations.hf import CheckpointCallback


class StopAfter3(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            control.should_training_stop = True


class Record(TrainerCallback):
    def __init__(self) -> None:
        self.rows: list[list[float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.rows.append([state.global_step, logs["loss"], logs["grad_norm"]])


def run(out: str, root: str, stop: bool) -> tuple[list, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    ids = torch.randint(0, 64, (32, 8), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(
        output_dir=os.path.join(out, "trainer"),
        max_steps=6,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=5e-3,
        neftune_noise_alpha=5.0,  # the losses depend on each rank's CPU RNG
        logging_steps=1,
        save_strategy="steps",
        save_steps=3,
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo",
        seed=0,
        disable_tqdm=True,
    )
    record = Record()
    ckpt = CheckpointCallback(root)
    callbacks = [ckpt, record, *([StopAfter3()] if stop else [])]
    data = [{"input_ids": row, "labels": row} for row in ids]
    model = LlamaForCausalLM(config)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=ckpt.resume(trainer))
    assert ckpt.manager is not None and ckpt.manager.world_size == 2
    ckpt.close()
    return record.rows, {k: v.clone() for k, v in model.state_dict().items()}


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    ref, ref_weights = run(out, os.path.join(out, "plain"), stop=False)
    first, _ = run(out, os.path.join(out, "ckpt"), stop=True)
    second, weights = run(out, os.path.join(out, "ckpt"), stop=False)
    result = {
        "ref": ref,
        "first": first,
        "second": second,
        "weights_equal": all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights),
    }
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
