"""The built-in arithmetic corpus: problems generated from ``(seed, index)`` and their answers.

One generator for both uses: the pre-training documents (``sources.DocumentSource``) and the
RL task of ``titan-train rl`` (a ``titan_rl.ExactMatchTask`` over ``arithmetic_problem``), so
a model pre-trained on the corpus is post-trained on the same distribution; a held-out split
is just another seed (and, to make it harder, larger operands).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import NamedTuple


class Problem(NamedTuple):
    """One arithmetic problem: ``prompt`` (e.g. ``"17+25="``) and its ``answer`` (``"42"``);
    a ``(prompt, answer)`` pair, as ``titan_rl.ExactMatchTask`` takes them."""

    prompt: str
    answer: str

    @property
    def text(self) -> str:
        """The training document: prompt followed by the answer."""
        return self.prompt + self.answer


def arithmetic_problem(
    seed: int,
    index: int,
    *,
    max_operand: int = 99,
    slip_rate: float = 0.0,
    reverse_answer: bool = False,
) -> Problem:
    """The ``index``-th problem of the corpus for ``seed`` (addition, subtraction, small products).

    ``slip_rate``: the chance that a ``+`` or ``-`` problem's answer is written with the
    systematic slip of :func:`slip_answer` instead of the true one (a corpus with a competing
    wrong rule; 0 gives the clean corpus, bit for bit: no extra random draw is made).
    ``reverse_answer``: write every answer least-significant digit first (``"47+38="`` ->
    ``"58"``), the order in which the digits are computed; the prompts are unchanged.
    """
    if not 0.0 <= slip_rate <= 1.0:
        raise ValueError(f"slip_rate={slip_rate} must be in [0, 1]")
    rng = random.Random(seed * 1_000_003 + index)
    op = rng.choice("++-*")
    if op == "*":
        a, b = rng.randint(0, 12), rng.randint(0, 12)
        return Problem(f"{a}*{b}=", _written(str(a * b), reverse_answer))
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    if op == "-":
        a, b = max(a, b), min(a, b)
    slipped = slip_rate > 0.0 and rng.random() < slip_rate
    answer = slip_answer(a, op, b) if slipped else str(a + b if op == "+" else a - b)
    return Problem(f"{a}{op}{b}=", _written(answer, reverse_answer))


def _written(answer: str, reverse: bool) -> str:
    return answer[::-1] if reverse else answer


def slip_answer(a: int, op: str, b: int) -> str:
    """The slip rule's answer: carry-less ``+``, borrow-less ``-`` (two classic school bugs).

    Column by column, ``+`` writes ``(x + y) mod 10`` and drops every carry (``47+38`` ->
    ``"75"``, ``67+58`` -> ``"15"``); ``-`` writes ``|x - y|``, the smaller digit taken from
    the larger, never borrowing (``52-17`` -> ``"45"``). Leading zeros are dropped. Where no
    column carries or borrows, the slip equals the true answer.
    """
    if op not in ("+", "-") or a < 0 or b < 0:
        raise ValueError(f"slip_answer({a}, {op!r}, {b}): needs op '+' or '-' and a, b >= 0")
    width = max(len(str(a)), len(str(b)))
    xs, ys = str(a).zfill(width), str(b).zfill(width)
    if op == "+":
        digits = [(int(x) + int(y)) % 10 for x, y in zip(xs, ys, strict=True)]
    else:
        digits = [abs(int(x) - int(y)) for x, y in zip(xs, ys, strict=True)]
    return str(int("".join(map(str, digits))))


def answer_breakdown(
    problems: Sequence[Problem], answers: Sequence[str], *, reverse_answer: bool = False
) -> dict[str, float]:
    """Exact-match accuracy overall and per operator, and how often the slip rule was written.

    ``reverse_answer``: the problems' answers (and so the slips) are written digits reversed.

    Keys: ``accuracy``, ``accuracy_+``, ``accuracy_-``, ``accuracy_*`` (an operator with no
    problem is left out); over the ``+`` / ``-`` problems where :func:`slip_answer` differs from
    the true answer: ``slip_where_rules_differ`` (share answered with the slip) and
    ``true_where_rules_differ``; ``slip_share_of_wrong``: the share of wrong answers that are
    the slip (over all problems; 0 when none is wrong).
    """
    if len(problems) != len(answers) or not problems:
        raise ValueError(
            f"answer_breakdown: {len(problems)} problems and {len(answers)} answers; "
            "need equal, non-zero counts"
        )
    right: dict[str, list[bool]] = {"+": [], "-": [], "*": []}
    slip_hits = true_hits = differ = wrong = wrong_slip = 0
    for problem, answer in zip(problems, answers, strict=True):
        body = problem.prompt.removesuffix("=")
        op = next(c for c in "+-*" if c in body)
        ok = answer.strip() == problem.answer
        right[op].append(ok)
        slip = None
        if op != "*":
            a, b = (int(x) for x in body.split(op))
            slip = _written(slip_answer(a, op, b), reverse_answer)
        if slip is not None and slip != problem.answer:
            differ += 1
            slip_hits += answer.strip() == slip
            true_hits += ok
        if not ok:
            wrong += 1
            wrong_slip += slip is not None and answer.strip() == slip
    out = {"accuracy": sum(sum(v) for v in right.values()) / len(problems)}
    out.update({f"accuracy_{op}": sum(v) / len(v) for op, v in right.items() if v})
    if differ:
        out["slip_where_rules_differ"] = slip_hits / differ
        out["true_where_rules_differ"] = true_hits / differ
    out["slip_share_of_wrong"] = wrong_slip / wrong if wrong else 0.0
    return out
