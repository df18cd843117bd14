"""Actions and schedules: the one representation that is generated, validated, simulated, run.

An action is ``(kind, stage, microbatch)``. A schedule is one ordered action list per rank
plus the stage -> rank mapping. Communication conventions (the same as
``torch.distributed.pipelining``):

* ``SEND_F(s, m)`` sends the output of stage ``s`` to the rank of stage ``s + 1``;
  ``RECV_F(s, m)`` receives the input of stage ``s`` from the rank of stage ``s - 1``.
* ``SEND_B(s, m)`` sends the gradient of the input of stage ``s`` to the rank of stage
  ``s - 1``; ``RECV_B(s, m)`` receives the gradient of the output of stage ``s`` from the rank
  of stage ``s + 1``.

Consecutive communication actions in a rank's list form one batch (one
``batch_isend_irecv`` call). Each (source rank, destination rank, kind, stage) is its own
in-order channel (its own P2P tag).

Text form, one rank per line (``#`` starts a comment)::

    rank 0: F0.0 F0.1 SEND_F0.0 ...        # KIND<stage>.<microbatch>
    stage_to_rank: 0 1 1 0                 # optional; default stage s on rank s % num_ranks

CSV form: a header ``rank,kind,stage,microbatch`` then one action per row, in order.
"""

from __future__ import annotations

import csv
import enum
import io
import re
from dataclasses import dataclass

__all__ = ["Action", "ActionKind", "Schedule"]


class ActionKind(enum.Enum):
    """What an action does. ``B`` is a full backward; ``I`` + ``W`` split it in two."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the name used by the zero-bubble paper
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        """True for F, B, I and W."""
        return self in _COMPUTE

    @property
    def is_send(self) -> bool:
        """True for SEND_F and SEND_B."""
        return self in (ActionKind.SEND_F, ActionKind.SEND_B)


_COMPUTE = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W})
_ACTION_RE = re.compile(r"^(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)\.(\d+)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: ``kind`` on ``stage`` for ``microbatch``."""

    kind: ActionKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.stage}.{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse ``KIND<stage>.<microbatch>``, e.g. ``F0.3`` or ``SEND_B2.1``."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(
                f"action {text!r} is not of the form KIND<stage>.<microbatch> with KIND one of "
                f"{[k.value for k in ActionKind]}, e.g. 'F0.3'"
            )
        return cls(ActionKind(match[1]), int(match[2]), int(match[3]))


@dataclass(frozen=True, slots=True)
class Schedule:
    """Per-rank ordered action lists for one training step."""

    name: str
    """Schedule name (``gpipe``, ``1f1b``, ... or ``custom``)."""
    num_microbatches: int
    """Number of microbatches of the step."""
    stage_to_rank: tuple[int, ...]
    """Rank that holds each stage; its length is the number of stages."""
    actions: tuple[tuple[Action, ...], ...]
    """``actions[rank]`` is the ordered list that ``rank`` executes."""

    @property
    def num_ranks(self) -> int:
        """Number of pipeline ranks."""
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        """Number of stages (over all ranks)."""
        return len(self.stage_to_rank)

    def stages_of_rank(self, rank: int) -> list[int]:
        """The stage indices held by ``rank``, ascending."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def compute_only(self) -> tuple[tuple[Action, ...], ...]:
        """Per-rank lists without the communication actions."""
        return tuple(tuple(a for a in acts if a.kind.is_compute) for acts in self.actions)

    def to_text(self) -> str:
        """The text form (see the module docstring); ``from_text`` reads it back."""
        lines = [f"# {self.name}: {self.num_microbatches} microbatches"]
        lines.append("stage_to_rank: " + " ".join(map(str, self.stage_to_rank)))
        for rank, acts in enumerate(self.actions):
            lines.append(f"rank {rank}: " + " ".join(map(str, acts)))
        return "\n".join(lines) + "\n"

    def to_csv(self) -> str:
        """The CSV form: ``rank,kind,stage,microbatch`` rows in execution order."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["rank", "kind", "stage", "microbatch"])
        for rank, acts in enumerate(self.actions):
            for a in acts:
                writer.writerow([rank, a.kind.value, a.stage, a.microbatch])
        return out.getvalue()

    @classmethod
    def from_text(cls, text: str, *, name: str = "custom") -> Schedule:
        """Read the text form. Communication actions may be omitted: see ``add_communication``."""
        per_rank: dict[int, list[Action]] = {}
        stage_to_rank: tuple[int, ...] | None = None
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            head, sep, body = line.partition(":")
            if not sep:
                raise ValueError(f"line {lineno}: expected 'rank N: actions...', got {raw!r}")
            head = head.strip()
            if head == "stage_to_rank":
                stage_to_rank = tuple(_parse_int(x, lineno) for x in body.split())
                continue
            words = head.split()
            if len(words) != 2 or words[0] != "rank":
                raise ValueError(f"line {lineno}: expected 'rank N: actions...', got {raw!r}")
            rank = _parse_int(words[1], lineno)
            if rank in per_rank:
                raise ValueError(f"line {lineno}: rank {rank} is listed twice")
            per_rank[rank] = [Action.parse(w) for w in body.split()]
        return _assemble(per_rank, stage_to_rank, name)

    @classmethod
    def from_csv(cls, text: str, *, name: str = "custom") -> Schedule:
        """Read the CSV form (header ``rank,kind,stage,microbatch``); stages map ``s % ranks``."""
        rows = list(csv.reader(io.StringIO(text)))
        if not rows or [c.strip() for c in rows[0]] != ["rank", "kind", "stage", "microbatch"]:
            raise ValueError("CSV schedule: the header must be 'rank,kind,stage,microbatch'")
        per_rank: dict[int, list[Action]] = {}
        for lineno, row in enumerate(rows[1:], 2):
            if not row:
                continue
            if len(row) != 4:
                raise ValueError(f"CSV line {lineno}: expected 4 fields, got {row!r}")
            rank, kind, stage, mb = (c.strip() for c in row)
            per_rank.setdefault(_parse_int(rank, lineno), []).append(
                Action.parse(f"{kind}{stage}.{mb}")
            )
        return _assemble(per_rank, None, name)


def _parse_int(text: str, lineno: int) -> int:
    if not text.isdigit():
        raise ValueError(f"line {lineno}: expected a non-negative integer, got {text!r}")
    return int(text)


def _assemble(
    per_rank: dict[int, list[Action]], stage_to_rank: tuple[int, ...] | None, name: str
) -> Schedule:
    if not per_rank:
        raise ValueError("schedule text lists no rank")
    num_ranks = max(per_rank) + 1
    missing = sorted(set(range(num_ranks)) - set(per_rank))
    if missing:
        raise ValueError(f"schedule text lists no actions for rank(s) {missing}")
    all_actions = [a for acts in per_rank.values() for a in acts]
    num_stages = max(a.stage for a in all_actions) + 1
    if stage_to_rank is None:
        stage_to_rank = tuple(s % num_ranks for s in range(num_stages))
    num_microbatches = max(a.microbatch for a in all_actions) + 1
    actions = tuple(tuple(per_rank[r]) for r in range(num_ranks))
    return Schedule(name, num_microbatches, stage_to_rank, actions)
