"""``with region(policy):`` — remat for a span of code, not a function.

A span cannot be re-run from Python, so the region records it instead: a dispatch mode writes
each ATen call (op, arguments) to a tape while saved-tensor hooks replace every tensor the span
produced with a reference into that tape. The first unpack in backward replays the tape once,
below autograd, from the RNG state the region started with, and serves every reference from
the replay; ``Selective`` keeps the outputs of its ``save`` ops in the tape so the replay
skips them. Tensors that came from outside the span (parameters, the span's inputs) are saved
as usual. Eager only: under ``torch.compile`` use ``apply`` or ``checkpoint``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, SelectiveCheckpointContext

from .checkpoint import op_policy
from .measure import record_held
from .offload import OffloadHooks
from .policies import Full, Offload, Policy, Selective

__all__ = ["region"]

_Key = tuple[int, int | torch.SymInt, tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]


def _key(t: torch.Tensor) -> _Key:
    """What identifies a tensor's value across Python wrappers: memory, geometry, dtype."""
    return (
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
        t.device,
    )


class _Ref:
    """Output ``leaf`` of tape entry ``op``."""

    __slots__ = ("leaf", "op")

    def __init__(self, op: int, leaf: int) -> None:
        self.op = op
        self.leaf = leaf


def _accelerator_rng() -> tuple[str | None, list[torch.Tensor] | None]:
    """The accelerator's device type and the RNG states of its devices, if it has been
    initialised (asking does not initialise it)."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is None:
        return None, None
    module = torch.get_device_module(accelerator.type)
    if not getattr(module, "is_initialized", lambda: True)():
        return accelerator.type, None
    return accelerator.type, module.get_rng_state_all()


class _Tape(TorchDispatchMode):
    def __init__(self, decide: Callable[..., Any] | None) -> None:
        super().__init__()
        self.decide = decide
        self.entries: list[tuple[Any, Any, Any]] = []  # (op, args/kwargs with _Refs, out spec)
        self.kept: dict[int, list[Any]] = {}
        self.produced: dict[_Key, _Ref] = {}
        self.cpu_rng = torch.get_rng_state()
        self.device_type, self.device_rng = _accelerator_rng()
        self.replayed: dict[int, list[Any]] | None = None
        self.pending = 0

    def _ref_or_value(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        ref = self.produced.get(_key(x))
        if ref is None:  # from outside the span: the tape holds it until backward
            record_held(x)
            return x
        return ref

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in SAC_IGNORED_OPS:
            return out
        i = len(self.entries)
        leaves, spec = tree_flatten(out)
        self.entries.append((func, tree_map(self._ref_or_value, (args, kwargs)), spec))
        for j, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                self.produced[_key(leaf)] = _Ref(i, j)
        if self.decide is not None:
            policy = self.decide(SelectiveCheckpointContext(is_recompute=False), func, *args)
            if policy in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
                self.kept[i] = [x.detach() if isinstance(x, torch.Tensor) else x for x in leaves]
                for x in self.kept[i]:
                    if isinstance(x, torch.Tensor):
                        record_held(x)
        return out

    def pack(self, t: torch.Tensor) -> Any:
        ref = self.produced.get(_key(t))
        if ref is None:
            return t
        self.pending += 1
        return ref

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Ref):
            return packed
        if self.replayed is None:
            self.replayed = self._replay()
        value = self.replayed[packed.op][packed.leaf]
        self.pending -= 1
        if self.pending <= 0:  # every reference served: drop the replay
            self.replayed = None
        return value

    def _replay(self) -> dict[int, list[Any]]:
        values: dict[int, list[Any]] = {}

        def resolve(x: Any) -> Any:
            return values[x.op][x.leaf] if isinstance(x, _Ref) else x

        devices = list(range(len(self.device_rng))) if self.device_rng is not None else []
        fork = torch.random.fork_rng(devices=devices, device_type=self.device_type)
        with fork, torch.no_grad():
            torch.set_rng_state(self.cpu_rng)
            if self.device_rng is not None:
                torch.get_device_module(self.device_type).set_rng_state_all(self.device_rng)
            for i, (func, (args, kwargs), _) in enumerate(self.entries):
                if i in self.kept:
                    values[i] = self.kept[i]
                    continue
                out = func(*tree_map(resolve, args), **tree_map(resolve, kwargs))
                values[i] = tree_flatten(out)[0]
        return values


@contextlib.contextmanager
def region(policy: Policy):
    """Rematerialise what the code inside the ``with`` block saves for backward.

    ``Full`` recomputes every tensor the block produced, ``Selective`` keeps its ``save`` ops'
    outputs, ``Offload`` moves saved activations to host memory. Random ops (dropout) are never
    kept but replayed from the saved RNG state, so gradients match the plain run.
    """
    if not isinstance(policy, (Full, Selective, Offload)):
        raise ValueError(f"region: policy must be Full, Selective or Offload, got {policy!r}")
    if torch.compiler.is_compiling():
        raise ValueError("region: eager only; under torch.compile use apply() or checkpoint()")
    if isinstance(policy, Offload):
        with OffloadHooks(set()):
            yield
        return
    if not torch.is_grad_enabled():
        yield
        return
    tape = _Tape(op_policy(policy) if isinstance(policy, Selective) else None)
    with torch.autograd.graph.saved_tensors_hooks(tape.pack, tape.unpack), tape:
        yield
