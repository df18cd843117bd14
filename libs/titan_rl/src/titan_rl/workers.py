"""Rollout sources and the worker pool that scores rewards and runs tools in parallel.

A rollout source is what the controller's rollout loop calls: ``source(generator, request)
-> RolloutBatch`` with ``request.num_groups * group_size`` rows, groups in order. Any
callable of that shape fits (a multi-turn ``Rollouter``: call ``rollout_group`` per group and
build the batch from its episodes). ``TaskRollouts`` is the single-turn source over a
``Task``: the same prompts and seeds as ``collect_rollouts`` for the same step, so a run of
the controller reproduces the one-process loop; its rewards are scored in a thread pool
(``run_sandboxed`` is a subprocess, so threads run sandboxed code truly in parallel).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from .buffer import RolloutRequest
from .generator import Generator, SamplingParams
from .rollout import RolloutBatch, Task, image_kwargs, rollout_seed, safe_score

RolloutSource = Callable[[Generator, RolloutRequest], RolloutBatch]
"""``source(generator, request) -> RolloutBatch`` (``request.num_groups`` groups in order)."""


class TaskRollouts:
    """Single-turn rollouts of ``task``: prompt ``index``, ``group_size`` seeded samples each,
    rewards scored by ``pool`` (a shared thread pool; ``None``: one after another)."""

    def __init__(
        self,
        task: Task,
        *,
        num_prompts: int,
        group_size: int,
        sampling: SamplingParams,
        pool: ThreadPoolExecutor | None = None,
    ) -> None:
        """``num_prompts``: groups per step (row seeds are numbered within the step)."""
        if num_prompts < 1 or group_size < 1:
            raise ValueError(
                f"TaskRollouts: num_prompts={num_prompts} and group_size={group_size} must be >= 1"
            )
        self.task, self.num_prompts, self.group_size = task, num_prompts, group_size
        self.sampling, self.pool = sampling, pool

    def __call__(self, generator: Generator, request: RolloutRequest) -> RolloutBatch:
        """Sample and score ``request``'s groups."""
        prompts = self.task.prompts(request.index, request.num_groups)
        if len(prompts) != request.num_groups:
            raise ValueError(
                f"task returned {len(prompts)} prompts, {request.num_groups} were asked for"
            )
        rows = [p for p in prompts for _ in range(self.group_size)]
        first = request.group * self.group_size  # row numbers within the step, as the loop's
        seeds = [rollout_seed(request.seed, request.step, first + i) for i in range(len(rows))]
        images = tuple(p.images for p in rows) if any(p.images for p in rows) else ()
        ids = [p.ids for p in rows]
        generation = generator.generate(ids, self.sampling, seeds, **image_kwargs(images))
        generation.validate(len(rows))
        responses = generation.responses()
        if self.pool is None:
            results = [safe_score(self.task, p, r) for p, r in zip(rows, responses, strict=True)]
        else:
            results = list(self.pool.map(safe_score, [self.task] * len(rows), rows, responses))
        return RolloutBatch(
            step=request.step,
            prompts=ids,
            generation=generation,
            rewards=torch.tensor([r.score for r in results], dtype=torch.float32),
            statuses=[r.status for r in results],
            images=images,
        )
