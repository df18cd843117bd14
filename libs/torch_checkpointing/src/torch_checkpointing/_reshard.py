"""Loading stored chunks into any target sharding, reading only the byte ranges needed.

Every stored chunk is a contiguous row-major box of a global tensor at known offsets; every
target (a plain tensor, a DTensor's local shard, a sharded-protocol chunk) is another box.
For each pair that overlaps, the overlap is a set of contiguous *runs* inside the stored
chunk's bytes. The overlap is read straight into the target's memory when it is one
contiguous slab on both sides (and the target is on the CPU), else it becomes copy pieces
(``_stream.split_copy``): staged, verified, then copied into the target view. ``_stream``
runs the reads, batched per file, reading only the checksum blocks the overlaps touch.
"""

from __future__ import annotations

import ctypes
import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from . import _format as fmt
from ._errors import CheckpointError
from ._stats import LoadStats
from ._stream import CopyPiece, FilePlan, Streamer, split_copy
from ._tree import Leaf, display, torch_dtype

if TYPE_CHECKING:  # pragma: no cover
    from .storage import Storage

_MAX_RUNS = 4096


@dataclass(frozen=True, slots=True)
class StoredChunk:
    file: str  # path relative to the storage root
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str
    start: int  # absolute byte offset of the chunk's data in the file


@dataclass(slots=True)
class FileInfo:
    path: str
    size: int
    block_size: int | None
    crcs: list[int] | None


@dataclass(slots=True)
class ReadPlan:
    """Per file: direct requests (bytes straight into contiguous CPU targets) and copy pieces
    (bytes staged, then copied into strided or device targets)."""

    requests: dict[str, list[fmt.ReadRequest]] = field(default_factory=dict)
    pieces: dict[str, list[CopyPiece]] = field(default_factory=dict)
    keep: list[Any] = field(default_factory=list)

    def add(self, path: str, req: fmt.ReadRequest) -> None:
        self.requests.setdefault(path, []).append(req)

    def add_copy(self, path: str, pieces: list[CopyPiece]) -> None:
        self.pieces.setdefault(path, []).extend(pieces)

    def paths(self) -> set[str]:
        return set(self.requests) | set(self.pieces)


def bytes_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no numpy needed)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    arr = (ctypes.c_char * n).from_address(t.data_ptr())
    return memoryview(arr).cast("B")


def local_chunks(leaf: Leaf) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """The (global offsets, local tensor) boxes this rank holds of ``leaf``."""
    obj = leaf.obj
    if leaf.kind == "tensor":
        return [((0,) * obj.dim(), obj)]
    if leaf.kind == "dtensor":
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        check_placements(obj, leaf.key)
        if obj.device_mesh.get_coordinate() is None:
            return []
        _, offsets = compute_local_shape_and_global_offset(
            obj.shape, obj.device_mesh, obj.placements
        )
        return [(tuple(int(o) for o in offsets), obj._local_tensor)]
    chunks = []
    for offsets, t in obj.local_chunks():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{leaf.key}: local_chunks() must yield (offsets, tensor) pairs")
        offsets = tuple(int(o) for o in offsets)
        if len(offsets) != len(leaf.shape) or t.dim() != len(leaf.shape):
            raise ValueError(
                f"{leaf.key}: chunk at {list(offsets)} with shape {list(t.shape)} does not match "
                f"the global shape {list(leaf.shape)}"
            )
        if any(o < 0 or o + s > g for o, s, g in zip(offsets, t.shape, leaf.shape, strict=True)):
            raise ValueError(
                f"{leaf.key}: chunk at {list(offsets)} with shape {list(t.shape)} falls outside "
                f"the global shape {list(leaf.shape)}"
            )
        if t.dtype != obj.dtype:
            raise ValueError(f"{leaf.key}: chunk dtype {t.dtype} differs from {obj.dtype}")
        chunks.append((offsets, t))
    return chunks


def check_placements(dt: Any, key: str) -> None:
    from torch.distributed.tensor import Replicate, Shard

    for p in dt.placements:
        if type(p) not in (Shard, Replicate):
            raise NotImplementedError(
                f"{key}: DTensor placement {p!r} is not supported (Shard and Replicate are); "
                "redistribute it first"
            )


def _strides(shape: tuple[int, ...]) -> list[int]:
    st = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        st[d] = st[d + 1] * shape[d + 1]
    return st


