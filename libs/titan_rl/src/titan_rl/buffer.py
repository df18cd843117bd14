"""The work buffer between rollout production and the policy update: it bounds policy lag.

Step ``s``'s rollouts are admitted (may start generating) once weights of version
``s - max_offpolicy_steps`` have been published to every generator; the trainer trains step
``s`` at version ``s``; so no rollout is more than ``max_offpolicy_steps`` versions behind the
weights it is trained at. Finished requests arrive in any order; ``take(s)`` hands over step
``s``'s groups, in group order, once all are in. The buffer's content is checkpointable
(``state_dict``): finished groups survive a restart, unfinished requests are issued again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from .generator import Generation
from .rollout import EpisodeGeneration, PromptImages, RolloutBatch


@dataclass(frozen=True, slots=True)
class RolloutRequest:
    """One unit of rollout work: ``num_groups`` consecutive groups of step ``step``."""

    step: int
    """The trainer step these rollouts are for (its prompts, its seeds)."""
    group: int
    """Position of the first group within the step (0 .. num_prompts - 1)."""
    num_groups: int
    """Groups (prompts) in this request; each gives ``group_size`` rows."""
    index: int
    """Global index of the first group: ``step * num_prompts + group`` (the data position)."""
    seed: int
    """The run's seed (rows are seeded by ``rollout_seed(seed, step, row)``)."""


class StoppedError(Exception):
    """The buffer was closed while a loop waited on it."""


class WorkBuffer:
    """Finished rollout groups keyed by step, and the admission gate of the lag bound."""

    def __init__(self, *, num_groups: int, max_offpolicy_steps: int, version: int = 0) -> None:
        """``num_groups``: groups per step (``num_prompts``)."""
        if num_groups < 1 or max_offpolicy_steps < 0:
            raise ValueError(
                f"WorkBuffer: num_groups={num_groups} must be >= 1 and "
                f"max_offpolicy_steps={max_offpolicy_steps} >= 0"
            )
        self.num_groups, self.max_offpolicy_steps = num_groups, max_offpolicy_steps
        self.published = version
        """Newest weight version published to every generator."""
        self._done: dict[int, dict[int, RolloutBatch]] = {}
        self._cond = threading.Condition()
        self._closed = False

    def open(self) -> None:
        """Accept waits again after ``close`` (a new run of the same controller)."""
        with self._cond:
            self._closed = False

    def close(self) -> None:
        """Wake every waiting loop with ``StoppedError``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def publish(self, version: int) -> None:
        """Weights of ``version`` are out to every generator: admit the steps they allow."""
        with self._cond:
            self.published = max(self.published, version)
            self._cond.notify_all()

    def admit(self, step: int) -> None:
        """Block until step ``step``'s rollouts may start (``StoppedError`` when closed)."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._closed or self.published >= step - self.max_offpolicy_steps
            )
            if self._closed:
                raise StoppedError

    def has(self, step: int, group: int) -> bool:
        """Whether the group is already in (a resumed run does not issue it again)."""
        with self._cond:
            return group in self._done.get(step, {})

    def put(self, request: RolloutRequest, batch: RolloutBatch) -> None:
        """A finished request: ``request.num_groups`` groups, rows in group order."""
        rows = len(batch.prompts)
        if rows % request.num_groups:
            raise ValueError(f"rollout source returned {rows} rows for {request.num_groups} groups")
        size = rows // request.num_groups
        with self._cond:
            slot = self._done.setdefault(request.step, {})
            for g in range(request.num_groups):
                slot[request.group + g] = _rows(batch, slice(g * size, (g + 1) * size))
            self._cond.notify_all()

    def take(self, step: int) -> list[RolloutBatch]:
        """Step ``step``'s groups in order, once all are in (removed from the buffer)."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._closed or len(self._done.get(step, ())) == self.num_groups
            )
            if self._closed and len(self._done.get(step, ())) != self.num_groups:
                raise StoppedError
            groups = self._done.pop(step)
        return [groups[g] for g in range(self.num_groups)]

    def state_dict(self) -> dict[str, Any]:
        """The finished groups (plain tensors and lists: ``torch.load(weights_only=True)``)."""
        with self._cond:
            return {
                "published": self.published,
                "groups": [
                    {"step": s, "group": g, **_batch_state(b)}
                    for s, groups in sorted(self._done.items())
                    for g, b in sorted(groups.items())
                ],
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the finished groups of ``state_dict`` (the gate restarts from the caller's
        published version, which the controller sets when it publishes its first weights)."""
        done: dict[int, dict[int, RolloutBatch]] = {}
        for item in state["groups"]:
            done.setdefault(int(item["step"]), {})[int(item["group"])] = _batch_from_state(item)
        with self._cond:
            self._done = done


