"""Multi-turn chat environments: the protocol (reset / step on messages), the episode record,
and a code-execution tool environment.

An environment starts a conversation (``reset(seed) -> messages``) and answers each model
turn (``step(assistant message) -> StepResult``: its messages, a reward, done). An episode
(played by ``titan_rl.run_episode`` or a ``Rollouter``) is one token sequence per context:
the model's turns are the ids the generator sampled, verbatim, with their log-probs; the
environment's messages are rendered between them (``Renderer.continuation``) and masked out
of the loss (``TokenSequence.model_mask``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from .messages import Message
from .rewards import RewardResult, boxed_math_reward
from .sandbox import SandboxLimits, run_sandboxed


@dataclass(frozen=True, slots=True)
class StepResult:
    """The environment's answer to one model turn."""

    messages: Sequence[Message] = ()
    """Messages appended to the conversation before the next model turn (tool outputs, user
    feedback; empty when done)."""
    reward: float = 0.0
    """Reward of this turn (an episode's ``total_reward`` is the sum over its turns)."""
    done: bool = False
    """The episode is over."""
    info: dict = field(default_factory=dict)
    """Anything to log; ``info["status"]`` (``correct``, ``wrong``, ...) becomes the
    episode's ``reward_status``."""

    def __post_init__(self) -> None:
        if isinstance(self.messages, (str, Message)):
            raise TypeError(
                f"StepResult.messages must be a sequence of Message, got {self.messages!r}"
            )
        for m in self.messages:
            if not isinstance(m, Message) or m.role == "assistant":
                raise TypeError(
                    f"StepResult.messages holds the environment's messages (system, user, "
                    f"tool), got {m!r}"
                )


@runtime_checkable
class Environment(Protocol):
    """A chat environment the model acts in for several turns."""

    def reset(self, seed: int) -> list[Message]:
        """Start an episode; returns the first messages (system and user)."""
        ...

    def step(self, message: Message) -> StepResult:
        """Apply the model's turn ``message`` (an assistant message: its decoded text)."""
        ...


@dataclass(frozen=True, slots=True)
class TokenSequence:
    """One training row of an episode: the ids the generator was first shown and every id
    after them (model turns and environment replies)."""

    prompt: list[int]
    """Ids before the first model turn of this sequence (never trained on)."""
    tokens: list[int]
    """Every id after the prompt: model turns (sampled ids, verbatim) and environment ids."""
    model_mask: list[bool]
    """True on the model's ids (the ones a policy loss trains on)."""
    logprobs: list[float]
    """The generator's log-prob of each model id (0.0 on environment ids)."""


@dataclass(frozen=True, slots=True)
class Episode:
    """One finished episode: its conversation, its token sequences and its rewards.

    An episode is one ``TokenSequence`` unless its context was compacted: every compaction
    starts a new sequence whose prompt is the compacted context (``titan_rl.compaction``),
    since the model turns before it were sampled from the uncompacted one.
    """

    sequences: list[TokenSequence]
    """The training rows (one per compaction + 1)."""
    messages: list[Message]
    """The whole conversation as it happened (compaction instructions and summaries too)."""
    turn_rewards: list[float]
    """The environment's reward of each model turn (0.0 for a summary turn)."""
    weight_versions: list[int]
    """Weight version of each model turn (a push between turns shows up here)."""
    turn_spans: list[tuple[int, int, int]]
    """``(sequence, start, end)`` of each model turn in ``sequences[sequence].tokens``."""
    turn_finish: list[str]
    """Each model turn's end: ``stop`` (its stop token) or ``length`` (``max_new_tokens``
    reached: the turn is closed with the stop token as an environment id, not trained on,
    and handed to the environment as it is)."""
    status: str
    """How it ended: ``done`` (the environment said so), ``max_turns`` or ``context`` (no
    room left for another turn)."""
    reward: float
    """The training reward: the rubric's weighted total (``total_reward`` without one)."""
    reward_breakdown: dict[str, float] = field(default_factory=dict)
    """Each rubric function's score (before weighting)."""
    reward_status: str = ""
    """The last step's ``info["status"]``, ``error`` if a rubric function failed, else
    ``status``."""
    info: dict = field(default_factory=dict)
    """The last step's ``info``."""

    @property
    def total_reward(self) -> float:
        """The sum of the environment's per-turn rewards."""
        return float(sum(self.turn_rewards))

    @property
    def turns(self) -> int:
        """Model turns played."""
        return len(self.weight_versions)

    def _only(self) -> TokenSequence:
        if len(self.sequences) != 1:
            raise ValueError(
                f"this episode was compacted into {len(self.sequences)} token sequences: "
                "read episode.sequences"
            )
        return self.sequences[0]

    @property
    def prompt(self) -> list[int]:
        """The prompt of an uncompacted episode's one sequence."""
        return self._only().prompt

    @property
    def tokens(self) -> list[int]:
        """The ids after the prompt of an uncompacted episode's one sequence."""
        return self._only().tokens

    @property
    def model_mask(self) -> list[bool]:
        """The model mask of an uncompacted episode's one sequence."""
        return self._only().model_mask

    @property
    def logprobs(self) -> list[float]:
        """The generator's log-probs of an uncompacted episode's one sequence."""
        return self._only().logprobs


_CODE_BLOCK = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


class CodeToolEnv:
    """Solve a question; fenced Python blocks run in the sandbox, ``\\boxed{}`` answers end it.

    Each model turn either contains a ```python block (run sandboxed; its stdout, or the error
    status, comes back as a tool message) or a final ``\\boxed{answer}`` scored by
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

    def reset(self, seed: int) -> list[Message]:
        """The question picked by ``seed``, as a user message."""
        question, self._answer = self.questions[seed % len(self.questions)]
        self.last_result = None
        return [Message("user", question)]

    def step(self, message: Message) -> StepResult:
        """Score a ``\\boxed{}`` answer, or run the turn's code block and reply with its
        output as a tool message."""
        if self._answer is None:
            raise RuntimeError("CodeToolEnv.step() before reset()")
        action = message.content
        if "\\boxed{" in action:
            self.last_result = boxed_math_reward(action, self._answer)
            return StepResult((), self.last_result.score, True, {"status": self.last_result.status})
        block = _CODE_BLOCK.search(action)
        if block is None:
            self.last_result = RewardResult(0.0, "unparseable", "neither code nor \\boxed{}")
            return StepResult((), 0.0, True, {"status": "unparseable"})
        run = run_sandboxed(block.group(1), limits=self.limits, isolation=self.isolation)
        shown = run.stdout if run.status == "ok" else f"[{run.status}] {run.stderr[-200:]}"
        reply = Message("tool", f"\n```output\n{shown.strip()}\n```\n", name="python")
        return StepResult([reply], 0.0, False, {"tool": run.status})


def episode_tensors(
    episodes: Sequence[Episode | TokenSequence],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(tokens, model_mask, logprobs)``, each ``(N, T)``, of uncompacted
    ``episodes`` or of token sequences: the ``responses``, ``response_mask`` and rollout
    log-probs that ``titan_rl.sequence_logprobs`` and the losses take."""
    rows = [e._only() if isinstance(e, Episode) else e for e in episodes]
    width = max(1, max(len(r.tokens) for r in rows))
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    logprobs = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        n = len(r.tokens)
        tokens[i, :n] = torch.tensor(r.tokens, dtype=torch.long)
        mask[i, :n] = torch.tensor(r.model_mask, dtype=torch.bool)
        logprobs[i, :n] = torch.tensor(r.logprobs, dtype=torch.float32)
    return tokens, mask, logprobs
