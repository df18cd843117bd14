"""Measuring what a training step keeps for backward, its peak memory and its time.

Saved bytes are counted where autograd keeps them: an outer ``saved_tensors_hooks`` sees every
tensor packed for backward (outside checkpoints), every checkpoint's saved inputs and, since we
ask checkpoint to route them through user hooks, every tensor selective checkpointing caches.
Offloaded tensors are reported by the offload hooks themselves. Bytes are whole storages (a
saved view keeps its base alive), each storage once; parameters, buffers and the step's inputs
are not activations and are left out.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["Measurement", "measure"]

StorageKey = tuple[str, int]


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The dense tensors holding ``t``'s memory (a DTensor's local shard, a subclass's parts)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, n) for n in names]
        return [p for x in inner if isinstance(x, torch.Tensor) for p in _plain_tensors(x)]
    return [t]


def tensor_storages(t: torch.Tensor) -> list[tuple[StorageKey, int]]:
    """(key, bytes) of each storage behind ``t``; empty and meta storages are skipped."""
    found = []
    for p in _plain_tensors(t):
        if p.device.type == "meta" or p.is_sparse:
            continue
        s = p.untyped_storage()
        if s.nbytes() > 0:
            found.append(((str(p.device), s.data_ptr()), s.nbytes()))
    return found


def storage_keys(tensors: Iterable[object]) -> set[StorageKey]:
    return {k for t in tensors if isinstance(t, torch.Tensor) for k, _ in tensor_storages(t)}


def model_storage_keys(model: torch.nn.Module) -> set[StorageKey]:
    """Storages of a module's parameters and buffers: resident whatever the policy."""
    return storage_keys([*model.parameters(), *model.buffers()])


class Ledger:
    """Distinct storages packed for backward, split by where they live."""

    def __init__(self, excluded: set[StorageKey]) -> None:
        self.excluded = excluded
        self.resident: dict[StorageKey, int] = {}
        self.offloaded: dict[StorageKey, int] = {}

    def record(self, t: torch.Tensor, *, offloaded: bool = False) -> None:
        into = self.offloaded if offloaded else self.resident
        for key, nbytes in tensor_storages(t):
            if key not in self.excluded:
                into[key] = nbytes

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        def pack(t: torch.Tensor) -> torch.Tensor:
            self.record(t)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def __enter__(self) -> Ledger:
        _LEDGERS.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _LEDGERS.remove(self)


_LEDGERS: list[Ledger] = []


def record_offloaded(host: torch.Tensor) -> None:
    """Called by the offload hooks: ``host`` is the copy kept for backward."""
    for ledger in _LEDGERS:
        ledger.record(host, offloaded=True)


def record_held(t: torch.Tensor) -> None:
    """Called by ``region``: ``t`` is kept for backward outside autograd's saved tensors."""
    for ledger in _LEDGERS:
        ledger.record(t)


class _LiveBytes(TorchDispatchMode):
    """Peak of bytes allocated by ops since entry and still alive (CPU peak accounting)."""

    def __init__(self, excluded: set[StorageKey]) -> None:
        super().__init__()
        self.excluded = excluded
        self.live: dict[StorageKey, int] = {}
        self.current = 0
        self.peak = 0

    def _forget(self, key: StorageKey) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            for p in _plain_tensors(t):
                for key, nbytes in tensor_storages(p):
                    if key in self.live or key in self.excluded:
                        continue
                    self.live[key] = nbytes
                    self.current += nbytes
                    self.peak = max(self.peak, self.current)
                    # A storage's Python object lives exactly as long as the C++ storage, so
                    # its finalizer marks the moment the bytes go back to the allocator.
                    weakref.finalize(p.untyped_storage(), self._forget, key)
        return out


@dataclass(frozen=True, slots=True)
class Measurement:
    """What one training step (forward, loss, backward) of a model costs."""

    saved_bytes: int
    """Activation bytes kept on the compute device for backward at the end of forward."""
    offloaded_bytes: int
    """Activation bytes kept in host memory for backward by ``Offload``."""
    peak_bytes: int
    """Peak bytes allocated during the step above what existed before it (see ``measure``)."""
    step_time_s: float
    """Median wall time of one step, measured without any instrumentation."""


def _default_loss(out: object) -> torch.Tensor:
    """The mean square of the first tensor in ``out``: a stand-in loss that reaches every
    element of it."""
    first = next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
    return first.float().square().mean()


