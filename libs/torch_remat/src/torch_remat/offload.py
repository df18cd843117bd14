"""Saved-tensor hooks that keep activations in host memory between forward and backward."""

from __future__ import annotations

import torch

from .measure import _keys, _record_offloaded, _StorageKey


class _OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Pack: copy to host (pinned, non-blocking on CUDA). Unpack: copy back to its device.

    Tensors whose storage is in ``resident`` (parameters, buffers) and leaves that require grad
    (parameters of a plain function, inputs) are kept as they are: they stay alive anyway, so
    copying them would only cost bandwidth. On a CPU-only machine the "host copy" is a second
    CPU tensor: the round trip and the accounting run, but no device memory is saved.
    """

    def __init__(self, resident: set[_StorageKey]) -> None:
        def pack(t: torch.Tensor) -> object:
            base = t._base if t._base is not None else t
            if (base.is_leaf and base.requires_grad) or (_keys([t]) & resident):
                return t
            pin = t.device.type == "cuda"
            host = torch.empty_like(t, device="cpu", pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            _record_offloaded(host)
            return (t.device, host)

        def unpack(packed: object) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=host.is_pinned())

        super().__init__(pack, unpack)
