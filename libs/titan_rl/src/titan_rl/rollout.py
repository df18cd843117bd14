"""Tasks and rollout batches: prompts in, scored groups of responses out.

A task hands out prompts by index and scores a response; ``collect_rollouts`` samples
``group_size`` responses per prompt with seeds fixed by ``(seed, step, row)`` (so a rollout
batch is reproducible whichever thread or mode produced it) and scores them, turning a reward
function that raises into a logged ``error`` reward of 0 instead of a crashed run.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from .generator import Generation, Generator, SamplingParams
from .rewards import RewardResult

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt as token ids plus what its reward needs (for example the expected answer)."""

    ids: list[int]
    answer: str


@runtime_checkable
class Task(Protocol):
    """A source of prompts and the verifier of their responses."""

    def prompts(self, start: int, count: int) -> list[Prompt]:
        """Prompts ``start .. start + count - 1`` (deterministic)."""
        ...

    def score(self, prompt: Prompt, response_ids: list[int]) -> RewardResult:
        """The reward of one response."""
        ...


@dataclass(frozen=True, slots=True)
class RolloutBatch:
    """``num_prompts`` groups of ``group_size`` scored responses (each group's rows adjacent)."""

    step: int
    """Index of the trainer step these rollouts were made for."""
    prompts: list[list[int]]
    """Prompt ids of every row (each prompt repeated ``group_size`` times)."""
    generation: Generation
    """Sampled tokens, log-probs and the weight version that produced them."""
    rewards: torch.Tensor
    """``(rows,)`` scores."""
    statuses: list[str]
    """Each row's ``RewardResult.status``."""

    @property
    def weight_version(self) -> int:
        """Version of the generator weights that sampled this batch."""
        return self.generation.weight_version

    def status_counts(self) -> dict[str, int]:
        """How many rows got each reward status."""
        return dict(Counter(self.statuses))


def rollout_seed(seed: int, step: int, row: int) -> int:
    """The sampling seed of ``row`` of step ``step``'s batch."""
    return (seed * 1_000_003 + step) * 65_536 + row


def collect_rollouts(
    generator: Generator,
    task: Task,
    *,
    step: int,
    num_prompts: int,
    group_size: int,
    sampling: SamplingParams,
    seed: int = 0,
) -> RolloutBatch:
    """Sample and score ``group_size`` responses for each of step ``step``'s prompts."""
    prompts = task.prompts(step * num_prompts, num_prompts)
    if len(prompts) != num_prompts:
        raise ValueError(f"task returned {len(prompts)} prompts, {num_prompts} were asked for")
    rows = [p for p in prompts for _ in range(group_size)]
    ids = [p.ids for p in rows]
    seeds = [rollout_seed(seed, step, i) for i in range(len(rows))]
    generation = generator.generate(ids, sampling, seeds)
    generation.validate(len(rows))  # a broken generator must not reach the loss
    results = [_safe_score(task, p, r) for p, r in zip(rows, generation.responses(), strict=True)]
    return RolloutBatch(
        step=step,
        prompts=ids,
        generation=generation,
        rewards=torch.tensor([r.score for r in results], dtype=torch.float32),
        statuses=[r.status for r in results],
    )


def _safe_score(task: Task, prompt: Prompt, response: list[int]) -> RewardResult:
    try:
        result = task.score(prompt, response)
    except Exception as e:  # a buggy verifier fails one reward, not the run
        log.warning("reward function raised %s: %s; scoring 0", type(e).__name__, e)
        return RewardResult(0.0, "error", f"{type(e).__name__}: {e}")
    if not isinstance(result, RewardResult) or not torch.isfinite(torch.tensor(result.score)):
        log.warning("reward function returned %r; scoring 0", result)
        return RewardResult(0.0, "error", f"invalid reward {result!r}")
    return result


def evaluate_accuracy(
    generator: Generator, task: Task, *, start: int, count: int, params: SamplingParams
) -> float:
    """Mean score of one response to each of prompts ``start .. start + count - 1``.

    With ``params.temperature == 0`` (greedy) this is the task's accuracy on those prompts.
    """
    prompts = task.prompts(start, count)
    out = generator.generate([p.ids for p in prompts], params, list(range(count)))
    out.validate(count)
    scores = [task.score(p, r).score for p, r in zip(prompts, out.responses(), strict=True)]
    return sum(scores) / count
