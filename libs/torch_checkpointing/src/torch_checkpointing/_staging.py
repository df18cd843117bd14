"""Staging: this rank's chunks copied into reused CPU buffers, laid out as the files to write.

A save blocks the trainer only for ``Stager.stage``: one copy of each chunk into a buffer that
is planned once per layout and reused (shared with the writer process, pinned when CUDA is
used). The writer then streams each file's header followed by its slice of the buffer.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import mmap
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _format as fmt
from . import _tree as tr
from ._exchange import Chunk
from ._reshard import bytes_view

_ids = itertools.count(1)
_ALIGN = 4096


def _cudart() -> Any:
    """The CUDA runtime bindings; raises where this torch has none."""
    rt = torch.cuda.cudart()
    if rt is None:
        raise RuntimeError("this torch build has no CUDA runtime to pin host memory with")
    return rt


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
            rc = _cudart().cudaHostRegister(self.tensor.data_ptr(), self.size, 0)
            self._registered = int(rc) == 0
        except Exception as e:  # pragma: no cover - needs CUDA
            warnings.warn(
                f"could not pin the shared staging buffer ({e}); copies stay pageable", stacklevel=3
            )

    def close(self) -> None:
        if self._registered:  # pragma: no cover - needs CUDA
            with contextlib.suppress(Exception):
                _cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._registered = False
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        # The mapping itself goes away with the last view of it (the tensor).


# -------------------------------------------------------------------- plans and slots


@dataclass(slots=True)
class FilePlan:
    """One data file of this rank: where its bytes sit in the buffer, its safetensors table."""

    item: str
    name: str
    offset: int  # in the staging buffer
    size: int
    chunks: list[list[Any]]  # [key, offsets, shape, dtype, rel_start, rel_end]
    tree: bool  # whether this file carries the item's non-tensor skeleton
    table_json: str  # safetensors tensor entries, pre-serialised
    meta_chunks_json: str


@dataclass(slots=True)
class Slot:
    """One staging buffer of a plan, with a typed view per chunk."""

    buffer: StagingBuffer
    views: dict[tuple[str, str, tuple[int, ...]], torch.Tensor]
    busy: bool = False
    retired: bool = False


@dataclass(slots=True)
class LocalPlan:
    key: tuple
    files: list[FilePlan]
    total: int
    slots: list[Slot] = field(default_factory=list)


class Stager:
    """This rank's side of a save: the file layout in the staging buffer (planned once per
    layout), reused buffers (``slots`` of them), the copy, and the job the writer runs."""

    def __init__(
        self, rank: int, *, shared: bool, slots: int, free: Callable[[StagingBuffer], None]
    ) -> None:
        self.rank = rank
        self.shared = shared
        self.max_slots = slots
        self._free = free
        self._plan: LocalPlan | None = None
        self._cv = threading.Condition()

    def plan(self, flats: dict[str, tr.Flat], chunks: list[Chunk]) -> LocalPlan:
        by_item: dict[str, list[Chunk]] = {item: [] for item in flats}
        for c in chunks:
            by_item[c.item].append(c)
        tree_items = {item for item, f in flats.items() if f.per_rank or self.rank == 0}
        key = tuple(
            (item, item in tree_items, tuple((c.key, c.offsets, c.shape, c.dtype) for c in cs))
            for item, cs in sorted(by_item.items())
        )
        if self._plan is not None and self._plan.key == key:
            return self._plan
        files = []
        offset = 0
        for item in sorted(flats):
            cs = sorted(by_item[item], key=lambda c: (-fmt.DTYPES[c.dtype][0], c.key, c.offsets))
            if not cs and item not in tree_items:
                continue
            rel = 0
            table = []
            entries = []
            for c in cs:
                table.append([c.key, list(c.offsets), list(c.shape), c.dtype, rel, rel + c.nbytes])
                code = fmt.DTYPES[c.dtype][1]
                entry = {
                    "dtype": code or "U8",
                    "shape": list(c.shape) if code is not None else [c.nbytes],
                    "data_offsets": [rel, rel + c.nbytes],
                }
                name = f"{c.key}@{','.join(map(str, c.offsets))}"
                entries.append(json.dumps(name) + ":" + json.dumps(entry, separators=(",", ":")))
                rel += c.nbytes
            files.append(
                FilePlan(
                    item,
                    fmt.item_file(item, self.rank),
                    offset,
                    rel,
                    table,
                    item in tree_items,
                    ",".join(entries),
                    json.dumps([c[:4] for c in table], separators=(",", ":")),
                )
            )
            offset += -(-rel // _ALIGN) * _ALIGN
        plan = LocalPlan(key, files, offset)
        old, self._plan = self._plan, plan
        if old is not None:
            with self._cv:
                for s in old.slots:
                    s.retired = True
                    if not s.busy:
                        self._free(s.buffer)
        return plan

    def acquire(self, plan: LocalPlan) -> Slot:
        """A free slot of ``plan``; waits while every slot's buffer is still being written."""
        with self._cv:
            while True:
                for s in plan.slots:
                    if not s.busy:
                        s.busy = True
                        return s
                if len(plan.slots) < self.max_slots:
                    slot = self._new_slot(plan)
                    slot.busy = True
                    plan.slots.append(slot)
                    return slot
                self._cv.wait()

    def release(self, slot: Slot) -> None:
        with self._cv:
            slot.busy = False
            if slot.retired:
                self._free(slot.buffer)
            self._cv.notify_all()

    def close(self) -> None:
        if self._plan is not None:
            for s in self._plan.slots:
                s.buffer.close()
        self._plan = None

    def _new_slot(self, plan: LocalPlan) -> Slot:
        pin = torch.cuda.is_available() and torch.cuda.is_initialized()
        buf = StagingBuffer(plan.total, shared=self.shared, pin=pin)
        views = {}
        for f in plan.files:
            for k, offs, shape, dtype, rel, end in f.chunks:
                region = buf.tensor[f.offset + rel : f.offset + end]
                views[(f.item, k, tuple(offs))] = region.view(tr.torch_dtype(dtype)).view(shape)
        return Slot(buf, views)

    @staticmethod
    def stage(slot: Slot, chunks: list[Chunk]) -> list[Any]:
        """Copy every chunk into the slot; returns the CUDA events the writer must wait for."""
        devices = set()
        for c in chunks:
            if c.nbytes == 0:
                continue
            dst = slot.views[(c.item, c.key, c.offsets)]
            if c.src.device.type == "cpu":
                dst.copy_(c.src)
            else:
                dst.copy_(c.src, non_blocking=dst.is_pinned())
                devices.add(c.src.device)
        events = []
        for dev in devices:  # the writer waits for these before reading the buffer
            if dev.type == "cuda":
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(dev))
                events.append(ev)
            else:  # pragma: no cover - other accelerators: wait here
                torch.accelerator.synchronize(dev)
        return events

    def job(
        self,
        plan: LocalPlan,
        slot: Slot,
        flats: dict[str, tr.Flat],
        *,
        folder: str,
        marker: dict[str, Any],
        manifest: bytes | None,
        seq: int,
        block_size: int,
    ) -> dict[str, Any]:
        """The writer's job: every file's header and its bytes' place in the buffer."""
        step = marker["step"]
        files = []
        for f in plan.files:
            tree = json.dumps(flats[f.item].tree, separators=(",", ":")) if f.tree else "null"
            meta = (
                f'{{"format":"{fmt.FORMAT}","item":{json.dumps(f.item)},"rank":{self.rank},'
                f'"step":{step},"tree":{tree},"chunks":{f.meta_chunks_json}}}'
            )
            head = '{"__metadata__":' + json.dumps({fmt.META_KEY: meta}, separators=(",", ":"))
            head += ("," + f.table_json if f.table_json else "") + "}"
            text = head.encode()
            # Pad the header (safetensors allows trailing spaces) so the data starts at a
            # 4 KiB boundary of the file: the writer can then use O_DIRECT straight from the
            # page-aligned staging buffer.
            text += b" " * (-(len(text) + 8) % _ALIGN)
            files.append(
                {
                    "name": f.name,
                    "item": f.item,
                    "header": len(text).to_bytes(8, "little") + text,
                    "buffer": slot.buffer.id,
                    "offset": f.offset,
                    "size": f.size,
                    "chunks": f.chunks,
                    "tree": f.tree,
                }
            )
        return {
            "id": seq,
            "seq": seq,
            "dir": folder,
            "step": step,
            "rank": self.rank,
            "block_size": block_size,
            "files": files,
            "marker": marker,
            "manifest": manifest,
        }
