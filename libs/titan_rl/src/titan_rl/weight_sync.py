"""Versioned weight publication trainer -> generators through shared memory on one host.

A ``SharedWeights`` is one file in ``/dev/shm`` holding two slots of the full model (each
tensor at a fixed, 64-byte aligned offset) and a header with the version each slot holds.
Version ``v`` goes to slot ``v % 2``. Every trainer rank writes the pieces it holds straight
into the slot (a sharded state dict's ``local_chunks()`` at their offsets; whole tensors are
dealt round-robin over the ranks), then rank 0 stamps the slot's version. A generator copies
the slot into its model in place (``Generator.update_weights`` on views of the slot: no
intermediate copy) after checking the stamp, and checks it again afterwards, so a slot
overwritten during the copy is an error, never silently mixed weights. The controller only
passes the small, picklable ``SharedWeightsRef``; the model never travels through it. The
writer must not reuse a slot before every generator has loaded it
(``Router.wait_loaded(v - 2)`` before publishing ``v``).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

_HEADER = 64  # bytes: the two slots' int64 versions, padded to the alignment
_ALIGN = 64
_EMPTY = -1


@dataclass(frozen=True, slots=True)
class WeightEntry:
    """Where one full tensor lives inside a slot."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """``torch`` dtype name, e.g. ``float32``."""
    offset: int
    """Bytes from the start of the slot."""


@dataclass(frozen=True, slots=True)
class SharedWeights:
    """A two-slot shared-memory file of full model weights (picklable: path and layout)."""

    path: str
    entries: tuple[WeightEntry, ...]
    slot_bytes: int

    @classmethod
    def create(
        cls, layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]], directory: str = "/dev/shm"
    ) -> SharedWeights:
        """A new zero-filled file for tensors ``name -> (shape, dtype)``."""
        if not layout:
            raise ValueError("SharedWeights.create: empty layout")
        entries, offset = [], 0
        for name, (shape, dtype) in layout.items():
            entries.append(
                WeightEntry(name, tuple(shape), str(dtype).removeprefix("torch."), offset)
            )
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            offset += -(-nbytes // _ALIGN) * _ALIGN
        path = os.path.join(directory, f"titan_rl-weights-{uuid.uuid4().hex}")
        with open(path, "wb") as f:
            f.truncate(_HEADER + 2 * offset)
        shared = cls(path, tuple(entries), offset)
        shared._versions().fill_(_EMPTY)
        return shared

    def unlink(self) -> None:
        """Remove the file (mappings already open stay valid until closed)."""
        _MAPS.pop(self.path, None)
        if os.path.exists(self.path):
            os.unlink(self.path)

    def ref(self, version: int) -> SharedWeightsRef:
        """What the controller passes to the generators for ``version``."""
        return SharedWeightsRef(self, version)

    def views(self, slot: int) -> dict[str, torch.Tensor]:
        """The slot's tensors by name (views into the shared file)."""
        base = self._storage()
        start = _HEADER + slot * self.slot_bytes
        out = {}
        for e in self.entries:
            dtype = getattr(torch, e.dtype)
            n = torch.Size(e.shape).numel() * dtype.itemsize
            out[e.name] = base[start + e.offset : start + e.offset + n].view(dtype).view(e.shape)
        return out

    def write(self, version: int, state: Mapping[str, Any], rank: int, world: int) -> None:
        """Write this rank's pieces of ``state`` into ``version``'s slot (every rank calls it).

        Values are whole tensors (rank ``i % world`` writes the ``i``-th) or sharded objects
        with ``local_chunks() -> [(offset, chunk)]`` (each rank writes its chunks).
        """
        views = self.views(version % 2)
        self._versions()[version % 2] = _EMPTY  # a reader racing this write fails its check
        missing = sorted(set(views) - set(state))
        unexpected = sorted(set(state) - set(views))
        if missing or unexpected:
            raise ValueError(f"SharedWeights.write: missing {missing}, unexpected {unexpected}")
        with torch.no_grad():
            for i, (name, value) in enumerate(state.items()):
                target = views[name]
                if hasattr(value, "local_chunks"):
                    for offset, chunk in value.local_chunks():
                        index = tuple(
                            slice(o, o + n) for o, n in zip(offset, chunk.shape, strict=True)
                        )
                        target[index].copy_(chunk)
                elif isinstance(value, torch.Tensor):
                    if i % world == rank:
                        target.copy_(value)
                else:
                    raise TypeError(
                        f"SharedWeights.write: {name} is a {type(value).__name__}; expected a "
                        "tensor or an object with local_chunks()"
                    )

    def stamp(self, version: int) -> None:
        """Mark ``version``'s slot complete (once every rank has written)."""
        self._versions()[version % 2] = version

    def version_in(self, slot: int) -> int:
        """The version the slot holds (-1: none yet)."""
        return int(self._versions()[slot])

    def _versions(self) -> torch.Tensor:
        return self._storage()[:16].view(torch.int64)

    def _storage(self) -> torch.Tensor:
        with _MAPS_LOCK:
            storage = _MAPS.get(self.path)
            if storage is None:
                size = _HEADER + 2 * self.slot_bytes
                storage = torch.from_file(self.path, shared=True, size=size, dtype=torch.uint8)
                _MAPS[self.path] = storage
            return storage


_MAPS: dict[str, torch.Tensor] = {}  # one mapping per file per process
_MAPS_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class SharedWeightsRef:
    """Version ``version`` of the weights in ``shared`` (what travels to the generators)."""

    shared: SharedWeights
    version: int


def load_weights(generator: Any, weights: Any, version: int) -> None:
    """Load ``weights`` (a state dict or a ``SharedWeightsRef``) into ``generator`` in place."""
    if not isinstance(weights, SharedWeightsRef):
        generator.update_weights(weights, version)
        return
    if weights.version != version:
        raise ValueError(f"load_weights: ref of version {weights.version} for version {version}")
    shared, slot = weights.shared, version % 2
    if shared.version_in(slot) != version:
        raise RuntimeError(
            f"shared weights slot {slot} holds version {shared.version_in(slot)}, not {version}"
        )
    generator.update_weights(shared.views(slot), version)
    if shared.version_in(slot) != version:  # the writer reused the slot during the copy
        raise RuntimeError(f"shared weights slot {slot} was overwritten while loading {version}")
