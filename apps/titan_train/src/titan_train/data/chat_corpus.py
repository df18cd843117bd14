"""The built-in chat corpora (``--data.source chat --data.chat-environment NAME``): endless,
deterministic, generated offline, with answers a small model can learn exactly.

- ``digits``: one or two user turns, each a task on four digits — ``reverse: 4 9 1 7``,
  ``first: ...`` or ``last: ...`` — and the assistant's exact answer (``7 1 9 4``). The
  answer is a function of the question alone, so a held-out conversation (another index) has
  one right reply and greedy exact match measures what SFT learned (``llama3_debug_sft``).
- ``facts``: one to three questions drawn uniformly from the 157 facts of fixed tables
  (capitals, opposites, the next weekday, sums of two digits), in two wordings: held-out
  conversations are new combinations of known facts, so exact match measures that SFT
  learned the answers and the turn structure (``llama3_debug_sft``).
- every multi-turn RL environment of ``titan_train.environments`` (``sorting``,
  ``tool_calc``, ``search``, ``code``): its scripted solver's transcripts, the starting run
  of its RL recipe.

Conversation ``i`` of corpus seed ``s`` is drawn from ``s * 10**7 + i``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

__all__ = [
    "DIGIT_TASKS",
    "builtin_conversations",
    "corpus_names",
    "digits_conversation",
    "facts_conversation",
]

_SEED_STRIDE = 10**7
DIGIT_TASKS = ("reverse", "first", "last")
"""The ``digits`` corpus's tasks."""


def digits_conversation(problem: int) -> list[Any]:
    """Conversation ``problem`` of the ``digits`` corpus (``titan_rl.Message`` turns)."""
    from titan_rl import Message

    rng = random.Random(problem)
    messages = []
    for _ in range(rng.choice((1, 2))):
        task = rng.choice(DIGIT_TASKS)
        digits = [str(rng.randrange(10)) for _ in range(4)]
        if task == "reverse":
            answer = " ".join(reversed(digits))
        elif task == "first":
            answer = digits[0]
        else:
            answer = digits[-1]
        messages += [Message("user", f"{task}: {' '.join(digits)}"), Message("assistant", answer)]
    return messages


_CAPITALS = dict(
    France="Paris", Spain="Madrid", Italy="Rome", Germany="Berlin", Poland="Warsaw",
    Greece="Athens", Egypt="Cairo", Kenya="Nairobi", Japan="Tokyo", China="Beijing",
    India="Delhi", Peru="Lima", Chile="Santiago", Cuba="Havana", Canada="Ottawa",
    Norway="Oslo", Sweden="Stockholm", Austria="Vienna", Ireland="Dublin", Portugal="Lisbon",
    Russia="Moscow", Turkey="Ankara", Iran="Tehran", Iraq="Baghdad", Ghana="Accra",
    Mali="Bamako", Nepal="Kathmandu", Laos="Vientiane", Fiji="Suva", Qatar="Doha",
)  # fmt: skip
_OPPOSITES = dict(
    hot="cold", big="small", up="down", left="right", fast="slow", old="new", dark="light",
    early="late", full="empty", hard="soft", high="low", long="short", open="closed",
    rich="poor", wet="dry", strong="weak", thick="thin", loud="quiet", near="far", true="false",
)  # fmt: skip
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def _facts() -> list[tuple[str, str]]:
    """Every (question, answer) of the ``facts`` tables: 30 capitals, 20 opposites, 7
    weekdays and the 100 sums of two digits."""
    return [
        *((f"What is the capital of {k}?", v) for k, v in sorted(_CAPITALS.items())),
        *((f"What is the opposite of {k}?", v) for k, v in sorted(_OPPOSITES.items())),
        *((f"Which day comes after {d}?", _DAYS[(i + 1) % 7]) for i, d in enumerate(_DAYS)),
        *((f"What is {a} + {b}?", str(a + b)) for a in range(10) for b in range(10)),
    ]


_FACTS = _facts()


def facts_conversation(problem: int) -> list[Any]:
    """Conversation ``problem`` of the ``facts`` corpus: one to three questions, each drawn
    uniformly from the 157 facts of fixed tables (capitals, opposites, the next weekday, sums
    of two digits: every fact equally often, so no table is learned later for being larger)
    and asked in one of two wordings."""
    from titan_rl import Message

    rng = random.Random(problem)
    messages = []
    for _ in range(rng.randint(1, 3)):
        question, answer = rng.choice(_FACTS)
        if rng.random() < 0.5:
            question = "Please tell me: " + question
        messages += [Message("user", question), Message("assistant", answer)]
    return messages


_GENERATED: dict[str, Callable[[int], list[Any]]] = {
    "digits": digits_conversation,
    "facts": facts_conversation,
}


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
