"""Running one function under a policy, on top of ``torch.utils.checkpoint``.

``Full`` is plain non-reentrant checkpointing. ``Selective`` is PyTorch's selective activation
checkpointing (a policy function returning ``CheckpointPolicy`` per ATen op call). ``Offload``
is a ``saved_tensors_hooks`` pair. RNG state is stashed and restored by checkpoint itself, so
dropout in a recomputed region draws the same mask twice.

A unit that writes to a key/value cache cannot be recomputed: the replay in backward would
append its keys and values a second time (transformers' decoder layers, called with
``use_cache=True``, their default). A unit recomputed in backward therefore runs without one,
as transformers' own gradient checkpointing does (``without_cache``).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)

from .offload import OffloadHooks
from .policies import OP_GROUPS, Budget, EveryNth, Full, Offload, Policy, Selective

__all__ = ["checkpoint"]

_T = TypeVar("_T")

# Older torch (< 2.15) has no such switch and lets SAC's cache bypass user hooks; then measure()
# cannot see what Selective caches, which the README states.
ROUTE_SAC_THROUGH_HOOKS: dict[str, Any] = (
    {"respect_saved_tensors_hooks": True}
    if "respect_saved_tensors_hooks"
    in inspect.signature(torch.utils.checkpoint.checkpoint).parameters
    else {}
)


_FULL = Full()


def op_policy(policy: Selective) -> Callable[..., CheckpointPolicy]:
    """A fresh SAC policy function for one forward: counts calls per op to resolve ``op#k``."""
    # Keyed by is_recompute: torch < 2.15 also calls the policy during recomputation.
    calls: dict[bool, defaultdict] = {False: defaultdict(int), True: defaultdict(int)}
    matmuls = {False: 0, True: 0}
    matmul_group = OP_GROUPS["matmul"]

    def decide(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> Any:
        packet = getattr(op, "overloadpacket", None)
        if packet is None:  # a higher-order op: never cache it
            return CheckpointPolicy.PREFER_RECOMPUTE
        counts = calls[ctx.is_recompute]
        k = counts[packet]
        counts[packet] += 1
        tags = op.tags
        if any(m.matches(packet, tags, k) for m in policy._recompute):
            return CheckpointPolicy.MUST_RECOMPUTE
        if torch.Tag.nondeterministic_seeded in tags:
            # A cached random op would not advance the restored RNG during recompute, and every
            # later random op of the unit would draw a different mask: always replay them.
            return CheckpointPolicy.PREFER_RECOMPUTE
        if not any(m.matches(packet, tags, k) for m in policy._save):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if policy.matmul_every > 1 and packet in matmul_group:
            i = matmuls[ctx.is_recompute]
            matmuls[ctx.is_recompute] += 1
            if i % policy.matmul_every:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return decide


def _selective_contexts(policy: Selective) -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(op_policy(policy))


_CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
"""Keyword arguments through which transformers' layers receive a key/value cache (the name
changed across versions and models)."""


def without_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for a unit that will be recomputed: no key/value cache, ``use_cache=False``.

    A cache is a value of one of ``_CACHE_ARGS`` with an ``update`` method (the protocol of
    transformers' ``Cache``: ``update(key_states, value_states, layer_idx)`` appends and
    returns the whole); it is replaced by None, and ``use_cache=True`` by False, with a
    warning. The forward then neither fills nor reads the cache; training does not need it.
    """
    dropped = [k for k in _CACHE_ARGS if callable(getattr(kwargs.get(k), "update", None))]
    if kwargs.get("use_cache") is True:
        dropped.append("use_cache")
    if not dropped:
        return kwargs
    warnings.warn(
        f"torch_remat: a checkpointed unit was called with a key/value cache ({', '.join(dropped)}"
        "); it runs without it, as transformers' own gradient checkpointing does (the recompute "
        "in backward would append to the cache a second time). Pass use_cache=False to the "
        "model when training to silence this.",
        UserWarning,
        stacklevel=1,  # one place: Python's default filter then says it once
    )
    return {**kwargs, **{k: (False if k == "use_cache" else None) for k in dropped}}


def checkpoint(fn: Callable[..., _T], *args: Any, policy: Policy = _FULL, **kwargs: Any) -> _T:
    """``fn(*args, **kwargs)`` with its activations handled by ``policy``.

    ``policy`` is ``Full``, ``Selective`` or ``Offload``; ``EveryNth`` and ``Budget`` choose
    among units and belong to ``apply``. Under ``Full`` and ``Selective``, while autograd
    records, a key/value cache in ``kwargs`` is dropped (see ``without_cache``).
    """
    return run_checkpointed(fn, policy, frozenset(), args, kwargs)


def run_checkpointed(
    fn: Callable[..., _T],
    policy: Policy,
    resident: frozenset | set,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> _T:
    """``checkpoint``; ``resident`` (storage keys) names tensors ``Offload`` must not copy."""
    if isinstance(policy, Offload):
        with OffloadHooks(set(resident)):
            return fn(*args, **kwargs)
    context: dict[str, Any]
    if isinstance(policy, Full):
        context = {}
    elif isinstance(policy, Selective):
        context = {"context_fn": functools.partial(_selective_contexts, policy)}
    elif isinstance(policy, (EveryNth, Budget)):
        raise ValueError(
            f"checkpoint: policy {type(policy).__name__} selects among units; use "
            "torch_remat.apply(model, policy, units=...) (Budget also needs sample_inputs)"
        )
    else:
        raise TypeError(f"checkpoint: policy must be Full, Selective or Offload, got {policy!r}")
    if torch.is_grad_enabled():  # without autograd, checkpoint runs fn once: nothing replays
        kwargs = without_cache(kwargs)
    return torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=False, **context, **ROUTE_SAC_THROUGH_HOOKS, **kwargs
    )
