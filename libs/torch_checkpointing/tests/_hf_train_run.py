"""One HF ``Trainer`` run of a tiny random Llama, for ``test_hf_trainer.py``.

``python _hf_train_run.py OUT [--checkpoints ROOT] [--kill-at STEP]``: trains 10 steps and
appends one JSON line per step to ``OUT/steps.jsonl`` (loss, grad norm, learning rate, and a
digest of every RNG as the step begins); the final weights go to ``OUT/final.safetensors``.
``--checkpoints`` adds ``CheckpointCallback`` (resuming from ROOT when it holds a checkpoint);
``--kill-at`` SIGKILLs the process once that step's checkpoint is committed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from torch_checkpointing.integrations.hf import CheckpointCallback


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (24, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def rng_digest() -> str:
    """Every generator's state, hashed (read, never drawn from)."""
    h = hashlib.sha256()
    h.update(torch.get_rng_state().numpy().tobytes())
    h.update(repr(random.getstate()).encode())
    h.update(np.random.get_state()[1].tobytes())
    return h.hexdigest()[:16]


class Record(TrainerCallback):
    def __init__(self, path: str) -> None:
        self.path = path
        self.rng: dict[int, str] = {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.rng[state.global_step + 1] = rng_digest()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            row = {
                "step": state.global_step,
                "loss": logs["loss"],
                "grad_norm": logs["grad_norm"],
                "lr": logs["learning_rate"],
                "rng": self.rng[state.global_step],
            }
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


class KillAfterCommit(TrainerCallback):
    def __init__(self, ckpt: CheckpointCallback, step: int) -> None:
        self.ckpt, self.step = ckpt, step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.ckpt.wait()  # this step's checkpoint is committed
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--checkpoints")
    parser.add_argument("--kill-at", type=int)
    a = parser.parse_args()
    torch.set_num_threads(1)  # the same kernels in every run
    os.makedirs(a.out, exist_ok=True)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    args = TrainingArguments(
        output_dir=os.path.join(a.out, "trainer"),
        max_steps=10,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,  # 6 steps an epoch: step 5 is mid-epoch
        learning_rate=5e-3,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        weight_decay=0.1,
        neftune_noise_alpha=5.0,  # noise on the embeddings: the losses depend on the CPU RNG
        logging_steps=1,
        save_strategy="steps",
        save_steps=5,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    callbacks: list[TrainerCallback] = [Record(os.path.join(a.out, "steps.jsonl"))]
    ckpt = None
    if a.checkpoints:
        ckpt = CheckpointCallback(a.checkpoints, keep_last=2)
        callbacks.insert(0, ckpt)
        if a.kill_at:
            callbacks.append(KillAfterCommit(ckpt, a.kill_at))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    resume = ckpt.resume(trainer) if ckpt is not None else None
    trainer.train(resume_from_checkpoint=resume)
    if ckpt is not None:
        ckpt.close()
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(weights, os.path.join(a.out, "final.safetensors"))


if __name__ == "__main__":
    main()
