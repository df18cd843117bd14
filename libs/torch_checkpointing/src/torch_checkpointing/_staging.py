"""Reusable CPU staging buffers (shared with the writer process, pinned when CUDA is used)."""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import warnings

import torch

from ._reshard import bytes_view

_ids = itertools.count(1)
_ALIGN = 4096


class StagingBuffer:
    """One contiguous CPU byte buffer.

    ``shared=True`` backs it by an anonymous memory file (``memfd``) that the writer process
    maps through a passed file descriptor (no /dev/shm size limit applies); otherwise it is an
    ordinary (or pinned) torch allocation. ``pin=True`` page-locks it for fast, asynchronous
    device-to-host copies.
    """

    def __init__(self, size: int, *, shared: bool, pin: bool) -> None:
        self.id = next(_ids)
        self.size = max(int(size), 1)
        self.fd: int | None = None
        self._mm: mmap.mmap | None = None
        self._registered = False
        if shared:
            self.fd = os.memfd_create(f"torch_checkpointing-{self.id}", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, self.size)
            self._mm = mmap.mmap(self.fd, self.size)
            self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
            if pin:
                self._register_pinned()
        else:
            raw = torch.empty(self.size + _ALIGN, dtype=torch.uint8, pin_memory=pin)
            skip = -raw.data_ptr() % _ALIGN  # page-aligned start, for O_DIRECT writes
            self.tensor = raw[skip : skip + self.size]
        self.view = bytes_view(self.tensor)

    def _register_pinned(self) -> None:
        try:
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.size, 0)
            self._registered = int(rc) == 0
        except Exception as e:  # pragma: no cover - needs CUDA
            warnings.warn(
                f"could not pin the shared staging buffer ({e}); copies stay pageable", stacklevel=3
            )

    def close(self) -> None:
        if self._registered:  # pragma: no cover - needs CUDA
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._registered = False
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        # The mapping itself goes away with the last view of it (the tensor).
