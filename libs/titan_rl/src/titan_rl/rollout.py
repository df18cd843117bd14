"""Tasks and rollout batches: prompts in, scored groups of responses out.

A task hands out prompts by index and scores a response; ``collect_rollouts`` samples
``group_size`` responses per prompt with seeds fixed by ``(seed, step, row)`` (so a rollout
batch is reproducible whichever thread or mode produced it) and scores them, turning a reward
function that raises into a logged ``error`` reward of 0 instead of a crashed run.

A prompt may carry images (``PromptImages``, for a vision-language model): the generator gets
the batch's images in row order with the prompts (``generate(..., images=)``), and the batch
keeps each row's images so the trainer recomputes its log-probs with the same pixels.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from .environment import Episode, episode_tensors
from .generator import Generation, Generator, SamplingParams
from .rewards import RewardResult

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PromptImages:
    """The images at a prompt's placeholder tokens, as the model's image processor gives them."""

    pixel_values: torch.Tensor
    """``(patches, patch_dim)``: the flattened patches of every image of the prompt, in order."""
    grids: tuple[tuple[int, int, int], ...]
    """The patch grid ``(t, h, w)`` of each image."""

    def __post_init__(self) -> None:
        patches = sum(t * h * w for t, h, w in self.grids)
        if self.pixel_values.dim() != 2 or self.pixel_values.shape[0] != patches:
            raise ValueError(
                f"PromptImages: pixel_values of shape {tuple(self.pixel_values.shape)} must be "
                f"(patches, patch_dim) with {patches} patches for grids {self.grids}"
            )


def batch_images(images: Sequence[PromptImages | None]) -> dict[str, Any] | None:
    """A vision-language model's keyword arguments (``pixel_values``, ``image_grid_thw``) for
    the images of rows in order; ``None`` when no row has any."""
    mine = [x for x in images if x is not None and x.grids]
    if not mine:
        return None
    return {
        "pixel_values": torch.cat([x.pixel_values for x in mine]),
        "image_grid_thw": [g for x in mine for g in x.grids],
    }


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt as token ids plus what its reward needs (for example the expected answer)."""

    ids: list[int]
    answer: str
    images: PromptImages | None = None
    """The images at the prompt's placeholder tokens (vision-language models), if any."""


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
    images: tuple[PromptImages | None, ...] = ()
    """Each row's prompt images (empty: no row has any)."""

    @classmethod
    def from_episodes(cls, groups: Sequence[Sequence[Episode]], *, step: int) -> RolloutBatch:
        """A batch of multi-turn episodes, one row per episode, each group's rows adjacent
        (``groups``: ``Rollouter.rollout_group`` results of one size).

        A row's prompt is the episode's first prompt; its response is every id after it
        (model turns and the environment's messages in between) with the model mask and the
        generator's log-probs of the model ids, so ``GRPOTrainer.step`` trains it as it is
        (the trainer's ``sequence_logprobs`` keeps masked-out ids as context). Rewards are the
        episodes' rubric totals; statuses their ``reward_status``; the weight version is the
        oldest of any turn (the staleness bound holds for every token). ``processed_logprobs``
        are the raw ones (episodes keep only those). Compacted episodes (several token
        sequences) are refused: train their sequences as rows of their own.
        """
        groups = [list(g) for g in groups]
        sizes = {len(g) for g in groups}
        if not groups or len(sizes) != 1 or 0 in sizes:
            raise ValueError(
                f"from_episodes needs non-empty groups of one size, got sizes {[len(g) for g in groups]}"
            )
        episodes = [e for g in groups for e in g]
        compacted = [i for i, e in enumerate(episodes) if len(e.sequences) != 1]
        if compacted:
            raise ValueError(
                f"episodes {compacted} were compacted into several token sequences; "
                "from_episodes takes one sequence per episode"
            )
        if any(not e.weight_versions for e in episodes):
            raise ValueError("every episode needs at least one model turn")
        tokens, mask, logprobs = episode_tensors(episodes)
        generation = EpisodeGeneration(
            tokens=tokens,
            mask=mask,
            logprobs=logprobs,
            processed_logprobs=logprobs,
            finish_reasons=[e.status for e in episodes],
            weight_version=min(v for e in episodes for v in e.weight_versions),
        )
        return cls(
            step=step,
            prompts=[e.prompt for e in episodes],
            generation=generation,
            rewards=torch.tensor([e.reward for e in episodes], dtype=torch.float32),
            statuses=[e.reward_status for e in episodes],
        )

    def model_images(self, rows: slice = slice(None)) -> dict[str, Any] | None:
        """The model's image keyword arguments for ``rows`` (``None`` without images)."""
        return batch_images(self.images[rows])

    @property
    def weight_version(self) -> int:
        """Version of the generator weights that sampled this batch."""
        return self.generation.weight_version

    def status_counts(self) -> dict[str, int]:
        """How many rows got each reward status."""
        return dict(Counter(self.statuses))


@dataclass(frozen=True, slots=True)
class EpisodeGeneration(Generation):
    """A ``Generation`` whose mask has holes: multi-turn rows, where the environment's ids
    sit between the model's turns (``validate`` checks the shapes only)."""

    def validate(self, num_prompts: int) -> None:
        """Raise ``ValueError`` if the fields disagree in shape."""
        shape = tuple(self.tokens.shape)
        if len(shape) != 2 or shape[0] != num_prompts:
            raise ValueError(f"episode batch has tokens {shape} for {num_prompts} rows")
        for name in ("mask", "logprobs", "processed_logprobs"):
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"episode batch {name} has shape {got}, tokens have {shape}")
        if len(self.finish_reasons) != num_prompts:
            raise ValueError(f"{len(self.finish_reasons)} finish reasons for {num_prompts} rows")


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
    images = tuple(p.images for p in rows) if any(p.images for p in rows) else ()
    generation = generator.generate(ids, sampling, seeds, **image_kwargs(images))
    generation.validate(len(rows))  # a broken generator must not reach the loss
    results = [safe_score(task, p, r) for p, r in zip(rows, generation.responses(), strict=True)]
    return RolloutBatch(
        step=step,
        prompts=ids,
        generation=generation,
        rewards=torch.tensor([r.score for r in results], dtype=torch.float32),
        statuses=[r.status for r in results],
        images=images,
    )


def image_kwargs(images: Sequence[PromptImages | None]) -> dict[str, Any]:
    # Only a batch with images passes the keyword: text-only generators need not take it.
    found = batch_images(images)
    return {} if found is None else {"images": found}


def safe_score(task: Task, prompt: Prompt, response: list[int]) -> RewardResult:
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
    images = image_kwargs([p.images for p in prompts])
    out = generator.generate([p.ids for p in prompts], params, list(range(count)), **images)
    out.validate(count)
    scores = [task.score(p, r).score for p, r in zip(prompts, out.responses(), strict=True)]
    return sum(scores) / count
