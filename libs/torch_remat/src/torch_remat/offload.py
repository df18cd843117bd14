"""Saved-tensor hooks that keep activations in host memory between forward and backward."""

from __future__ import annotations

from typing import cast

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .measure import StorageKey, on_accelerator, record_offloaded, storage_keys


class _HostCopy:
    """One storage's bytes in host memory, shared by every saved view of that storage."""

    __slots__ = ("device", "host", "on_device", "pending", "version")

    def __init__(self, t: torch.Tensor) -> None:
        pin = on_accelerator(t.device)
        flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        self.host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=pin)
        self.host.copy_(flat, non_blocking=pin)
        self.device = t.device
        self.version = t._version
        self.pending = 0
        self.on_device: torch.Tensor | None = None

    def view(self, size, stride, offset, dtype) -> torch.Tensor:
        if self.on_device is None:
            self.on_device = self.host.to(self.device, non_blocking=self.host.is_pinned())
        out = self.on_device.view(dtype).as_strided(size, stride, offset)
        self.pending -= 1
        if self.pending == 0:  # every view served: let the device copy go with its views
            self.on_device = None
        return out


# what pack returns for an offloaded tensor: (host copy, size, stride, storage offset, dtype)
_Packed = tuple[_HostCopy, tuple[int, ...], tuple[int, ...], int, torch.dtype]


class OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Pack: copy the storage to host (pinned, non-blocking on CUDA). Unpack: copy it back.

    Copies are per storage, so views of one activation saved by several ops (q, k, v of one
    projection; the input of two linears) cost one copy, as they cost one storage in place.
    Tensors whose storage is in ``resident`` (parameters, buffers) and leaves that require grad
    are kept as they are: they stay alive anyway. On a CPU-only machine the "host copy" is a
    second CPU buffer: the round trip and the accounting run, but no device memory is saved.
    """

    def __init__(self, resident: set[StorageKey]) -> None:
        copies: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> _HostCopy

        def pack(t: torch.Tensor) -> object:
            base = t._base if t._base is not None else t
            if (base.is_leaf and base.requires_grad) or (storage_keys([t]) & resident):
                return t
            storage = t.untyped_storage()
            copy = copies.get(storage)
            if copy is None or copy.version != t._version:
                copy = copies[storage] = _HostCopy(t)
                record_offloaded(copy.host)
            copy.pending += 1
            return copy, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype

        def unpack(packed: object) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            copy, size, stride, offset, dtype = cast(_Packed, packed)
            return copy.view(size, stride, offset, dtype)

        super().__init__(pack, unpack)
