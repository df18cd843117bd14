"""The built-in multi-turn environments (titan_rl's ``envs``) as the app uses them: the
chat-SFT corpus of each one's demonstrations (``--data.source chat --data.chat-environment
NAME``, the starting run of its RL recipe) and its episodes in ``titan-train rl``.

A demonstration is the environment's scripted oracle solving problem ``i``; the corpus is
an endless, deterministic stream of them (problem ``i`` of corpus seed ``s`` is the
environment's problem ``s * 10**7 + i``, so RL prompts — other seeds — are problems the
starting run never saw). ``tool_calc``'s demonstrations answer in the head on 70 % of the
problems (usually wrongly: products of 2-digit numbers) and call the calculator on 30 %, and
a third of its corpus is copy drills: RL then has a skill to learn from the reward — to use
the tool.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_SEED_STRIDE = 10**7


@dataclass(frozen=True, slots=True)
class EnvironmentSpec:
    """One built-in environment."""

    summary: str
    """One line for listings."""
    make: Callable[[], Any]
    """A fresh environment (a ``titan_rl.Environment`` with ``demonstration``)."""
    demonstration: Callable[[Any, int], list[Any]]
    """``demonstration(env, problem)``: the corpus's transcript of ``problem``."""
    max_new_tokens: int
    """Most tokens of one model turn."""
    max_turns: int
    """Most model turns of an episode."""

    def demonstrations(self, seed: int) -> Callable[[int], list[Any]]:
        """Problem index -> the corpus's conversation (corpus seed ``seed``)."""
        env = self.make()
        return lambda i: self.demonstration(env, seed * _SEED_STRIDE + i)


def _sorting() -> Any:
    from titan_rl.envs import SortingEnv

    return SortingEnv()


def _tool_calc() -> Any:
    from titan_rl.envs import ArithmeticConfig, ArithmeticToolEnv

    # Products of 2-digit numbers (4-digit answers: more than a tiny model does in its head),
    # worded alike so each number sits at a fixed place: a from-scratch tiny model learns to
    # copy at fixed distances quickly, at variable ones not within a CPU budget.
    config = ArithmeticConfig(min_operand=32, max_operand=99, operations=("*",), fixed_layout=True)
    return ArithmeticToolEnv(config)


def _search() -> Any:
    from titan_rl.envs import SearchEnv

    return SearchEnv()


def _code() -> Any:
    from titan_rl.envs import CodeEnv

    return CodeEnv()


TOOL_SHARE = 0.3
"""Share of ``tool_calc``'s demonstrations that call the calculator (the rest answer in the
head)."""
DRILL_SHARE = 1 / 3
"""Share of ``tool_calc``'s corpus that is copy drills: a from-scratch tiny model has no
copying skill (which a tool call needs: the numbers go from the question into the call, the
result from the tool into the answer), and learns it from demonstrations alone only slowly."""


def _tool_demo(env: Any, problem: int) -> list[Any]:
    from titan_rl import Message

    draw = random.Random(problem).random()
    if draw < DRILL_SHARE:  # "repeat: <a problem>" -> the problem, verbatim
        question = env.reset(problem)[0].content
        return [Message("user", f"repeat: {question}"), Message("assistant", question)]
    use_tool = (draw - DRILL_SHARE) / (1 - DRILL_SHARE) < TOOL_SHARE
    return env.demonstration(problem, use_tool=use_tool)


def _plain_demo(env: Any, problem: int) -> list[Any]:
    return env.demonstration(problem)


ENVIRONMENTS: dict[str, EnvironmentSpec] = {
    "sorting": EnvironmentSpec(
        "sort words; the environment says which positions are wrong (multi-turn feedback)",
        _sorting,
        _plain_demo,
        max_new_tokens=48,
        max_turns=3,
    ),
    "tool_calc": EnvironmentSpec(
        "arithmetic word problems with a calculator tool run in the sandbox",
        _tool_calc,
        _tool_demo,
        max_new_tokens=24,
        max_turns=3,
    ),
    "search": EnvironmentSpec(
        "questions about a generated corpus: BM25 search, read, answer (Search-R1 style)",
        _search,
        _plain_demo,
        max_new_tokens=32,
        max_turns=4,
    ),
    "code": EnvironmentSpec(
        "write a function; hidden tests run in the sandbox",
        _code,
        _plain_demo,
        max_new_tokens=96,
        max_turns=2,
    ),
}


def get_environment(name: str) -> EnvironmentSpec:
    """The built-in environment ``name`` (an error naming the choices otherwise)."""
    if name not in ENVIRONMENTS:
        raise ValueError(
            f"environment {name!r} is unknown; built-in environments: "
            f"{', '.join(sorted(ENVIRONMENTS))}"
        )
    return ENVIRONMENTS[name]
