"""Stand-ins with fixed latencies, to measure the dataflow apart from this machine's cores.

``LatencyGenerator`` sleeps ``token_latency_s`` per decode step of a call (as an engine's
step time is nearly flat in the batch at small batches) and returns seeded tokens;
``LatencyPolicy`` sleeps ``step_s`` per training step. Sleeping uses no core, so N replicas
overlap fully, as N accelerators would.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from .generator import Generation, SamplingParams
from .rollout import RolloutBatch


class LatencyGenerator:
    """A ``Generator`` whose every call takes ``max_new_tokens * token_latency_s``."""

    def __init__(self, *, token_latency_s: float, vocab_size: int = 256) -> None:
        if token_latency_s < 0:
            raise ValueError(f"token_latency_s={token_latency_s} must be >= 0")
        self.token_latency_s, self.vocab_size = token_latency_s, vocab_size
        self.weight_version = 0

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], **_: Any
    ) -> Generation:
        """Seeded random tokens after ``params.max_new_tokens`` steps of latency."""
        time.sleep(self.token_latency_s * params.max_new_tokens)
        B, T = len(prompts), params.max_new_tokens
        tokens = torch.stack(
            [
                torch.randint(self.vocab_size, (T,), generator=torch.Generator().manual_seed(s))
                for s in seeds
            ]
        )
        logprobs = torch.full((B, T), -float(torch.log(torch.tensor(float(self.vocab_size)))))
        return Generation(
            tokens=tokens,
            mask=torch.ones(B, T, dtype=torch.bool),
            logprobs=logprobs,
            processed_logprobs=logprobs.clone(),
            finish_reasons=["length"] * B,
            weight_version=self.weight_version,
        )

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Take the version (there are no weights)."""
        self.weight_version = version


class LatencyPolicy:
    """A ``controller.Policy`` whose every step takes ``step_s``; weights are empty."""

    reuses_slots = False

    def __init__(self, *, step_s: float) -> None:
        self.step_s = step_s
        self.version = 0

    def train(self, batch: RolloutBatch, max_lag: int) -> dict[str, Any]:
        lag = self.version - batch.weight_version
        if not 0 <= lag <= max_lag:
            raise RuntimeError(f"lag {lag} outside [0, {max_lag}]")
        time.sleep(self.step_s)
        self.version += 1
        return {"reward_mean": float(batch.rewards.mean()), "max_abs_logprob_diff": 0.0}

    def publish(self, version: int) -> dict[str, torch.Tensor]:
        return {}
