"""A rubric: the training reward of an episode as a weighted sum of reward functions.

A function scores one episode (``per="rollout"``: ``fn(episode) -> float | RewardResult``) or
a whole group of rollouts of one prompt at once (``per="group"``: ``fn(episodes) -> list``,
e.g. a bonus for the shortest correct answer of the group). A function that raises or returns
a non-finite or non-numeric score gives 0 with status ``error`` for that episode (logged), as
a task's reward does in ``collect_rollouts``: a buggy verifier fails a reward, not the run.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .environment import Episode
from .rewards import RewardResult

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RubricScore:
    """One episode's rubric result."""

    total: float
    """The weighted sum (the training reward)."""
    breakdown: dict[str, float]
    """Each function's score before weighting."""
    statuses: dict[str, str]
    """Each function's status (``ok``, a ``RewardResult`` status, or ``error``)."""


@dataclass(frozen=True, slots=True)
class RewardFunction:
    """One weighted item of a rubric."""

    name: str
    """Its key in the breakdown."""
    fn: Callable[..., Any]
    """``fn(episode)`` (per rollout) or ``fn(episodes) -> list`` (per group)."""
    weight: float = 1.0
    """Its weight in the total."""
    per: Literal["rollout", "group"] = "rollout"
    """Scores one episode, or the whole group at once."""

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"RewardFunction {self.name!r}: fn must be callable, got {self.fn!r}")
        if self.per not in ("rollout", "group"):
            raise ValueError(f"RewardFunction.per={self.per!r} must be 'rollout' or 'group'")
        if not math.isfinite(self.weight):
            raise ValueError(f"RewardFunction {self.name!r}: weight={self.weight} must be finite")


def environment_reward(episode: Episode) -> float:
    """The environment's rewards summed over the episode's turns."""
    return episode.total_reward


def shortest_correct_bonus(episodes: Sequence[Episode]) -> list[float]:
    """Group bonus: 1 for the correct episode (``total_reward >= 1``) with the fewest model
    tokens (the first of equals), 0 for the others."""
    lengths = [
        sum(sum(s.model_mask) for s in e.sequences) if e.total_reward >= 1.0 else None
        for e in episodes
    ]
    correct = [n for n in lengths if n is not None]
    best = lengths.index(min(correct)) if correct else -1
    return [1.0 if i == best else 0.0 for i in range(len(episodes))]


class Rubric:
    """Weighted reward functions (see the module docstring)."""

    def __init__(self, functions: Sequence[RewardFunction]) -> None:
        """``functions``: the items; names must be distinct."""
        functions = list(functions)
        if not functions:
            raise ValueError("a Rubric needs at least one RewardFunction")
        for f in functions:
            if not isinstance(f, RewardFunction):
                raise TypeError(f"Rubric items must be RewardFunction, got {f!r}")
        names = [f.name for f in functions]
        if len(set(names)) != len(names):
            raise ValueError(f"Rubric function names must be distinct, got {names}")
        self.functions = functions

    @classmethod
    def environment(cls) -> Rubric:
        """The environment's own rewards, weight 1 (the default of a ``Rollouter``)."""
        return cls([RewardFunction("environment", environment_reward)])

    def score_group(self, episodes: Sequence[Episode]) -> list[RubricScore]:
        """Each episode's total and breakdown (group functions see all of ``episodes``)."""
        n = len(episodes)
        scores: dict[str, list[tuple[float, str]]] = {}
        for f in self.functions:
            if f.per == "rollout":
                scores[f.name] = [_safe(f.name, lambda e=e, f=f: f.fn(e)) for e in episodes]
            else:
                scores[f.name] = _safe_group(f.name, lambda f=f: f.fn(list(episodes)), n)
        out = []
        for i in range(n):
            breakdown = {name: s[i][0] for name, s in scores.items()}
            statuses = {name: s[i][1] for name, s in scores.items()}
            total = sum(f.weight * breakdown[f.name] for f in self.functions)
            out.append(RubricScore(float(total), breakdown, statuses))
        return out


def _as_score(value: Any) -> tuple[float, str]:
    if isinstance(value, RewardResult):
        value, status = value.score, value.status
    else:
        status = "ok"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"invalid reward {value!r}")
    return float(value), status


def _safe(name: str, call: Callable[[], Any]) -> tuple[float, str]:
    try:
        return _as_score(call())
    except Exception as e:  # a buggy reward fails one episode's score, not the run
        log.warning("reward function %r raised %s: %s; scoring 0", name, type(e).__name__, e)
        return 0.0, "error"


def _safe_group(name: str, call: Callable[[], Any], n: int) -> list[tuple[float, str]]:
    try:
        values = list(call())
        if len(values) != n:
            raise ValueError(f"returned {len(values)} scores for a group of {n}")
        return [_as_score(v) for v in values]
    except Exception as e:
        log.warning("group reward %r raised %s: %s; scoring 0", name, type(e).__name__, e)
        return [(0.0, "error")] * n
