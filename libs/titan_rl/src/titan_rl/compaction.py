"""Context compaction policies: what a rollout does when an episode's context gets too long.

Before each model turn the rollouter checks ``context + max_new_tokens`` against the policy's
``budget_tokens``; past it the policy applies and the episode continues in a new token
sequence whose prompt is the compacted context (``Episode.sequences``). The model turns
before the compaction stay in the old sequence, with the context they were sampled from,
so every model token is trained on exactly the prefix the generator saw, once:

- ``DropToolOutputs``: the oldest tool outputs are replaced by a short marker (the newest
  ``keep_last`` stay) until the context fits or none is left to drop;
- ``Summarize``: the policy itself writes the summary: the environment asks for it
  (``instruction``), the model's answer is a model turn of the old sequence (trained on,
  like any other), and the new context is the episode's first messages plus the summary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from .messages import ROLES, Message


@dataclass(kw_only=True, slots=True)
class DropToolOutputs:
    """Replace the oldest tool outputs by ``marker`` until the context fits."""

    budget_tokens: int
    """Compact when the context plus ``max_new_tokens`` would pass this many tokens."""
    marker: str = "[dropped]"
    """What a dropped output's content becomes."""
    roles: tuple[str, ...] = ("tool",)
    """Roles whose messages count as tool outputs."""
    keep_last: int = 1
    """The newest outputs never dropped."""

    def __post_init__(self) -> None:
        _check_budget("DropToolOutputs", self.budget_tokens)
        if self.keep_last < 0:
            raise ValueError(f"DropToolOutputs.keep_last={self.keep_last} must be >= 0")
        bad = [r for r in self.roles if r not in ROLES or r == "assistant"]
        if bad or not self.roles:
            raise ValueError(
                f"DropToolOutputs.roles={self.roles!r}: environment roles among system, user, tool"
            )

    def compact(
        self, messages: Sequence[Message], fits: Callable[[list[Message]], bool]
    ) -> list[Message] | None:
        """``messages`` with the oldest outputs replaced, one by one, until ``fits`` or none
        is left to drop; ``None`` when there was nothing to drop."""
        outputs = [i for i, m in enumerate(messages) if m.role in self.roles]
        outputs = outputs[: len(outputs) - self.keep_last] if self.keep_last else outputs
        outputs = [i for i in outputs if messages[i].content != self.marker]
        if not outputs:
            return None
        out = list(messages)
        for i in outputs:
            out[i] = replace(out[i], content=self.marker)
            if fits(out):
                break
        return out


@dataclass(kw_only=True, slots=True)
class Summarize:
    """Ask the policy for a summary, then continue from the first messages plus it."""

    budget_tokens: int
    """Compact when the context plus ``max_new_tokens`` would pass this many tokens (the
    summary turn itself needs ``max_new_tokens`` more: keep the hard limit above)."""
    instruction: str = "Context full. Summarise the facts found so far and what is left to do."
    """The user message that asks for the summary."""
    summary_prefix: str = "Summary so far: "
    """Put before the summary in the new context's user message."""

    def __post_init__(self) -> None:
        _check_budget("Summarize", self.budget_tokens)
        if not self.instruction:
            raise ValueError("Summarize.instruction must be non-empty")

    def request(self) -> Message:
        """The message asking for the summary."""
        return Message("user", self.instruction)

    def compacted(self, first: Sequence[Message], summary: str) -> list[Message]:
        """The new context: the episode's first messages and the summary as a user message."""
        return [*first, Message("user", self.summary_prefix + summary)]


CompactionPolicy = DropToolOutputs | Summarize
"""A compaction policy."""


def _check_budget(name: str, budget: int) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"{name}.budget_tokens={budget!r} must be an int >= 1")
