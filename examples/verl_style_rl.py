"""An RL step the way veRL / Miles structure it, with titan_rl's pieces and an HF actor.

    python examples/verl_style_rl.py

A tiny random ``LlamaForCausalLM`` (built from a config, nothing downloaded) is the actor.
Each step: a rollout engine holding a copy of the actor's weights samples a group of
responses per prompt; a rule-based reward scores them; titan_rl gives GRPO's group-relative
advantages; the actor recomputes the old log-probs; the PPO-clip GRPO loss with truncated
importance sampling (TIS) against the rollout's log-probs updates the actor in mini-batches;
the new weights are pushed to the rollout engine. Rollout and recompute run in titan_rl's
batch-invariant mode, so the engine's log-probs equal the actor's bit for bit and TIS weights
are exactly 1: the off-policy correction only acts on real staleness. Needs only
``titan-rl``, torch and transformers.
"""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import titan_rl

TARGET = 7
"""The reward: the share of response tokens equal to this id (a rule any actor can learn)."""
GROUP, MINIBATCHES = 8, 2
SAMPLING = titan_rl.SamplingParams(max_new_tokens=8, temperature=1.0)
LOSS = titan_rl.LossConfig(correction="tis", correction_cap=2.0)


def make_actor() -> LlamaForCausalLM:
    """A 2-layer Llama of width 64 over 32 token ids, the same weights every call (seeded)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def reward(response: list[int]) -> float:
    """Rule-based reward of one response (a verifier in a real run)."""
    return sum(t == TARGET for t in response) / len(response)


def rl_step(actor, optimizer, rollout, prompts: list[list[int]], step: int) -> dict[str, float]:
    """One step: rollout, reward, advantages, old log-probs, actor update, weight sync."""
    losses, weights = [], []
    rows = [p for p in prompts for _ in range(GROUP)]  # each prompt's group adjacent
    seeds = [titan_rl.rollout_seed(0, step, i) for i in range(len(rows))]
    gen = rollout.generate(rows, SAMPLING, seeds)  # tokens, mask, rollout log-probs
    rewards = torch.tensor([reward(r) for r in gen.responses()])
    advantages = titan_rl.group_advantages(rewards, GROUP)
    with torch.no_grad(), titan_rl.batch_invariant():  # the actor's old log-probs
        old = titan_rl.sequence_logprobs(actor, rows, gen.tokens, gen.mask)
    size = len(rows) // MINIBATCHES
    for mb in (slice(i, i + size) for i in range(0, len(rows), size)):
        with titan_rl.batch_invariant():
            logprobs = titan_rl.sequence_logprobs(actor, rows[mb], gen.tokens[mb], gen.mask[mb])
        out = titan_rl.grpo_loss(
            logprobs, old[mb], advantages[mb], gen.mask[mb], LOSS,
            rollout_logprobs=gen.logprobs[mb],
        )  # fmt: skip
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
        weights.append(out.correction_weights[gen.mask[mb]])
    rollout.update_weights(actor.state_dict(), version=step + 1)  # sync the rollout engine
    return {
        "reward": rewards.mean().item(),
        "loss": sum(losses) / len(losses),
        "max_abs_logprob_diff": (old - gen.logprobs).abs().max().item(),
        "tis_weight_min": torch.cat(weights).min().item(),
        "tis_weight_max": torch.cat(weights).max().item(),
        "rollout_version": gen.weight_version,
    }


def train(steps: int) -> list[dict[str, float]]:
    """``steps`` RL steps from the seeded actor; each step's metrics."""
    actor = make_actor()
    optimizer = torch.optim.AdamW(actor.parameters(), lr=3e-3)
    rollout = titan_rl.TorchGenerator(copy.deepcopy(actor), batch_invariant=True)
    g = torch.Generator().manual_seed(1)
    history = []
    for step in range(steps):
        prompts = torch.randint(0, 32, (4, 5), generator=g).tolist()
        history.append(rl_step(actor, optimizer, rollout, prompts, step))
    return history


def main() -> None:
    torch.set_num_threads(1)  # a model this small gains nothing from a second thread
    history = train(steps=12)
    for i, m in enumerate(history):
        print(
            f"step {i:2d}  reward {m['reward']:.3f}  loss {m['loss']:+.4f}  "
            f"|rollout - actor| {m['max_abs_logprob_diff']:.1e}  "
            f"TIS weights [{m['tis_weight_min']:.3f}, {m['tis_weight_max']:.3f}]"
        )
    assert all(m["max_abs_logprob_diff"] == 0.0 for m in history), "log-probs differ"
    assert all(m["tis_weight_min"] == m["tis_weight_max"] == 1.0 for m in history)
    first, last = history[0]["reward"], sum(m["reward"] for m in history[-3:]) / 3
    assert last > first + 0.1, f"reward did not rise: {first:.3f} -> {last:.3f}"


if __name__ == "__main__":
    main()
