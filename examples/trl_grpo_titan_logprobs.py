"""TRL's ``GRPOTrainer`` with titan_rl's log-prob path: rollout and trainer log-probs bitwise equal.

    python examples/trl_grpo_titan_logprobs.py

TRL samples with one engine and scores the samples with another forward (its fused LM head
over the left-padded batch), so even with unchanged weights the trainer's log-probs differ
from the sampler's in the last bits, and the PPO ratio of an unchanged policy is not exactly 1.
Two overrides remove that gap here, on a tiny random ``LlamaForCausalLM`` (built from a
config, nothing downloaded) and a character tokenizer built in memory:

- ``rollout_func`` (TRL's hook for a custom generator) samples with
  ``titan_rl.TorchGenerator(batch_invariant=True)`` over the trainer's own model, and hands
  TRL each token's sampling log-prob;
- ``TitanLogprobsGRPOTrainer._get_per_token_logps_and_entropies`` computes TRL's old and new
  log-probs (and entropies) with ``titan_rl.sequence_logprobs`` under
  ``titan_rl.batch_invariant()``, straight from TRL's left-padded ``prompt_ids`` /
  ``prompt_mask`` tensors.

Each generation batch feeds two optimizer steps (``steps_per_generation=2``), so TRL computes
old log-probs. The script checks on every completion token that the rollout's log-probs equal
TRL's old log-probs bit for bit, and that the first step's new log-probs equal the old ones
(ratio exactly 1); the second step's differ (the weights moved). It also reports how far TRL's
own forward is from the rollout on the same batch: the gap the overrides close. CPU, seconds.
"""

from __future__ import annotations

import tempfile
import warnings

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

import titan_rl

SEED = 0
CHARS = "0123456789+= "
"""The tokenizer's characters after ``<pad>`` and ``<eos>``: ids 2..14."""
TARGET = "7"
"""The reward: the share of completion characters equal to this one (a rule any policy learns)."""


def make_tokenizer() -> PreTrainedTokenizerFast:
    """One id per character, ``<pad>`` 0 and ``<eos>`` 1; built in memory."""
    vocab = {"<pad>": 0, "<eos>": 1} | {c: i + 2 for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def make_model(vocab_size: int) -> LlamaForCausalLM:
    """A 2-layer Llama of width 64, the same weights every call (seeded)."""
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def sevens_reward(completions: list[str], **_) -> list[float]:
    """TRL reward function: the share of ``TARGET`` in each completion."""
    return [c.count(TARGET) / max(len(c), 1) for c in completions]


class TitanLogprobsGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose rollouts and per-token log-probs go through titan_rl (see the
    module docstring); records the bitwise checks in ``self.parity``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, rollout_func=self._titan_rollout, **kwargs)
        self._generator: titan_rl.TorchGenerator | None = None
        self._last_logps: torch.Tensor | None = None
        self.parity: list[dict[str, float]] = []

    def _titan_rollout(self, prompts: list[str], trainer: GRPOTrainer) -> dict[str, list]:
        """TRL's ``rollout_func``: sample with titan's batch-invariant generator over the
        trainer's own model (its weights are always current: nothing to sync)."""
        if self._generator is None:
            model = self.accelerator.unwrap_model(self.model)
            self._generator = titan_rl.TorchGenerator(model, batch_invariant=True)
        tok = self.processing_class
        rows = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        sampling = titan_rl.SamplingParams(
            max_new_tokens=self.max_completion_length,
            temperature=self.temperature,
            stop_token_ids=(tok.eos_token_id,),
        )
        seeds = [titan_rl.rollout_seed(SEED, self.state.global_step, i) for i in range(len(rows))]
        gen = self._generator.generate(rows, sampling, seeds)
        return {
            "prompt_ids": rows,
            "completion_ids": [t[m].tolist() for t, m in zip(gen.tokens, gen.mask, strict=True)],
            "logprobs": [lp[m].tolist() for lp, m in zip(gen.logprobs, gen.mask, strict=True)],
        }

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """TRL's old and new log-probs through titan's path: the left-padded prompt columns
        and the completion columns of TRL's batch, one batch-invariant forward per chunk."""
        if compute_aux_loss or any(v is not None for v in multimodal.values()):
            raise ValueError("this example scores text-only dense models (no images, no MoE aux)")
        T = logits_to_keep
        batch_size = batch_size or input_ids.shape[0]
        logps, entropies = [], []
        for rows in torch.arange(input_ids.shape[0]).split(batch_size):
            ids, mask = input_ids[rows], attention_mask[rows]
            with titan_rl.batch_invariant():
                lp, ent = titan_rl.sequence_logprobs(
                    model,
                    ids[:, :-T],
                    ids[:, -T:],
                    mask[:, -T:],
                    prompt_mask=mask[:, :-T],
                    temperature=self.temperature,
                    with_entropy=True,
                )
            logps.append(lp)
            entropies.append(ent)
        logps = torch.cat(logps)
        if torch.is_grad_enabled():
            self._last_logps = logps.detach()
        return logps, torch.cat(entropies) if compute_entropy else None, None

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if "old_per_token_logps" not in out:
            raise RuntimeError(
                "TRL skipped the old log-probs: keep gradient_accumulation_steps a non-multiple "
                "of steps_per_generation * num_iterations so they are computed"
            )
        mask = out["completion_mask"].bool()
        old, rollout = out["old_per_token_logps"], out["sampling_per_token_logps"]
        with torch.no_grad():  # TRL's own forward on the same batch, for comparison only
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
            trl_own, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
                self,
                self.model,
                ids,
                torch.cat([out["prompt_mask"], out["completion_mask"]], 1),
                out["completion_ids"].shape[1],
            )
        self.parity.append(
            {
                "check": "rollout_vs_old",
                "tokens": int(mask.sum()),
                "max_abs_diff": (old - rollout)[mask].abs().max().item(),
                "trl_forward_vs_rollout": (trl_own - rollout)[mask].abs().max().item(),
            }
        )
        return out

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        fresh = self._step % (self.args.steps_per_generation * self.num_iterations) == 0
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        mask = inputs["completion_mask"].bool()
        diff = (self._last_logps - inputs["old_per_token_logps"])[mask].abs().max().item()
        check = "new_vs_old_same_weights" if fresh else "new_vs_old_after_a_step"
        self.parity.append({"check": check, "tokens": int(mask.sum()), "max_abs_diff": diff})
        return loss