def pack_groups(step: int, groups: list[RolloutBatch]) -> RolloutBatch:
    """One step's batch from its groups (responses right-padded to the widest group).

    The batch's ``weight_version`` is the oldest of its groups (the lag the trainer checks).
    """
    width = max(g.generation.tokens.shape[1] for g in groups)

    def cat(name: str) -> torch.Tensor:
        parts = [getattr(g.generation, name) for g in groups]
        out = parts[0].new_zeros(sum(len(t) for t in parts), width)
        row = 0
        for t in parts:
            out[row : row + len(t), : t.shape[1]] = t
            row += len(t)
        return out

    images = ()
    if any(g.images for g in groups):
        images = tuple(x for g in groups for x in (g.images or (None,) * len(g.prompts)))
    # Multi-turn groups keep their generation type (a mask with holes: environment ids).
    generation = type(groups[0].generation)(
        tokens=cat("tokens"),
        mask=cat("mask"),
        logprobs=cat("logprobs"),
        processed_logprobs=cat("processed_logprobs"),
        finish_reasons=[r for g in groups for r in g.generation.finish_reasons],
        weight_version=min(g.weight_version for g in groups),
    )
    return RolloutBatch(
        step=step,
        prompts=[p for g in groups for p in g.prompts],
        generation=generation,
        rewards=torch.cat([g.rewards for g in groups]),
        statuses=[s for g in groups for s in g.statuses],
        images=images,
    )


def _rows(batch: RolloutBatch, rows: slice) -> RolloutBatch:
    gen = batch.generation
    return RolloutBatch(
        step=batch.step,
        prompts=batch.prompts[rows],
        generation=type(gen)(
            tokens=gen.tokens[rows],
            mask=gen.mask[rows],
            logprobs=gen.logprobs[rows],
            processed_logprobs=gen.processed_logprobs[rows],
            finish_reasons=gen.finish_reasons[rows],
            weight_version=gen.weight_version,
        ),
        rewards=batch.rewards[rows],
        statuses=batch.statuses[rows],
        images=batch.images[rows] if batch.images else (),
    )


def _batch_state(b: RolloutBatch) -> dict[str, Any]:
    gen = b.generation
    return {
        "batch_step": b.step,
        "prompts": [list(p) for p in b.prompts],
        "tokens": gen.tokens,
        "mask": gen.mask,
        "logprobs": gen.logprobs,
        "processed_logprobs": gen.processed_logprobs,
        "finish_reasons": list(gen.finish_reasons),
        "weight_version": gen.weight_version,
        "multi_turn": isinstance(gen, EpisodeGeneration),
        "rewards": b.rewards,
        "statuses": list(b.statuses),
        "images": [
            None
            if x is None
            else {"pixel_values": x.pixel_values, "grids": [list(g) for g in x.grids]}
            for x in b.images
        ],
    }


def _batch_from_state(s: dict[str, Any]) -> RolloutBatch:
    images = tuple(
        None if x is None else PromptImages(x["pixel_values"], tuple(tuple(g) for g in x["grids"]))
        for x in s["images"]
    )
    return RolloutBatch(
        step=int(s["batch_step"]),
        prompts=[list(p) for p in s["prompts"]],
        generation=(EpisodeGeneration if s.get("multi_turn") else Generation)(
            tokens=s["tokens"],
            mask=s["mask"],
            logprobs=s["logprobs"],
            processed_logprobs=s["processed_logprobs"],
            finish_reasons=list(s["finish_reasons"]),
            weight_version=int(s["weight_version"]),
        ),
        rewards=s["rewards"],
        statuses=list(s["statuses"]),
        images=images,
    )
