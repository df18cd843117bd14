"""Per-step diagnostics of a rollout batch: trainer/generator agreement, rewards and lengths."""

from __future__ import annotations

import torch


def logprob_diagnostics(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the generator's log-probs are from the trainer's on the sampled tokens.

    - ``kl_generator_trainer``: k3 estimate of KL(generator ‖ trainer) from the generator's
      own samples, ``r - 1 - log r`` with ``r = π_trainer / π_generator``, averaged over tokens;
    - ``max_abs_logprob_diff``: max over tokens of ``|log π_trainer - log π_generator|``;
    - ``ess``: normalised effective sample size ``(Σw)² / (n Σw²)`` of the token weights
      ``w = π_trainer / π_generator`` (1 when the two agree).
    """
    mask = mask.bool()
    n = int(mask.sum())
    if n == 0:
        return {"kl_generator_trainer": 0.0, "max_abs_logprob_diff": 0.0, "ess": 1.0}
    log_r = (trainer_logprobs.detach() - rollout_logprobs.detach()).double()[mask]
    w = log_r.exp()
    return {
        "kl_generator_trainer": float((w - 1.0 - log_r).mean()),
        "max_abs_logprob_diff": float(log_r.abs().max()),
        "ess": float(w.sum() ** 2 / (n * (w * w).sum())),
    }


def reward_diagnostics(rewards: torch.Tensor, lengths: torch.Tensor) -> dict[str, float]:
    """Mean / std / min / max of the rewards and of the response lengths (tokens)."""
    r, n = rewards.double(), lengths.double()
    return {
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std(unbiased=False)),
        "reward_min": float(r.min()),
        "reward_max": float(r.max()),
        "length_mean": float(n.mean()),
        "length_min": float(n.min()),
        "length_max": float(n.max()),
    }