def contiguous_runs(
    shape: tuple[int, ...], lo: tuple[int, ...], n: tuple[int, ...]
) -> tuple[list[int], int]:
    """Start elements of the contiguous runs of box (lo, n) inside a row-major ``shape``, and
    the run length in elements."""
    nd = len(shape)
    if nd == 0:
        return [0], 1
    st = _strides(shape)
    k = nd - 1
    while k > 0 and n[k] == shape[k]:
        k -= 1
    run = n[k] * st[k]
    base = sum(lo[d] * st[d] for d in range(nd))
    if k == 0:
        return [base], run
    starts = [
        base + sum(i * st[d] for d, i in enumerate(idx))
        for idx in itertools.product(*(range(n[d]) for d in range(k)))
    ]
    return starts, run


def _count_runs(shape: tuple[int, ...], n: tuple[int, ...]) -> int:
    nd = len(shape)
    if nd == 0:
        return 1
    k = nd - 1
    while k > 0 and n[k] == shape[k]:
        k -= 1
    return math.prod(n[:k])


def plan_leaf(
    plan: ReadPlan,
    item: str,
    leaf: Leaf,
    stored: list[StoredChunk],
    targets: list[tuple[tuple[int, ...], torch.Tensor]],
) -> None:
    """Add the reads that fill ``targets`` (this rank's boxes of ``leaf``) from ``stored``."""
    dtype = torch_dtype(leaf.dtype)
    isz = fmt.DTYPES[leaf.dtype][0]
    unique: dict[tuple, StoredChunk] = {}
    for c in stored:
        unique.setdefault((c.offsets, c.shape), c)
    for t_off, t in targets:
        t_shape = tuple(t.shape)
        need = math.prod(t_shape)
        covered = 0
        for c in unique.values():
            lo = tuple(max(a, b) for a, b in zip(c.offsets, t_off, strict=True))
            hi = tuple(
                min(a + s, b + u)
                for a, s, b, u in zip(c.offsets, c.shape, t_off, t_shape, strict=True)
            )
            n = tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True))
            if any(x <= 0 for x in n) and len(n) > 0:
                continue
            count = math.prod(n)
            covered += count
            if count == 0:
                continue
            s_lo = tuple(a - b for a, b in zip(lo, c.offsets, strict=True))
            t_lo = tuple(a - b for a, b in zip(lo, t_off, strict=True))
            _plan_overlap(plan, c, s_lo, n, t, t_lo, dtype, isz)
        if covered < need:
            raise CheckpointError(
                f"{display(item, leaf.key)}: the checkpoint's chunks cover {covered} of the "
                f"{need} elements of the box at {list(t_off)} with shape {list(t_shape)}; it "
                "was saved incompletely (a sharded tensor whose chunks did not tile it)"
            )


def _plan_overlap(
    plan: ReadPlan,
    c: StoredChunk,
    s_lo: tuple[int, ...],
    n: tuple[int, ...],
    t: torch.Tensor,
    t_lo: tuple[int, ...],
    dtype: torch.dtype,
    isz: int,
) -> None:
    nbytes = math.prod(n) * isz
    s_runs = _count_runs(c.shape, n)
    if (
        s_runs == 1
        and t.device.type == "cpu"
        and t.is_contiguous()
        and _count_runs(tuple(t.shape), n) == 1
    ):
        # Straight into the target's memory: no scratch buffer, no second copy.
        (s_start,), _ = contiguous_runs(c.shape, s_lo, n)
        (t_start,), _ = contiguous_runs(tuple(t.shape), t_lo, n)
        dst = bytes_view(t)[t_start * isz : t_start * isz + nbytes]
        plan.keep.append(t)
        start = c.start + s_start * isz
        plan.add(c.file, fmt.ReadRequest(start, start + nbytes, dst))
        return
    # Through staging: the overlap's source is a row-major box inside the stored chunk.
    view = t[tuple(slice(a, a + k) for a, k in zip(t_lo, n, strict=True))]
    st = _strides(c.shape)
    first = sum(a * k for a, k in zip(s_lo, st, strict=True))
    pieces = split_copy(c.start + first * isz, view, st, isz, sparse=s_runs <= _MAX_RUNS)
    plan.add_copy(c.file, pieces)


def execute(
    storage: Storage,
    plan: ReadPlan,
    files: dict[str, FileInfo],
    *,
    threads: int = 8,
    stats: LoadStats | None = None,
) -> None:
    """Run every planned read (``_stream``): each file's needed checksum blocks in large
    sequential chunks, verified as they arrive, on ``threads`` I/O threads."""
    plans = []
    for path in sorted(plan.paths()):
        info = files[path]
        plans.append(
            FilePlan(
                path,
                info.size,
                info.block_size,
                info.crcs,
                list(plan.requests.get(path, [])),
                list(plan.pieces.get(path, [])),
            )
        )
    Streamer(storage, plans, threads=threads, stats=stats).run()
