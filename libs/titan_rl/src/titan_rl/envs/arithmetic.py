"""Tool use: arithmetic word problems with a calculator run in the sandbox.

User: ``Ann has 37 boxes of 48 pens. How many pens?``; the model may call the calculator
(``<calc>37*48</calc>``), whose result comes back as a tool message (``1776``), and answers
with the number (``1776``), scored by exact match. The products are of 2- and 3-digit
numbers: more than a tiny model does in its head, so using the tool is what earns reward.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from ..environment import StepResult
from ..messages import Message
from ..rewards import exact_match_reward
from ..sandbox import SandboxLimits, run_sandboxed
from ._tags import find_tag

_TEMPLATES = (
    ("{n} has {a} boxes of {b} pens. How many pens?", "*"),
    ("{n} buys {a} bags of {b} nuts. How many nuts?", "*"),
    ("{n} reads {b} pages a day for {a} days. How many pages?", "*"),
    ("{n} has {a} coins and finds {b} more. How many coins?", "+"),
    ("{n} had {a} cards and gave away {b}. How many are left?", "-"),
)
_NAMES = ("Ann", "Bob", "Cy", "Dee", "Eve", "Fay", "Gus", "Hal")
_EXPRESSION = re.compile(r"[0-9+\-*/() ]{1,40}")


@dataclass(kw_only=True, slots=True)
class ArithmeticConfig:
    """Problem sizes and the calculator's budget."""

    min_operand: int = 12
    """Smallest operand."""
    max_operand: int = 999
    """Largest operand (2- and 3-digit products by default)."""
    operations: tuple[str, ...] = ("*", "+", "-")
    """Which problem kinds to draw: products (the ones a tiny model cannot do in its head),
    sums, differences."""
    max_tool_calls: int = 2
    """Calculator calls allowed; the turn after the last one must answer."""
    fixed_layout: bool = False
    """Every question in one wording with 3-letter names, so each number sits at the same
    place in every question (use operands of one width too): a small model trained from
    scratch learns to copy at fixed distances long before it can copy at variable ones."""
    isolation: str = "namespaces"
    """``run_sandboxed``'s isolation for the calculator (``none`` only for trusted tests)."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError(
                f"ArithmeticConfig: need 0 <= min_operand ({self.min_operand}) <= max_operand "
                f"({self.max_operand})"
            )
        bad = [op for op in self.operations if op not in ("*", "+", "-")]
        if bad or not self.operations:
            raise ValueError(
                f"ArithmeticConfig.operations={self.operations!r}: a non-empty subset of '*', '+', '-'"
            )
        if self.max_tool_calls < 0:
            raise ValueError(f"ArithmeticConfig.max_tool_calls={self.max_tool_calls} must be >= 0")
        if self.fixed_layout and tuple(self.operations) != ("*",):
            raise ValueError(
                f"ArithmeticConfig.fixed_layout=True words products only: operations must be "
                f"('*',), got {self.operations!r}"
            )


class ArithmeticToolEnv:
    """Word problems; ``<calc>expression</calc>`` runs the calculator, a turn without it is
    the answer (see the module docstring)."""

    def __init__(self, config: ArithmeticConfig | None = None) -> None:
        """``config``: operand range, tool budget, sandbox isolation."""
        self.config = config or ArithmeticConfig()
        self._answer: str | None = None
        self.limits = SandboxLimits(wall_time_s=2.0)

    def problem(self, seed: int) -> tuple[str, str, str]:
        """Problem ``seed``: ``(question, expression, answer)`` (deterministic)."""
        rng = random.Random(seed)
        templates = [t for t in _TEMPLATES if t[1] in self.config.operations]
        if self.config.fixed_layout:
            templates = templates[:1]
        template, op = rng.choice(templates)
        a = rng.randint(self.config.min_operand, self.config.max_operand)
        b = rng.randint(self.config.min_operand, self.config.max_operand)
        if op == "-" and b > a:
            a, b = b, a
        if op == "*" and a > 99 and b > 99:  # one 2-digit factor keeps the answer short
            b = b % 90 + 10
        names = [n for n in _NAMES if len(n) == 3] if self.config.fixed_layout else _NAMES
        question = template.format(n=rng.choice(names), a=a, b=b)
        expression = f"{a}{op}{b}"
        value = {"*": a * b, "+": a + b, "-": a - b}[op]
        return question, expression, str(value)

    def reset(self, seed: int) -> list[Message]:
        """Problem ``seed`` as a user message."""
        question, _, self._answer = self.problem(seed)
        self._calls = 0
        return [Message("user", question)]

    def calculate(self, expression: str) -> str:
        """The calculator: ``expression`` (digits, ``+-*/()`` and spaces) evaluated in the
        sandbox; ``error`` for anything else or any failure."""
        if not _EXPRESSION.fullmatch(expression.strip()):
            return "error"
        run = run_sandboxed(
            f"print({expression.strip()})", limits=self.limits, isolation=self.config.isolation
        )
        return run.stdout.strip() if run.status == "ok" and run.stdout.strip() else "error"

    def step(self, message: Message) -> StepResult:
        """Run a calculator call, or score the answer."""
        if self._answer is None:
            raise RuntimeError("ArithmeticToolEnv.step() before reset()")
        expression = find_tag(message.content, "calc")
        if expression is not None and self._calls < self.config.max_tool_calls:
            self._calls += 1
            result = self.calculate(expression)
            return StepResult([Message("tool", result, name="calc")], 0.0, False, {"tool": result})
        if expression is not None:
            return StepResult((), 0.0, True, {"status": "unparseable", "tool_calls": self._calls})
        result = exact_match_reward(message.content, self._answer)
        return StepResult(
            (), result.score, True, {"status": result.status, "tool_calls": self._calls}
        )

    def demonstration(self, seed: int, *, use_tool: bool = True) -> list[Message]:
        """The oracle's transcript: a calculator call, its result, the answer; or, with
        ``use_tool=False``, the answer straight away (in-head)."""
        question, expression, answer = self.problem(seed)
        convo = [Message("user", question)]
        if use_tool:
            convo += [
                Message("assistant", f"<calc>{expression}</calc>"),
                Message("tool", answer, name="calc"),
            ]
        return [*convo, Message("assistant", answer)]
