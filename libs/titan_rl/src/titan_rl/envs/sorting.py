"""Multi-turn sorting with feedback: the model sorts words; the environment says which
positions are wrong, until the order is right or the attempts run out."""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..environment import StepResult
from ..messages import Message

# fmt: off
WORDS = (
    "ant", "bee", "cat", "dog", "eel", "fox", "gnu", "hen", "ibis", "jay", "kiwi", "lark", "mole",
    "newt", "owl", "pig", "quail", "rat", "seal", "toad", "urchin", "vole", "wasp", "yak", "zebra",
)
# fmt: on
"""The vocabulary the words are drawn from (short, distinct initials for a byte model)."""


@dataclass(kw_only=True, slots=True)
class SortingConfig:
    """The size of a sorting problem and how it is rewarded."""

    min_words: int = 3
    """Fewest words in a problem."""
    max_words: int = 5
    """Most words in a problem."""
    max_attempts: int = 3
    """Answers allowed before the episode ends unsolved."""
    attempt_penalty: float = 0.25
    """Reward lost per extra attempt: solving on attempt ``k`` scores ``1 - penalty*(k-1)``."""

    def __post_init__(self) -> None:
        if not 2 <= self.min_words <= self.max_words <= len(WORDS):
            raise ValueError(
                f"SortingConfig: need 2 <= min_words ({self.min_words}) <= max_words "
                f"({self.max_words}) <= {len(WORDS)}"
            )
        if self.max_attempts < 1:
            raise ValueError(f"SortingConfig.max_attempts={self.max_attempts} must be >= 1")
        if not 0.0 <= self.attempt_penalty * (self.max_attempts - 1) < 1.0:
            raise ValueError(
                f"SortingConfig.attempt_penalty={self.attempt_penalty}: the last attempt must "
                "still score > 0 (penalty * (max_attempts - 1) < 1)"
            )


class SortingEnv:
    """User: ``sort: yak ant owl``; assistant: ``ant owl yak``; a wrong order gets
    ``wrong: 2 3`` (1-based positions) from the user, and another attempt."""

    def __init__(self, config: SortingConfig | None = None) -> None:
        """``config``: problem sizes and rewards (defaults: 3-5 words, 3 attempts)."""
        self.config = config or SortingConfig()
        self._words: list[str] | None = None

    def problem(self, seed: int) -> list[str]:
        """The words of problem ``seed`` (deterministic), in the order shown."""
        rng = random.Random(seed)
        n = rng.randint(self.config.min_words, self.config.max_words)
        return rng.sample(WORDS, n)

    def reset(self, seed: int) -> list[Message]:
        """Problem ``seed`` as a user message."""
        self._words, self._attempt = self.problem(seed), 0
        return [Message("user", "sort: " + " ".join(self._words))]

    def feedback(self, answer: str) -> str | None:
        """``None`` when ``answer`` is the sorted order, else the user's feedback."""
        assert self._words is not None
        got, want = answer.split(), sorted(self._words)
        if got == want:
            return None
        if sorted(got) != want:
            return "use exactly these words: " + " ".join(self._words)
        return "wrong: " + " ".join(
            str(i + 1) for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b
        )

    def step(self, message: Message) -> StepResult:
        """Score the attempt: solved, feedback, or out of attempts."""
        if self._words is None:
            raise RuntimeError("SortingEnv.step() before reset()")
        self._attempt += 1
        feedback = self.feedback(message.content)
        if feedback is None:
            reward = 1.0 - self.config.attempt_penalty * (self._attempt - 1)
            return StepResult((), reward, True, {"status": "correct", "attempts": self._attempt})
        if self._attempt >= self.config.max_attempts:
            status = "unparseable" if feedback.startswith("use") else "wrong"
            return StepResult((), 0.0, True, {"status": status, "attempts": self._attempt})
        return StepResult([Message("user", feedback)], 0.0, False)

    def demonstration(self, seed: int, *, mistakes: int = 0) -> list[Message]:
        """A transcript from the oracle; with ``mistakes``, it first answers with that many
        adjacent pairs swapped and then fixes them from the feedback."""
        env = SortingEnv(self.config)  # this environment's episode is left as it is
        convo = env.reset(seed)
        want = sorted(env.problem(seed))
        rng = random.Random(seed + 1)
        for _ in range(min(mistakes, self.config.max_attempts - 1)):
            wrong = list(want)
            i = rng.randrange(len(wrong) - 1)
            wrong[i], wrong[i + 1] = wrong[i + 1], wrong[i]
            attempt = Message("assistant", " ".join(wrong))
            convo += [attempt, *env.step(attempt).messages]
        return [*convo, Message("assistant", " ".join(want))]
