"""Multi-turn episodes: an environment protocol (reset/step) and a code-execution tool.

An episode alternates model turns and environment turns in one token sequence. The model's
tokens are sampled by a ``Generator`` and keep their log-probs; the environment's replies are
appended as plain tokens and masked out of the loss (``Episode.model_mask``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from .generator import Generator, SamplingParams
from .rewards import RewardResult, boxed_math_reward
from .sandbox import SandboxLimits, run_sandboxed
from .tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class StepResult:
    """The environment's answer to one model turn."""

    observation: str
    """Text appended to the context for the next model turn ("" when done)."""
    reward: float
    """Reward of this turn (an episode's return is the sum)."""
    done: bool
    """The episode is over."""
    info: dict = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """A text environment the model acts in for several turns."""

    def reset(self, seed: int) -> str:
        """Start an episode; returns the first observation (the prompt)."""
        ...

    def step(self, action: str) -> StepResult:
        """Apply the model's turn ``action`` (its decoded text)."""
        ...


@dataclass(frozen=True, slots=True)
class Episode:
    """One finished episode as a single token sequence."""

    tokens: list[int]
    """Every token after the first observation: model turns and environment replies."""
    model_mask: list[bool]
    """True on the model's tokens (the ones a policy loss trains on)."""
    logprobs: list[float]
    """The generator's log-prob of each model token (0.0 on environment tokens)."""
    prompt: list[int]
    """Token ids of the first observation."""
    total_reward: float
    turns: int
    weight_versions: list[int]
    """Weight version of each model turn (a push between turns shows up here)."""


def run_episode(
    env: Environment,
    generator: Generator,
    tokenizer: Tokenizer,
    params: SamplingParams,
    *,
    seed: int,
    max_turns: int = 4,
) -> Episode:
    """Play one episode: model turn, environment turn, ... until done or ``max_turns``."""
    if max_turns < 1:
        raise ValueError(f"max_turns={max_turns} must be >= 1")
    prompt = [tokenizer.bos_id, *tokenizer.encode(env.reset(seed))]
    tokens: list[int] = []
    mask: list[bool] = []
    logprobs: list[float] = []
    versions: list[int] = []
    total, turns = 0.0, 0
    for turn in range(max_turns):
        out = generator.generate([prompt + tokens], params, [seed * 1_000 + turn])
        out.validate(1)
        (response,) = out.responses()
        tokens += response
        mask += [True] * len(response)
        logprobs += out.logprobs[0, : len(response)].tolist()
        versions.append(out.weight_version)
        turns += 1
        result = env.step(tokenizer.decode([t for t in response if t != tokenizer.eos_id]))
        total += result.reward
        if result.done:
            break
        reply = tokenizer.encode(result.observation)
        tokens += reply
        mask += [False] * len(reply)
        logprobs += [0.0] * len(reply)
    return Episode(tokens, mask, logprobs, prompt, total, turns, versions)


_CODE_BLOCK = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


class CodeToolEnv:
    """Solve a question; fenced Python blocks run in the sandbox, ``\\boxed{}`` answers end it.

    Each model turn either contains a ```python block (run sandboxed; its stdout, or the error
    status, comes back as the observation) or a final ``\\boxed{answer}`` scored by
    ``boxed_math_reward``. A turn with neither ends the episode unparseable.
    """

    def __init__(
        self,
        questions: list[tuple[str, str]],
        *,
        limits: SandboxLimits | None = None,
        isolation: str = "namespaces",
    ) -> None:
        """``questions``: ``(question, answer)`` pairs; ``reset(seed)`` picks one by ``seed``.

        ``limits`` and ``isolation`` are passed to ``run_sandboxed``.
        """
        if not questions:
            raise ValueError("questions must hold at least one (question, answer) pair")
        self.questions, self.limits = questions, limits or SandboxLimits(wall_time_s=2.0)
        self.isolation = isolation
        self._answer: str | None = None
        self.last_result: RewardResult | None = None

    def reset(self, seed: int) -> str:
        question, self._answer = self.questions[seed % len(self.questions)]
        self.last_result = None
        return question

    def step(self, action: str) -> StepResult:
        if self._answer is None:
            raise RuntimeError("CodeToolEnv.step() before reset()")
        if "\\boxed{" in action:
            self.last_result = boxed_math_reward(action, self._answer)
            return StepResult("", self.last_result.score, True, {"status": self.last_result.status})
        block = _CODE_BLOCK.search(action)
        if block is None:
            self.last_result = RewardResult(0.0, "unparseable", "neither code nor \\boxed{}")
            return StepResult("", 0.0, True, {"status": "unparseable"})
        run = run_sandboxed(block.group(1), limits=self.limits, isolation=self.isolation)
        shown = run.stdout if run.status == "ok" else f"[{run.status}] {run.stderr[-200:]}"
        return StepResult(f"\n```output\n{shown.strip()}\n```\n", 0.0, False, {"tool": run.status})


def episode_tensors(episodes: list[Episode]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(tokens, model_mask, logprobs)`` of ``episodes``, each ``(N, T)``."""
    width = max(len(e.tokens) for e in episodes)
    tokens = torch.zeros(len(episodes), width, dtype=torch.long)
    mask = torch.zeros(len(episodes), width, dtype=torch.bool)
    logprobs = torch.zeros(len(episodes), width)
    for i, e in enumerate(episodes):
        n = len(e.tokens)
        tokens[i, :n] = torch.tensor(e.tokens)
        mask[i, :n] = torch.tensor(e.model_mask)
        logprobs[i, :n] = torch.tensor(e.logprobs)
    return tokens, mask, logprobs
