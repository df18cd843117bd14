"""A built-in corpus generated on the fly: arithmetic problems with their answers.

Document ``i`` depends only on ``(seed, i)``, so any rank can produce any slice of the corpus
without coordination and a resumed run sees exactly the documents it would have seen. A small
model learns the format within tens of steps and the arithmetic over a few hundred; RL reuses
the same problems with verifiable answers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


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
