"""The memory-budget planner: which op outputs to keep so saved activations fit a budget.

In eager selective checkpointing the backward replays the unit's forward in order and each
cached op is skipped, so recompute time is additive over ops: a unit costs the sum of the
times of the ops it does not save. Memory is the union of the storages the saved outputs hold
(a view keeps its base alive, two outputs sharing a storage count once), on top of what every
unit keeps anyway under ``Full`` (its inputs) and what the code outside units saves. That is a
knapsack; a greedy by time saved per byte, which then takes any further item that still fits,
fills the budget at op granularity.

Profiling runs forwards only (no backward) on the sample inputs: one without remat to learn the
total, then three with every unit checkpointed and a dispatch mode timing and recording each op
the selective-checkpoint machinery will see (an op's cost is its fastest time). The RNG state
is restored afterwards.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import SAC_IGNORED_OPS

from .checkpoint import ROUTE_SAC_THROUGH_HOOKS, without_cache
from .measure import (
    Ledger,
    StorageKey,
    check_inputs,
    model_storage_keys,
    on_accelerator,
    saved_bytes_of_forward,
    storage_keys,
    tensor_storages,
)
from .policies import Budget, Full, Policy, Selective
from .units import Units, resolve_units, wrapped_units

__all__ = ["Plan", "PlanRow", "plan"]


_PROFILE_RUNS = 3


@dataclass(slots=True)
class _OpCall:
    unit: str
    name: str  # "mm#3": the 4th aten.mm call of this unit's forward
    seconds: float
    storages: list[tuple[StorageKey, int]]
    savable: bool = True


class _Recorder(TorchDispatchMode):
    """Times each op the SAC machinery would see and records its output storages."""

    def __init__(self, unit: str, calls: list[_OpCall], keep: list[object]) -> None:
        super().__init__()
        self.unit = unit
        self.calls = calls
        self.keep = keep
        self.counts: dict[object, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - t0
        packet = func.overloadpacket
        k = self.counts[packet]
        self.counts[packet] += 1
        storages = [
            s for t in tree_leaves(out) if isinstance(t, torch.Tensor) for s in tensor_storages(t)
        ]
        # Held until planning ends so that no storage address is reused within the profile.
        self.keep.append(out)
        self.calls.append(
            _OpCall(
                self.unit,
                f"{packet.__name__}#{k}",
                seconds,
                storages,
                # Only ATen ops can be named in Selective; random ops are always replayed.
                func.namespace == "aten" and torch.Tag.nondeterministic_seeded not in func.tags,
            )
        )
        if func._schema.is_mutable:
            mutated = storage_keys(
                args[i] if i < len(args) else kwargs.get(a.name)
                for i, a in enumerate(func._schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write
            )
            # SAC refuses a cached tensor mutated afterwards: never plan to cache those.
            for call in self.calls:
                if any(key in mutated for key, _ in call.storages):
                    call.savable = False
        return out


def _profile(
    model: nn.Module, inputs: tuple, kwargs: dict, units: list[tuple[str, nn.Module]]
) -> tuple[list[_OpCall], Ledger, list[object]]:
    """One forward with every unit fully checkpointed, recording each unit's ops."""
    calls: list[_OpCall] = []
    keep: list[object] = []
    originals = {}

    def wrap(name: str, module: nn.Module) -> None:
        inner = module.forward
        originals[name] = module

        def contexts():
            return _Recorder(name, calls, keep), contextlib.nullcontext()

        def forward(*args, **kwargs):
            # as the unit will run under its policy: the op stream SAC sees (op#k) must match
            kwargs = without_cache(kwargs)
            return torch.utils.checkpoint.checkpoint(
                inner,
                *args,
                use_reentrant=False,
                context_fn=contexts,
                **ROUTE_SAC_THROUGH_HOOKS,
                **kwargs,
            )

        module.forward = forward

    for name, module in units:
        wrap(name, module)
    try:
        ledger, out = saved_bytes_of_forward(model, inputs, kwargs)
        keep.append(out)
    finally:
        for module in originals.values():
            del module.forward
    return calls, ledger, keep


@dataclass(frozen=True, slots=True)
class PlanRow:
    """One op call of one unit and what the planner decided for it."""

    unit: str
    op: str
    bytes: int
    """Bytes saving it adds (0 when its storage is already kept)."""
    seconds: float
    """Measured forward time of the call: what recomputing it costs."""
    save: bool


