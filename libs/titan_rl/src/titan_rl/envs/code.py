"""Code: write a small Python function; hidden tests run in the sandbox.

The user asks for ``f`` (``Write f(xs): the sum of the even numbers in xs.``); the model
answers with a ```python block defining it. The program runs in ``titan_rl.run_sandboxed``
and prints ``f``'s result on each hidden input after a random marker; the results are
compared with the expected ones outside the sandbox (the program never sees them). The
reward is the fraction of tests passed; a failed attempt gets the first failing input back,
and another attempt.
"""

from __future__ import annotations

import random
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..environment import StepResult
from ..messages import Message
from ..sandbox import SandboxLimits, run_sandboxed

_CODE_BLOCK = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)

# (task text with {k}, oracle source with {k}, reference function, input maker)
_Problem = tuple[str, str, Callable[..., Any], Callable[[random.Random], tuple]]


def _lists(rng: random.Random) -> tuple:
    return ([rng.randint(-20, 40) for _ in range(rng.randint(0, 6))],)


def _words(rng: random.Random) -> tuple:
    return ("".join(rng.choice("abcdeiou") for _ in range(rng.randint(0, 8))),)


_PROBLEMS: tuple[_Problem, ...] = (
    (
        "Write f(xs): the sum of the numbers in xs divisible by {k}.",
        "def f(xs):\n    return sum(x for x in xs if x % {k} == 0)\n",
        lambda k: lambda xs: sum(x for x in xs if x % k == 0),
        _lists,
    ),
    (
        "Write f(xs): how many numbers in xs are greater than {k}.",
        "def f(xs):\n    return sum(1 for x in xs if x > {k})\n",
        lambda k: lambda xs: sum(1 for x in xs if x > k),
        _lists,
    ),
    (
        "Write f(xs): the largest number in xs, or {k} if xs is empty.",
        "def f(xs):\n    return max(xs) if xs else {k}\n",
        lambda k: lambda xs: max(xs) if xs else k,
        _lists,
    ),
    (
        "Write f(s): s repeated {k} times, reversed.",
        "def f(s):\n    return (s * {k})[::-1]\n",
        lambda k: lambda s: (s * k)[::-1],
        _words,
    ),
    (
        "Write f(s): the number of vowels in s, plus {k}.",
        "def f(s):\n    return sum(c in 'aeiou' for c in s) + {k}\n",
        lambda k: lambda s: sum(c in "aeiou" for c in s) + k,
        _words,
    ),
)


@dataclass(kw_only=True, slots=True)
class CodeConfig:
    """Hidden tests and attempts."""

    num_tests: int = 5
    """Hidden tests per problem."""
    max_attempts: int = 2
    """Answers allowed; a failed one gets the first failing input back."""
    isolation: str = "namespaces"
    """``run_sandboxed``'s isolation (``none`` only for trusted tests)."""

    def __post_init__(self) -> None:
        if self.num_tests < 1:
            raise ValueError(f"CodeConfig.num_tests={self.num_tests} must be >= 1")
        if self.max_attempts < 1:
            raise ValueError(f"CodeConfig.max_attempts={self.max_attempts} must be >= 1")


class CodeEnv:
    """Write ``f``; hidden tests in the sandbox (see the module docstring)."""

    def __init__(self, config: CodeConfig | None = None) -> None:
        """``config``: tests, attempts, sandbox isolation."""
        self.config = config or CodeConfig()
        self.limits = SandboxLimits(wall_time_s=3.0)
        self._tests: list[tuple[tuple, Any]] | None = None

    def problem(self, seed: int) -> tuple[str, str, list[tuple[tuple, Any]]]:
        """Problem ``seed``: ``(task, oracle solution, hidden tests as (args, expected))``."""
        rng = random.Random(seed)
        text, source, reference, inputs = rng.choice(_PROBLEMS)
        k = rng.randint(2, 5)
        fn = reference(k)
        tests = []
        for _ in range(self.config.num_tests):
            args = inputs(rng)
            tests.append((args, fn(*args)))
        return text.format(k=k), source.format(k=k), tests

    def reset(self, seed: int) -> list[Message]:
        """Problem ``seed`` as a user message."""
        text, _, self._tests = self.problem(seed)
        self._attempt = 0
        return [Message("user", text)]

    def run_tests(self, code: str) -> tuple[int, str | None, str]:
        """``(tests passed, feedback on the first failure or None, sandbox status)``."""
        assert self._tests is not None
        marker = secrets.token_hex(8)  # what the harness prints before each result
        calls = "".join(
            f"try:\n    print({marker!r}, repr(f(*{args!r})))\n"
            f"except Exception as e:\n    print({marker!r}, 'error: ' + type(e).__name__)\n"
            for args, _ in self._tests
        )
        run = run_sandboxed(
            code + "\n" + calls, limits=self.limits, isolation=self.config.isolation
        )
        results = [
            line[len(marker) + 1 :]
            for line in run.stdout.splitlines()
            if line.startswith(marker + " ")
        ]
        passed, feedback = 0, None
        for i, (args, want) in enumerate(self._tests):
            got = results[i] if i < len(results) else f"no result ({run.status})"
            if got == repr(want):
                passed += 1
            elif feedback is None:
                shown = ", ".join(repr(a) for a in args)
                feedback = f"f({shown}) gave {got[:60]}, expected {want!r}"
        return passed, feedback, run.status

    def step(self, message: Message) -> StepResult:
        """Run the turn's code on the hidden tests."""
        if self._tests is None:
            raise RuntimeError("CodeEnv.step() before reset()")
        self._attempt += 1
        block = _CODE_BLOCK.search(message.content)
        if block is None:
            return StepResult((), 0.0, True, {"status": "unparseable"})
        passed, feedback, sandbox = self.run_tests(block.group(1))
        score = passed / len(self._tests)
        info = {"passed": passed, "sandbox": sandbox}
        if feedback is None:
            return StepResult((), 1.0, True, {**info, "status": "correct"})
        if self._attempt >= self.config.max_attempts:
            return StepResult((), score, True, {**info, "status": "wrong"})
        return StepResult([Message("user", feedback)], 0.0, False, info)

    def demonstration(self, seed: int) -> list[Message]:
        """The oracle's transcript: the task and a correct solution."""
        text, source, _ = self.problem(seed)
        return [Message("user", text), Message("assistant", f"```python\n{source}```")]
