"""Remat policies: what a unit keeps for backward, what it recomputes, what it offloads.

A policy is a small frozen dataclass; nothing here touches a model. Op names are resolved to
ATen overload packets once, at construction, so a typo fails before any forward runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

__all__ = [
    "OP_GROUPS",
    "Budget",
    "EveryNth",
    "Full",
    "Offload",
    "Policy",
    "Selective",
    "UnitPolicies",
]


def _packets(*names: str) -> frozenset[torch._ops.OpOverloadPacket]:
    # Not every build has every kernel (e.g. _grouped_mm, cudnn attention): keep those it has.
    return frozenset(getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n))


OP_GROUPS: dict[str, frozenset[torch._ops.OpOverloadPacket]] = {
    # What a dense or MoE transformer's compute-bound ops dispatch to (after linear/matmul
    # decompose), on CPU and on CUDA.
    "matmul": _packets("mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm"),
    "attention": _packets(
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    ),
}
"""Named op groups usable in ``Selective``; ``"pointwise"`` (ATen's pointwise tag) also works."""

_POINTWISE = "pointwise"
_OCCURRENCE = re.compile(r"^(?P<name>[A-Za-z0-9_.]+)#(?P<k>\d+)$")


@dataclass(frozen=True, slots=True)
class _OpMatcher:
    """A resolved op name: a group, the pointwise tag, or one overload packet (and call index)."""

    name: str
    packets: frozenset[torch._ops.OpOverloadPacket] = frozenset()
    pointwise: bool = False
    occurrence: int | None = None

    def matches(self, packet: torch._ops.OpOverloadPacket, tags: tuple, occurrence: int) -> bool:
        if self.occurrence is not None and occurrence != self.occurrence:
            return False
        if self.pointwise:
            return torch.Tag.pointwise in tags
        return packet in self.packets


def _resolve_op(spec: str, field_name: str) -> _OpMatcher:
    """``"matmul"``, ``"pointwise"``, ``"mm"``, ``"aten.mm"``, ``"aten.mm.default"`` or ``"mm#3"``."""
    if not isinstance(spec, str):
        raise TypeError(f"{field_name}: op names are strings, got {spec!r} ({type(spec).__name__})")
    occurrence = None
    m = _OCCURRENCE.match(spec)
    name = spec
    if m is not None:
        name, occurrence = m["name"], int(m["k"])
    if name in OP_GROUPS:
        return _OpMatcher(spec, OP_GROUPS[name], occurrence=occurrence)
    if name == _POINTWISE:
        return _OpMatcher(spec, pointwise=True, occurrence=occurrence)
    parts = name.split(".")
    if parts[0] == "aten":
        parts = parts[1:]
    packet = getattr(torch.ops.aten, parts[0], None) if len(parts) in (1, 2) else None
    if not isinstance(packet, torch._ops.OpOverloadPacket) or (
        len(parts) == 2 and parts[1] not in packet.overloads()
    ):
        groups = ", ".join(sorted([*OP_GROUPS, _POINTWISE]))
        raise ValueError(
            f"{field_name}: unknown op {spec!r}; use an ATen op name such as 'mm', "
            f"'aten.addmm' or 'mm#2' (its third call in the unit), or a group: {groups}"
        )
    return _OpMatcher(spec, frozenset({packet}), occurrence=occurrence)


@dataclass(frozen=True, slots=True)
class Full:
    """Checkpoint the whole unit: keep only its inputs, recompute everything in backward."""


@dataclass(frozen=True, slots=True)
class Selective:
    """Per-op selective checkpointing: save the outputs of ``save`` ops, recompute the rest.

    ``Selective(save=("matmul", "attention"), matmul_every=2)`` is the classic "save every other
    matmul": of the unit's matmul calls (in call order) the 1st, 3rd, 5th... are saved.
    ``"op#k"`` names the k-th call (0-based) of that op inside one forward of the unit; the
    planner speaks in those names.
    """

    save: tuple[str, ...] = ("matmul", "attention")
    """Ops whose outputs are kept (MUST_SAVE): ATen names, ``op#k`` calls or groups."""
    recompute: tuple[str, ...] = ()
    """Ops always recomputed (MUST_RECOMPUTE), even when a compiler would rather save them."""
    matmul_every: int = 1
    """Save one in every ``matmul_every`` matmul calls that ``save`` selects (2: every other)."""
    _save: tuple[_OpMatcher, ...] = field(init=False, repr=False, compare=False)
    _recompute: tuple[_OpMatcher, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("save", "recompute"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            object.__setattr__(self, name, tuple(value))
        if not isinstance(self.matmul_every, int) or self.matmul_every < 1:
            raise ValueError(
                f"Selective.matmul_every: must be an int >= 1, got {self.matmul_every!r}"
            )
        both = sorted(set(self.save) & set(self.recompute))
        if both:
            raise ValueError(f"Selective: ops {both} are in both save and recompute")
        object.__setattr__(
            self, "_save", tuple(_resolve_op(s, "Selective.save") for s in self.save)
        )
        object.__setattr__(
            self, "_recompute", tuple(_resolve_op(s, "Selective.recompute") for s in self.recompute)
        )


@dataclass(frozen=True, slots=True)
class Offload:
    """Keep every saved activation, but in host memory: copied out in forward, back in backward.

    On CUDA the host copies go to pinned memory with non-blocking copies. Parameters and buffers
    are never offloaded (they stay resident anyway).
    """


@dataclass(frozen=True, slots=True)
class EveryNth:
    """Apply ``inner`` to every ``n``-th unit (units 0, n, 2n... in order); leave the rest alone."""

    n: int
    """Frequency: 1 wraps every unit, 2 every other one."""
    inner: Policy = field(default_factory=Full)
    """What the selected units get."""

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"EveryNth.n: must be an int >= 1, got {self.n!r}")
        if isinstance(self.inner, (EveryNth, Budget)):
            raise ValueError(
                f"EveryNth.inner: must be Full, Selective or Offload, got {type(self.inner).__name__}"
            )


@dataclass(frozen=True, slots=True)
class Budget:
    """Save as much as fits in a memory budget, recomputing the cheapest rest; see ``plan``.

    ``limit`` is bytes (an int) or a fraction of the no-remat saved-activation bytes (a float in
    (0, 1]). The bytes counted are those ``measure`` reports as ``saved_bytes``.
    """

    limit: int | float
    """Bytes (int > 0) or a fraction of the no-remat saved bytes (0 < float <= 1)."""

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, (int, float)):
            raise TypeError(f"Budget.limit: bytes (int) or fraction (float), got {self.limit!r}")
        if isinstance(self.limit, float) and not 0.0 < self.limit <= 1.0:
            raise ValueError(f"Budget.limit: a fraction must be in (0, 1], got {self.limit!r}")
        if isinstance(self.limit, int) and self.limit <= 0:
            raise ValueError(f"Budget.limit: bytes must be > 0, got {self.limit!r}")


Policy = Full | Selective | Offload | EveryNth | Budget
"""Any one policy."""

UnitPolicies = Policy | Mapping[str, Policy | None] | Callable[[str], Policy | None]
"""One policy for every unit, a map from unit FQN (or glob) to policy, or a function of the FQN."""
