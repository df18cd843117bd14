"""A ready-made ``Task``: text problems ``(prompt, answer)`` from a function of the index,
scored by exact match.

The problems come from the caller (the app's arithmetic corpus, a dataset, a list), so the
same generator can make a pre-training corpus and the RL prompts without either side
importing the other.
"""

from __future__ import annotations

from collections.abc import Callable

from .rewards import RewardResult, exact_match_reward
from .rollout import Prompt
from .tokenizer import Tokenizer


class ExactMatchTask:
    """Prompts ``BOS + prompt`` (the layout of a pre-training document ``prompt + answer``),
    a response scored 1 for the exact answer followed by EOS."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        problem: Callable[[int], tuple[str, str]],
        *,
        digit_credit: float = 0.0,
    ) -> None:
        """``problem(i)``: the ``(prompt, answer)`` of the ``i``-th prompt handed out
        (deterministic).

        ``digit_credit``: a wrong integer answer of the right length scores this times the
        fraction of its digits that are right (0: plain exact match; the reward stays < 1
        unless the answer is exact, so exact-match accuracy is still what is maximised).
        """
        if not callable(problem):
            raise TypeError(
                f"problem must be a callable index -> (prompt, answer), got {problem!r}"
            )
        if not 0.0 <= digit_credit < 1.0:
            raise ValueError(f"digit_credit={digit_credit} must be in [0, 1)")
        self.tokenizer, self.problem, self.digit_credit = tokenizer, problem, digit_credit

    def prompts(self, start: int, count: int) -> list[Prompt]:
        """Prompts ``start .. start + count - 1``."""
        out = []
        for i in range(start, start + count):
            prompt, answer = self.problem(i)
            out.append(Prompt([self.tokenizer.bos_id, *self.tokenizer.encode(prompt)], answer))
        return out

    def score(self, prompt: Prompt, response_ids: list[int]) -> RewardResult:
        """1 for the exact answer followed by EOS, else 0 (``unparseable``: not an integer)."""
        if self.tokenizer.eos_id not in response_ids:
            return RewardResult(0.0, "truncated", "no EOS within the token budget")
        text = self.completion_text(response_ids).strip()
        result = exact_match_reward(text, prompt.answer)
        if result.status == "wrong" and self.digit_credit and len(text) == len(prompt.answer):
            right = sum(a == b for a, b in zip(text, prompt.answer, strict=True))
            return RewardResult(self.digit_credit * right / len(text), "wrong", result.detail)
        return result

    def completion_text(self, response_ids: list[int]) -> str:
        """The decoded response up to (not including) the first EOS."""
        eos = self.tokenizer.eos_id
        ids = response_ids[: response_ids.index(eos)] if eos in response_ids else response_ids
        return self.tokenizer.decode(ids)
