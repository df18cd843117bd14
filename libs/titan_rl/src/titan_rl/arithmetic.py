"""The built-in arithmetic task: problems generated from ``(seed, index)`` and their answers.

``arithmetic_problem`` is the generator of the app's pre-training corpus (same outputs for the
same arguments), so a model pre-trained on that corpus is post-trained on the same
distribution; a held-out split is just another seed (and, to make it harder, larger operands).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .rewards import RewardResult, exact_match_reward
from .rollout import Prompt
from .tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Problem:
    """One arithmetic problem: ``prompt`` (e.g. ``"17+25="``) and its ``answer`` (``"42"``)."""

    prompt: str
    answer: str

    @property
    def text(self) -> str:
        """The training document: prompt followed by the answer."""
        return self.prompt + self.answer


def arithmetic_problem(seed: int, index: int, *, max_operand: int = 99) -> Problem:
    """The ``index``-th problem of the corpus for ``seed`` (addition, subtraction, small products)."""
    rng = random.Random(seed * 1_000_003 + index)
    op = rng.choice("++-*")
    if op == "*":
        a, b = rng.randint(0, 12), rng.randint(0, 12)
        return Problem(f"{a}*{b}=", str(a * b))
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    if op == "-":
        a, b = max(a, b), min(a, b)
        return Problem(f"{a}-{b}=", str(a - b))
    return Problem(f"{a}+{b}=", str(a + b))


class ArithmeticTask:
    """Prompts ``BOS + "a+b="`` (the pre-training document layout) scored by exact match."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        seed: int = 0,
        max_operand: int = 99,
        offset: int = 0,
        digit_credit: float = 0.0,
    ) -> None:
        """Problem ``offset + i`` of ``seed`` is the ``i``-th prompt handed out.

        ``digit_credit``: a wrong integer answer of the right length scores this times the
        fraction of its digits that are right (0: plain exact match; the reward stays < 1
        unless the answer is exact, so exact-match accuracy is still what is maximised).
        """
        if max_operand < 1:
            raise ValueError(f"max_operand={max_operand} must be >= 1")
        if not 0.0 <= digit_credit < 1.0:
            raise ValueError(f"digit_credit={digit_credit} must be in [0, 1)")
        self.tokenizer = tokenizer
        self.seed, self.max_operand, self.offset = seed, max_operand, offset
        self.digit_credit = digit_credit

    def problem(self, index: int) -> Problem:
        """The ``index``-th problem of this task."""
        return arithmetic_problem(self.seed, self.offset + index, max_operand=self.max_operand)

    def prompts(self, start: int, count: int) -> list[Prompt]:
        """Prompts ``start .. start + count - 1``."""
        out = []
        for i in range(start, start + count):
            p = self.problem(i)
            out.append(Prompt([self.tokenizer.bos_id, *self.tokenizer.encode(p.prompt)], p.answer))
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
