"""Symmetric heaps: one buffer per rank that every peer can write, plus signal pads.

The symmetric-memory dispatcher (``symm_mem.py``) needs only three things from a heap:

* ``peer_buffer(peer)``: a flat tensor that *is* ``peer``'s buffer (writes land in its memory);
* ``put_signal(peer, channel)``: wait until ``peer``'s flag ``(channel, me)`` is 0, set it to 1;
* ``wait_signal(peer, channel)``: wait until my flag ``(channel, peer)`` is 1, reset it to 0.

Signals are ordered after the writes issued before them, and a put cannot overwrite a flag
its receiver has not consumed yet: the semantics of ``torch.distributed._symmetric_memory``'s
``put_signal``/``wait_signal``, which ``CudaSymmetricHeap`` calls (they run on the current
CUDA stream: nothing blocks the host, and CUDA graphs capture them).

``SharedMemoryHeap`` emulates the same thing for the processes of one host: each rank's
buffer is a file in shared memory that every rank maps (``torch.from_file(shared=True)``),
flags are an int32 array in another mapped file, and the waits spin on the host. It runs the
dispatcher's protocol on CPU tensors over a gloo group, which is how the tests check it.
Its flag reads go through ``mmap``, not torch ops, so they stand for the device-side waits
of the CUDA heap and are invisible to a ``TorchDispatchMode`` counting host syncs.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
import uuid

import torch
import torch.distributed as dist

__all__: list[str] = []

_SPIN_TIMEOUT_S = 120.0


class SymmetricHeap:
    """Interface of a symmetric heap (see the module docstring)."""

    rank: int
    world_size: int
    numel: int
    num_channels: int

    def peer_buffer(self, peer: int) -> torch.Tensor:
        raise NotImplementedError

    def put_signal(self, peer: int, channel: int) -> None:
        raise NotImplementedError

    def wait_signal(self, peer: int, channel: int) -> None:
        raise NotImplementedError


class CudaSymmetricHeap(SymmetricHeap):
    """``torch.distributed._symmetric_memory`` buffer of ``numel`` elements (collective)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        num_channels: int,
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.numel, self.num_channels, self.dtype = numel, num_channels, dtype
        pad_bytes = symm_mem.get_signal_pad_size()
        need = num_channels * self.world_size * 4
        if need > pad_bytes:
            raise ValueError(
                f"SymmMemDispatcher needs {num_channels} signal channels x {self.world_size} "
                f"ranks = {need} bytes of signal pad, but the pad has {pad_bytes}; call "
                f"torch.distributed._symmetric_memory.set_signal_pad_size({need}) before the "
                "first symmetric allocation, or use fewer chunks"
            )
        self._buffer = symm_mem.empty(numel, dtype=dtype, device=device)
        self._handle = symm_mem.rendezvous(self._buffer, group)
        self._peers = [
            self._buffer
            if p == self.rank
            else self._handle.get_buffer(p, (numel,), dtype, storage_offset=0)
            for p in range(self.world_size)
        ]

    def peer_buffer(self, peer: int) -> torch.Tensor:
        return self._peers[peer]

    def put_signal(self, peer: int, channel: int) -> None:
        self._handle.put_signal(peer, channel)

    def wait_signal(self, peer: int, channel: int) -> None:
        self._handle.wait_signal(peer, channel)


class SharedMemoryHeap(SymmetricHeap):
    """CPU emulation: buffers and flags in shared-memory files mapped by every rank.

    Collective over ``group`` (all ranks on one host). The files are unlinked as soon as
    every rank has mapped them, so nothing is left behind when the processes end.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        numel: int,
        dtype: torch.dtype,
        num_channels: int,
    ) -> None:
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.numel, self.num_channels, self.dtype = numel, num_channels, dtype
        token = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        stem = os.path.join(folder, f"dist_moe_symm_{token[0]}")
        elem = torch.empty((), dtype=dtype).element_size()
        n_flags = num_channels * self.world_size
        with open(f"{stem}_buf{self.rank}", "wb") as f:
            f.truncate(max(1, numel) * elem)
        with open(f"{stem}_sig{self.rank}", "wb") as f:
            f.truncate(max(1, n_flags) * 4)
        dist.barrier(group=group)
        self._peers, self._maps, self._flags = [], [], []
        for p in range(self.world_size):
            buf = torch.from_file(f"{stem}_buf{p}", shared=True, size=max(1, numel), dtype=dtype)
            self._peers.append(buf[:numel])
            with open(f"{stem}_sig{p}", "r+b") as f:
                mm = mmap.mmap(f.fileno(), max(1, n_flags) * 4)
            self._maps.append(mm)
            self._flags.append(memoryview(mm).cast("i"))
        dist.barrier(group=group)
        os.unlink(f"{stem}_buf{self.rank}")
        os.unlink(f"{stem}_sig{self.rank}")

    def _flag(self, owner: int, channel: int, source: int) -> tuple[memoryview, int]:
        assert 0 <= channel < self.num_channels, (channel, self.num_channels)
        return self._flags[owner], channel * self.world_size + source

    def peer_buffer(self, peer: int) -> torch.Tensor:
        return self._peers[peer]

    def put_signal(self, peer: int, channel: int) -> None:
        flags, i = self._flag(peer, channel, self.rank)
        _spin_until(flags, i, 0, f"rank {peer} to consume signal {channel} from rank {self.rank}")
        flags[i] = 1

    def wait_signal(self, peer: int, channel: int) -> None:
        flags, i = self._flag(self.rank, channel, peer)
        _spin_until(flags, i, 1, f"signal {channel} from rank {peer} at rank {self.rank}")
        flags[i] = 0


def _spin_until(flags: memoryview, i: int, value: int, what: str) -> None:
    if flags[i] == value:
        return
    deadline = time.monotonic() + _SPIN_TIMEOUT_S
    spins = 0
    while flags[i] != value:
        if time.monotonic() > deadline:
            raise RuntimeError(f"symmetric-heap emulation: timed out waiting for {what}")
        spins += 1
        time.sleep(0 if spins < 1000 else 1e-4)  # yield: ranks may share few cores
