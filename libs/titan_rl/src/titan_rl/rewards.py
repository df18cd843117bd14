"""Verifiable rewards: exact match, boxed-answer math, and code run in a sandboxed subprocess.

Every reward returns a ``RewardResult`` whose ``status`` says why it scored what it did, so a
run can tell "the model is wrong" from "the answer could not be read" from "the code crashed".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from .sandbox import SandboxLimits, run_sandboxed

_INTEGER = re.compile(r"[+-]?\d+")


@dataclass(frozen=True, slots=True)
class RewardResult:
    """A scalar reward and the reason for it."""

    score: float
    status: str
    """``correct``, ``wrong``, ``unparseable``, ``truncated``, ``error`` (the reward function
    raised), or a sandbox outcome: ``timeout``, ``memory``, ``crashed``, ``output_limit``."""
    detail: str = ""


def exact_match_reward(completion: str, answer: str) -> RewardResult:
    """1 when ``completion`` (stripped) is exactly ``answer``; non-integers are ``unparseable``."""
    text = completion.strip()
    if text == answer.strip():
        return RewardResult(1.0, "correct")
    if not _INTEGER.fullmatch(text):
        return RewardResult(0.0, "unparseable", f"not an integer: {text[:40]!r}")
    return RewardResult(0.0, "wrong", f"{text} != {answer}")


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` in ``text`` (nested braces allowed), else ``None``."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: the answer was cut off


def boxed_math_reward(completion: str, answer: str) -> RewardResult:
    r"""1 when the last ``\boxed{}`` equals ``answer`` (as numbers when both parse, else as text).

    No box, or an unbalanced one, is ``unparseable`` (reported apart from ``wrong``).
    """
    boxed = last_boxed(completion)
    if boxed is None:
        return RewardResult(0.0, "unparseable", "no complete \\boxed{...}")
    got, want = _normalise(boxed), _normalise(answer)
    got_num, want_num = _as_number(got), _as_number(want)
    same = got_num == want_num if got_num is not None and want_num is not None else got == want
    return RewardResult(1.0, "correct") if same else RewardResult(0.0, "wrong", f"{got} != {want}")


def _normalise(text: str) -> str:
    text = text.strip().strip("$").replace(" ", "").replace("\\!", "").replace(",", "")
    text = re.sub(r"\\(?:text|mathrm)\{([^}]*)\}", r"\1", text)
    return re.sub(r"\\[dt]?frac\{([^}]*)\}\{([^}]*)\}", r"\1/\2", text)


def _as_number(text: str) -> Fraction | None:
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def code_reward(
    code: str,
    tests: list[tuple[str, str]],
    *,
    limits: SandboxLimits | None = None,
    isolation: str = "namespaces",
) -> RewardResult:
    """Fraction of ``(stdin, expected stdout)`` tests the program passes, each run sandboxed.

    A test passes when the run exits 0 and its stdout, stripped, equals the expected one. The
    status is ``correct`` (all pass), ``wrong``, or the first failing run's sandbox status.
    ``isolation`` is passed to ``run_sandboxed``.
    """
    if not tests:
        raise ValueError("tests must hold at least one (stdin, expected_stdout) pair")
    passed, first_failure = 0, None
    for stdin, expected in tests:
        result = run_sandboxed(code, stdin=stdin, limits=limits, isolation=isolation)
        if result.status == "ok" and result.stdout.strip() == expected.strip():
            passed += 1
        elif first_failure is None:
            first_failure = result
    if first_failure is None:
        return RewardResult(1.0, "correct")
    status = "wrong" if first_failure.status == "ok" else first_failure.status
    return RewardResult(passed / len(tests), status, first_failure.stderr[-200:])