@dataclass(frozen=True, slots=True)
class Plan:
    """A planned policy per unit and the table that explains it; ``print(plan)`` shows both."""

    budget_bytes: int
    total_bytes: int
    """Saved-activation bytes without any remat (what ``measure`` reports)."""
    min_bytes: int
    """Saved bytes with every unit under ``Full``: the smallest budget that fits."""
    planned_bytes: int
    """Saved bytes the plan predicts (``<= budget_bytes``)."""
    recompute_seconds: float
    """Forward time of the ops the plan recomputes (``Full`` would recompute all of them)."""
    full_recompute_seconds: float
    policies: dict[str, Policy | None] = field(default_factory=dict)
    rows: tuple[PlanRow, ...] = ()

    def table(self, *, max_rows: int | None = None) -> str:
        """The decision table: unit, op call, bytes, recompute cost, decision."""
        mib = 2.0**20
        lines = [
            f"budget {self.budget_bytes / mib:.2f} MiB | no remat {self.total_bytes / mib:.2f} MiB"
            f" | all Full {self.min_bytes / mib:.2f} MiB | planned {self.planned_bytes / mib:.2f}"
            f" MiB | recompute {self.recompute_seconds * 1e3:.2f} ms of"
            f" {self.full_recompute_seconds * 1e3:.2f} ms",
            f"{'unit':<24} {'op':<36} {'bytes':>12} {'cost ms':>9}  decision",
        ]
        rows = self.rows if max_rows is None else self.rows[:max_rows]
        for r in rows:
            lines.append(
                f"{r.unit:<24} {r.op:<36} {r.bytes:>12d} {r.seconds * 1e3:>9.3f}  "
                f"{'save' if r.save else 'recompute'}"
            )
        if len(rows) < len(self.rows):
            lines.append(f"... {len(self.rows) - len(rows)} more rows")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _fork_rng(model: nn.Module):
    """Restore the host's RNG and that of every accelerator device the model is on."""
    on = {p.device for p in model.parameters() if on_accelerator(p.device)}
    if not on:
        return torch.random.fork_rng(devices=[])
    devices = sorted(d.index if d.index is not None else 0 for d in on)
    return torch.random.fork_rng(devices=devices, device_type=next(iter(on)).type)


def plan(
    model: nn.Module,
    sample_inputs: Sequence[object],
    budget: Budget | int | float,
    *,
    units: Units = None,
    sample_kwargs: Mapping[str, object] | None = None,
) -> Plan:
    """Choose, per unit and per op call, what to save so saved activations fit ``budget``.

    The model is profiled on ``model(*sample_inputs, **sample_kwargs)`` (forwards only).

    ``budget`` is a ``Budget`` or its ``limit`` (bytes, or a fraction of the no-remat saved
    bytes). Budgets at or above the no-remat total leave every unit alone. Raises ValueError for
    a budget above the total (in bytes) or below what ``Full`` on every unit needs.
    """
    budget = budget if isinstance(budget, Budget) else Budget(budget)
    chosen_units = resolve_units(model, units)
    if wrapped_units(model):
        raise ValueError(
            f"plan: units {wrapped_units(model)} already have remat policies; plan an unwrapped model"
        )
    inputs, kwargs = check_inputs("plan", sample_inputs, sample_kwargs)
    with _fork_rng(model), torch.enable_grad():
        total_ledger, out = saved_bytes_of_forward(model, inputs, kwargs)
        del out
        total = sum(total_ledger.resident.values())
        if isinstance(budget.limit, float):
            limit = int(budget.limit * total)
        elif budget.limit > total:
            raise ValueError(
                f"Budget.limit: {budget.limit} bytes is larger than the no-remat saved bytes "
                f"({total}) of this model on these inputs"
            )
        else:
            limit = budget.limit
        # Op times are the fastest of a few forwards: the first pays one-time costs, and on a
        # shared machine any single run is noisy. Storages come from the last run, kept alive.
        calls, fixed, keep = _profile(model, inputs, kwargs, chosen_units)
        times = [c.seconds for c in calls]
        for _ in range(_PROFILE_RUNS - 1):
            calls, fixed, keep = _profile(model, inputs, kwargs, chosen_units)
            times = list(map(min, times, (c.seconds for c in calls)))
        for call, t in zip(calls, times, strict=True):
            call.seconds = t
    min_bytes = sum(fixed.resident.values())
    if limit < min_bytes:
        raise ValueError(
            f"Budget.limit: {limit} bytes is below {min_bytes}, the saved bytes with every unit "
            f"fully checkpointed (no remat: {total}); give a larger budget or more units"
        )
    full_seconds = sum(c.seconds for c in calls)
    if limit >= total:
        rows = tuple(PlanRow(c.unit, c.name, 0, c.seconds, True) for c in calls)
        del keep
        return Plan(
            limit,
            total,
            min_bytes,
            total,
            0.0,
            full_seconds,
            dict.fromkeys((n for n, _ in chosen_units), None),
            rows,
        )

    held: set[StorageKey] = set(fixed.resident)
    excluded = model_storage_keys(model) | storage_keys(tree_leaves((inputs, kwargs)))
    used = min_bytes

    def extra(call: _OpCall) -> int:
        return sum(n for k, n in dict(call.storages).items() if k not in held and k not in excluded)

    order = sorted(
        (c for c in calls if c.savable), key=lambda c: c.seconds / max(extra(c), 1), reverse=True
    )
    decided: dict[int, int] = {}
    for call in order:
        add = extra(call)
        if used + add <= limit:
            decided[id(call)] = add
            used += add
            held.update(k for k, _ in call.storages)
    del keep
    rows = tuple(
        PlanRow(c.unit, c.name, decided.get(id(c), extra(c)), c.seconds, id(c) in decided)
        for c in calls
    )
    policies: dict[str, Policy | None] = {}
    for name, _ in chosen_units:
        saved = tuple(r.op for r in rows if r.unit == name and r.save)
        policies[name] = Selective(save=saved) if saved else Full()
    recompute = sum(r.seconds for r in rows if not r.save)
    return Plan(limit, total, min_bytes, used, recompute, full_seconds, policies, rows)
