"""Helpers shared by torch_checkpointing's tests (loaded through ``sys.path``: pytest runs in
importlib mode; the distributed ranks load the test modules, which add this folder)."""

from __future__ import annotations

import random

import torch

from torch_checkpointing import FileSystemStorage


class Chunked:
    """Test-only implementation of the sharded-tensor protocol (docs/design.md)."""

    def __init__(self, global_shape, dtype, chunks):
        self.global_shape = tuple(global_shape)
        self.dtype = dtype
        self._chunks = chunks

    def local_chunks(self):
        return self._chunks


class RNGHolder:
    """Stateful holder of the torch and Python RNG states."""

    def state_dict(self):
        return {"torch": torch.get_rng_state(), "python": random.getstate()}

    def load_state_dict(self, sd):
        torch.set_rng_state(sd["torch"])
        random.setstate(sd["python"])


class CountingStorage(FileSystemStorage):
    """Counts the bytes read from each file."""

    def __init__(self, root):
        super().__init__(root, fsync=False)
        self.read_bytes: dict[str, int] = {}

    def read_into(self, path, offset, buffer):
        self.read_bytes[path] = self.read_bytes.get(path, 0) + memoryview(buffer).nbytes
        super().read_into(path, offset, buffer)

    def read(self, path, offset=0, length=None):
        data = super().read(path, offset, length)
        self.read_bytes[path] = self.read_bytes.get(path, 0) + len(data)
        return data


def flip_byte(path, pos):
    """Flip the lowest bit of the byte at ``pos`` (negative: from the end) of the file ``path``
    (a digit stays a digit: a JSON file stays valid JSON)."""
    data = bytearray(path.read_bytes())
    data[pos] ^= 0x01
    path.write_bytes(bytes(data))


def tree_bytes(root):
    """Every file under ``root`` (lock files aside) with its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".lock-")
    }
