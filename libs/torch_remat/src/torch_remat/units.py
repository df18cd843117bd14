"""Choosing the units of a model and wrapping each one's forward under its policy.

Wrapping sets an instance ``forward`` on the unit, so module names, ``state_dict`` keys,
hooks and parameter types (plain or DTensor) are untouched.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from .checkpoint import run_checkpointed
from .fqn import fqn_matches
from .measure import model_storage_keys
from .policies import Budget, EveryNth, Full, Offload, Policy, Selective, UnitPolicies

__all__ = ["apply", "remove"]

Units = str | Sequence[str | nn.Module] | None
"""A glob over module FQNs (``fqn_matches``: ``layers.*`` is each block), a list of FQNs/globs/
modules, or None: the blocks of every ModuleList."""

_ATTR = "_torch_remat_policy"

OnHFCheckpointing = Literal["warn", "raise"]
_ON_HF = ("warn", "raise")


def _hf_checkpointing_modules(unit: nn.Module) -> list[nn.Module]:
    """Modules in ``unit`` (itself included) carrying transformers' ``gradient_checkpointing``
    flag (``GradientCheckpointingLayer`` and models that support it); read by attribute so
    that torch_remat never imports transformers."""
    return [
        m for m in unit.modules() if isinstance(getattr(m, "gradient_checkpointing", None), bool)
    ]


class _HFCheck:
    """transformers' gradient checkpointing on inside the units of one ``apply``: the inner
    (transformers') checkpoint recomputes the unit whatever the outer policy saved. Warns once
    per ``apply``, or raises."""

    def __init__(self, on_hf: str) -> None:
        self.on_hf = on_hf
        self.warned = False

    def quiet(self) -> bool:
        return self.warned and self.on_hf == "warn"

    def __call__(
        self, units: list[tuple[str, list[nn.Module]]], *, at_forward: bool, stacklevel: int
    ) -> None:
        on = [
            (name, m)
            for name, flagged in units
            for m in flagged
            if m.gradient_checkpointing and (m.training or not at_forward)
        ]
        if not on or self.quiet():
            return
        names = sorted({n for n, _ in on})
        msg = (
            f"transformers' gradient checkpointing is also on in remat unit(s) {names[:4]}"
            f"{f' and {len(names) - 4} more' if len(names) > 4 else ''} "
            f"({type(on[0][1]).__name__}.gradient_checkpointing=True): the checkpoints nest. "
            f"transformers recomputes the whole unit in backward whatever the remat policy "
            f"keeps, so what a Selective policy saves is memory spent for nothing, and with "
            f"use_reentrant=True the unit's forward runs three times per step. Turn one off: "
            f"model.activation_checkpointing_disable() or TrainingArguments("
            f"gradient_checkpointing=False) (TRL's default is True), or torch_remat.remove(model)"
        )
        if self.on_hf == "raise":
            raise ValueError(f"{msg}; apply(..., on_hf_checkpointing='warn') only warns")
        self.warned = True
        warnings.warn(msg, stacklevel=stacklevel + 1)


def resolve_units(model: nn.Module, units: Units) -> list[tuple[str, nn.Module]]:
    """The units in module order, each once; a pattern or module that matches nothing is an error."""
    named = [(n, m) for n, m in model.named_modules() if n]
    if units is None:
        found = {
            f"{n}.{c}" if n else c
            for n, m in model.named_modules()
            if isinstance(m, nn.ModuleList)
            for c, _ in m.named_children()
        }
        if not found:
            raise ValueError(
                "units: the model has no nn.ModuleList to take blocks from; pass units= "
                "as an FQN glob (e.g. 'layers.*') or a list of modules"
            )
        chosen = [(n, m) for n, m in named if n in found]
    else:
        items = [units] if isinstance(units, str) else list(units)
        wanted: set[str] = set()
        for item in items:
            if isinstance(item, nn.Module):
                hit = [n for n, m in named if m is item]
                what = f"module {type(item).__name__}"
            elif isinstance(item, str):
                hit = [n for n, _ in named if fqn_matches(item, n)]
                what = f"pattern {item!r}"
            else:
                raise TypeError(f"units: expected FQN globs or modules, got {item!r}")
            if not hit:
                raise ValueError(f"units: {what} matches no submodule of {type(model).__name__}")
            wanted.update(hit)
        chosen = [(n, m) for n, m in named if n in wanted]
    names = [n for n, _ in chosen]
    for a in names:
        for b in names:
            if b.startswith(a + "."):
                raise ValueError(f"units: {b!r} is inside unit {a!r}; units must not nest")
    return chosen


def _resolve_policies(
    units: list[tuple[str, nn.Module]], policy: UnitPolicies
) -> dict[str, Policy | None]:
    """Each unit's own policy; EveryNth counts among the units it was given to."""
    if isinstance(policy, Mapping):
        unused = set(policy)
        chosen: dict[str, Policy | None] = {}
        for name, _ in units:
            key = next((k for k in policy if fqn_matches(k, name)), None)
            if key is not None:
                unused.discard(key)
                chosen[name] = policy[key]
        if unused:
            raise ValueError(
                f"policy: keys {sorted(unused)} match none of the units {[n for n, _ in units]}"
            )
    elif callable(policy) and not isinstance(policy, (Full, Selective, Offload, EveryNth, Budget)):
        chosen = {name: policy(name) for name, _ in units}
    else:
        chosen = {name: policy for name, _ in units}
    seen: dict[int, int] = {}
    for name, p in chosen.items():
        if p is not None and not isinstance(p, (Full, Selective, Offload, EveryNth, Budget)):
            raise TypeError(f"policy for unit {name!r}: expected a torch_remat policy, got {p!r}")
        if isinstance(p, EveryNth):
            i = seen.get(id(p), 0)
            seen[id(p)] = i + 1
            chosen[name] = p.inner if i % p.n == 0 else None
    return chosen


def _wrap(module: nn.Module, name: str, policy: Policy, hf_check: _HFCheck) -> None:
    inner = module.forward
    # transformers enables its checkpointing late (a Trainer does it inside train()), so the
    # flag is read again at each forward that autograd records.
    mine = [(name, _hf_checkpointing_modules(module))]

    def forward(*args: Any, **kwargs: Any) -> Any:
        if mine[0][1] and torch.is_grad_enabled() and not hf_check.quiet():
            hf_check(mine, at_forward=True, stacklevel=2)
        resident = model_storage_keys(module) if isinstance(policy, Offload) else frozenset()
        return run_checkpointed(inner, policy, resident, args, kwargs)

    module.forward = forward
    setattr(module, _ATTR, policy)


def apply(
    model: nn.Module,
    policy: UnitPolicies,
    units: Units = None,
    *,
    sample_inputs: Sequence[object] | None = None,
    sample_kwargs: Mapping[str, object] | None = None,
    on_hf_checkpointing: OnHFCheckpointing = "warn",
) -> dict[str, Policy | None]:
    """Wrap each unit of ``model`` (in place) under its policy; returns FQN -> policy applied.

    ``policy`` is one policy for all units, a dict from unit FQN (or glob) to policy, or a
    function of the FQN (None leaves a unit alone). ``Budget`` runs ``plan`` on
    ``model(*sample_inputs, **sample_kwargs)`` and applies the per-unit ``Selective``
    policies it chooses. A unit recomputed in backward runs without a key/value cache (see
    ``checkpoint``). A unit in which transformers' gradient checkpointing is also on (a
    ``gradient_checkpointing=True`` module, now or at a later training forward) gets a warning,
    or a ValueError with ``on_hf_checkpointing="raise"``.
    """
    if on_hf_checkpointing not in _ON_HF:
        raise ValueError(
            f"apply: on_hf_checkpointing must be one of {_ON_HF}, got {on_hf_checkpointing!r}"
        )
    chosen_units = resolve_units(model, units)
    for name, module in chosen_units:
        if hasattr(module, _ATTR):
            raise ValueError(f"apply: unit {name!r} already has a remat policy; remove() it first")
    resolved = _resolve_policies(chosen_units, policy)
    modules = dict(chosen_units)
    hf_check = _HFCheck(on_hf_checkpointing)
    hf_check(
        [(n, _hf_checkpointing_modules(modules[n])) for n, p in resolved.items() if p is not None],
        at_forward=False,
        stacklevel=2,
    )
    budgets = {name: p for name, p in resolved.items() if isinstance(p, Budget)}
    if budgets:
        if len(set(budgets.values())) > 1 or len(budgets) != len(chosen_units):
            raise ValueError("policy: Budget is one budget over all units; give it alone")
        if sample_inputs is None and sample_kwargs is None:
            raise ValueError(
                "apply: Budget needs sample_inputs= and/or sample_kwargs= to profile one forward"
            )
        from .planner import plan

        budget = next(iter(budgets.values()))
        chosen = plan(model, sample_inputs or (), budget, units=units, sample_kwargs=sample_kwargs)
        resolved = dict(chosen.policies)
    for name, p in resolved.items():
        if p is not None:
            _wrap(modules[name], name, p, hf_check)
    return resolved


def remove(model: nn.Module) -> list[str]:
    """Undo ``apply`` on every wrapped unit of ``model``; returns their FQNs."""
    removed = []
    for name, module in model.named_modules():
        if hasattr(module, _ATTR):
            del module.forward
            delattr(module, _ATTR)
            removed.append(name)
    return removed


def wrapped_units(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if hasattr(m, _ATTR)]