def train(steps: int = 4, output_dir: str | None = None) -> TitanLogprobsGRPOTrainer:
    """``steps`` optimizer steps of GRPO on the toy task; returns the trainer (``parity``,
    ``state.log_history``)."""
    tokenizer = make_tokenizer()
    model = make_model(len(tokenizer))
    prompts = [f"{a}+{b}=" for a in range(4) for b in range(4)]
    args = GRPOConfig(
        output_dir=output_dir or tempfile.mkdtemp(prefix="trl_grpo_titan_"),
        per_device_train_batch_size=8,
        num_generations=4,
        steps_per_generation=2,  # one generation batch, two optimizer steps: old log-probs kept
        gradient_accumulation_steps=1,
        max_completion_length=6,
        temperature=1.0,
        beta=0.0,
        learning_rate=3e-3,
        max_steps=steps,
        logging_steps=1,
        seed=SEED,
        bf16=False,  # fp32 on CPU
        activation_checkpointing=False,  # TRL turns it on by default
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*rollout_func.*experimental")
        trainer = TitanLogprobsGRPOTrainer(
            model=model,
            reward_funcs=sevens_reward,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=tokenizer,
        )
    trainer.train()
    return trainer


def check(trainer: TitanLogprobsGRPOTrainer) -> None:
    """The bitwise claims, on every completion token of every batch."""
    for record in trainer.parity:
        if record["check"] in ("rollout_vs_old", "new_vs_old_same_weights"):
            assert record["max_abs_diff"] == 0.0, record
    fresh = [r for r in trainer.parity if r["check"] == "new_vs_old_same_weights"]
    assert fresh and len(fresh) == sum(r["check"] == "rollout_vs_old" for r in trainer.parity)


if __name__ == "__main__":
    trainer = train()
    for record in trainer.parity:
        print(record)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    print("reward per step:", [round(r, 3) for r in rewards])
    check(trainer)
    print("rollout, old and same-weights new log-probs: bitwise equal on every token")
