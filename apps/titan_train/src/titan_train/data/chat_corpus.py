"""The built-in chat corpora (``--data.source chat --data.chat-environment NAME``): endless,
deterministic, generated offline, with answers a small model can learn exactly.

- ``digits``: one or two user turns, each a task on five digits — ``reverse: 4 9 1 7 0``,
  ``sort: ...`` or ``max: ...`` — and the assistant's exact answer (``0 7 1 9 4``). The
  answer is a function of the question alone, so a held-out conversation (another index) has
  one right reply and greedy exact match measures what SFT learned (``llama3_debug_sft``).
- every multi-turn RL environment of ``titan_train.environments`` (``sorting``,
  ``tool_calc``, ``search``, ``code``): its scripted solver's transcripts, the starting run
  of its RL recipe.

Conversation ``i`` of corpus seed ``s`` is drawn from ``s * 10**7 + i``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

__all__ = ["DIGIT_TASKS", "builtin_conversations", "corpus_names", "digits_conversation"]

_SEED_STRIDE = 10**7
DIGIT_TASKS = ("reverse", "sort", "max")
"""The ``digits`` corpus's tasks."""


def digits_conversation(problem: int) -> list[Any]:
    """Conversation ``problem`` of the ``digits`` corpus (``titan_rl.Message`` turns)."""
    from titan_rl import Message

    rng = random.Random(problem)
    messages = []
    for _ in range(rng.choice((1, 2))):
        task = rng.choice(DIGIT_TASKS)
        digits = [str(rng.randrange(10)) for _ in range(5)]
        if task == "reverse":
            answer = " ".join(reversed(digits))
        elif task == "sort":
            answer = " ".join(sorted(digits))
        else:
            answer = max(digits)
        messages += [Message("user", f"{task}: {' '.join(digits)}"), Message("assistant", answer)]
    return messages


_GENERATED: dict[str, Callable[[int], list[Any]]] = {"digits": digits_conversation}


def corpus_names() -> list[str]:
    """Every built-in corpus: the generated ones and the RL environments'."""
    from titan_train.environments import ENVIRONMENTS

    return sorted([*_GENERATED, *ENVIRONMENTS])


def builtin_conversations(name: str, seed: int) -> Callable[[int], list[Any]]:
    """Index -> conversation of the built-in corpus ``name`` for corpus seed ``seed``;
    ``ValueError`` naming the known corpora."""
    from titan_train.environments import ENVIRONMENTS, get_environment

    if name in _GENERATED:
        make = _GENERATED[name]
        return lambda i: make(seed * _SEED_STRIDE + i)
    if name in ENVIRONMENTS:
        return get_environment(name).demonstrations(seed)
    raise ValueError(
        f"data.chat_environment={name!r} is not a built-in chat corpus; known: "
        f"{', '.join(corpus_names())}"
    )