def check_inputs(
    where: str, inputs: Sequence[object], kwargs: Mapping[str, object] | None
) -> tuple[tuple[object, ...], dict[str, object]]:
    """``(args, kwargs)`` of the model call, checked."""
    if isinstance(inputs, (torch.Tensor, Mapping, str)) or not isinstance(inputs, Sequence):
        raise TypeError(
            f"{where}: inputs must be a tuple or list of positional arguments (e.g. (x,)), got "
            f"{type(inputs).__name__}; pass keyword arguments as kwargs= / sample_kwargs="
        )
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"{where}: keyword inputs must be a mapping, got {type(kwargs).__name__}")
    return tuple(inputs), dict(kwargs or {})


def _step(model, inputs, kwargs, loss_fn) -> None:
    loss_fn(model(*inputs, **kwargs)).backward()


def saved_bytes_of_forward(
    model: torch.nn.Module, inputs: Sequence[object], kwargs: Mapping[str, object]
) -> tuple[Ledger, object]:
    """One forward with the ledger attached; returns the ledger and the output (still alive)."""
    excluded = model_storage_keys(model) | storage_keys(tree_leaves((inputs, kwargs)))
    with Ledger(excluded) as ledger, ledger.hooks():
        out = model(*inputs, **kwargs)
    return ledger, out


def on_accelerator(device: torch.device) -> bool:
    """Whether ``device`` is the machine's accelerator (CUDA, XPU, MPS, ...): its allocator
    counts bytes and its work runs asynchronously to the host."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return accelerator is not None and device.type == accelerator.type


def _sync(device: torch.device) -> None:
    if on_accelerator(device):
        torch.accelerator.synchronize(device)


def measure(
    model: torch.nn.Module,
    inputs: Sequence[object] = (),
    *,
    kwargs: Mapping[str, object] | None = None,
    loss_fn: Callable[[object], torch.Tensor] = _default_loss,
    steps: int = 3,
    warmup: int = 1,
) -> Measurement:
    """Saved-activation bytes, peak memory and step time of one training step,
    ``loss_fn(model(*inputs, **kwargs)).backward()``.

    ``loss_fn`` receives exactly what the model returns (a tensor, a tuple, a transformers
    ``ModelOutput``, ...) and returns the scalar to backpropagate; for a transformers causal
    LM, put ``labels`` in ``kwargs`` and pass ``loss_fn=lambda out: out.loss``. The default is
    the mean square of the first tensor in the output (a stand-in that reaches all of it).

    Peak: on an accelerator, ``torch.accelerator.max_memory_allocated`` during one step minus
    what was allocated before it. On CPU there is no allocator counter, so peak is the
    high-water mark of bytes held by storages that ops created during the step (activations,
    saved and recomputed tensors, offloaded copies, gradients, temporaries), tracked with a
    dispatch mode and storage finalizers; parameters, buffers and inputs are excluded. The model's ``.grad`` fields are
    restored afterwards; RNG state advances as in ``steps + warmup + 1`` real steps.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"measure: steps must be >= 1 and warmup >= 0, got {steps}, {warmup}")
    inputs, kwargs = check_inputs("measure", inputs, kwargs)
    params = list(model.parameters())
    grads = [p.grad for p in params]
    device = next((p.device for p in params), torch.device("cpu"))
    try:
        for _ in range(warmup):
            _step(model, inputs, kwargs, loss_fn)
        times = []
        for _ in range(steps):
            for p in params:
                p.grad = None
            _sync(device)
            t0 = time.perf_counter()
            _step(model, inputs, kwargs, loss_fn)
            _sync(device)
            times.append(time.perf_counter() - t0)
        for p in params:
            p.grad = None

        excluded = model_storage_keys(model) | storage_keys(tree_leaves((inputs, kwargs)))
        if on_accelerator(device):
            _sync(device)
            before = torch.accelerator.memory_allocated(device)
            torch.accelerator.reset_peak_memory_stats(device)
            ledger, out = saved_bytes_of_forward(model, inputs, kwargs)
            loss_fn(out).backward()
            del out
            _sync(device)
            peak = torch.accelerator.max_memory_allocated(device) - before
        else:
            with _LiveBytes(excluded) as live:
                ledger, out = saved_bytes_of_forward(model, inputs, kwargs)
                loss_fn(out).backward()
                del out
            peak = live.peak
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
    return Measurement(
        saved_bytes=sum(ledger.resident.values()),
        offloaded_bytes=sum(ledger.offloaded.values()),
        peak_bytes=peak,
        step_time_s=statistics.median(times),
    )
