"""Loading stored chunks into any target sharding, reading only the byte ranges needed.

Every stored chunk is a contiguous row-major box of a global tensor at known offsets; every
target (a plain tensor, a DTensor's local shard, a sharded-protocol chunk) is another box.
For each pair that overlaps, the overlap is a set of contiguous *runs* inside the stored
chunk's bytes. Runs are read straight into the target's memory when the overlap is one
contiguous slab on both sides, else into a compact scratch buffer that is then copied into
the target view. Reads go through ``_format.read_verified`` (checksum blocks).
"""

from __future__ import annotations

import ctypes
import itertools
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from . import _format as fmt
from ._errors import CheckpointError
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
    requests: dict[str, list[fmt.ReadRequest]] = field(default_factory=dict)
    post: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    keep: list[Any] = field(default_factory=list)

    def add(self, path: str, req: fmt.ReadRequest) -> None:
        self.requests.setdefault(path, []).append(req)


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


def _runs(shape: tuple[int, ...], lo: tuple[int, ...], n: tuple[int, ...]) -> tuple[list[int], int]:
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
        (s_start,), _ = _runs(c.shape, s_lo, n)
        (t_start,), _ = _runs(tuple(t.shape), t_lo, n)
        dst = bytes_view(t)[t_start * isz : t_start * isz + nbytes]
        plan.keep.append(t)
        start = c.start + s_start * isz
        plan.add(c.file, fmt.ReadRequest(start, start + nbytes, dst))
        return
    view = t[tuple(slice(a, a + k) for a, k in zip(t_lo, n, strict=True))]
    if s_runs == 1:
        (s_start,), _ = _runs(c.shape, s_lo, n)
        temp = torch.empty(nbytes, dtype=torch.uint8)
        start = c.start + s_start * isz
        plan.add(c.file, fmt.ReadRequest(start, start + nbytes, bytes_view(temp)))
        plan.post.append((view, temp.view(dtype).view(n)))
        return
    starts, run = _runs(c.shape, s_lo, n)
    hull = (starts[-1] + run - starts[0]) * isz
    if len(starts) > _MAX_RUNS or hull <= 2 * nbytes:
        # One read of the span from the first run to the last, then a strided view of it.
        temp = torch.empty(hull, dtype=torch.uint8)
        start = c.start + starts[0] * isz
        plan.add(c.file, fmt.ReadRequest(start, start + hull, bytes_view(temp)))
        src = temp.view(dtype).as_strided(n, _strides(c.shape), 0)
        plan.post.append((view, src))
        return
    temp = torch.empty(nbytes, dtype=torch.uint8)
    mv = bytes_view(temp)
    rb = run * isz
    for i, s in enumerate(starts):
        start = c.start + s * isz
        plan.add(c.file, fmt.ReadRequest(start, start + rb, mv[i * rb : (i + 1) * rb]))
    plan.post.append((view, temp.view(dtype).view(n)))


def _units(
    reqs: list[fmt.ReadRequest], block_size: int | None, unit: int
) -> list[list[fmt.ReadRequest]]:
    """Cut a file's requests into independent work units of about ``unit`` bytes.

    Large requests are split at multiples of a block-aligned step, so no checksum block is
    split between two pieces of one request; a block shared by two requests that land in
    different units is simply read (and verified) by both.
    """
    step = unit if block_size is None else max(block_size, unit // block_size * block_size)
    pieces: list[fmt.ReadRequest] = []
    for r in sorted(reqs, key=lambda r: r.start):
        a = r.start
        while a < r.end:
            b = min(r.end, (a // step + 1) * step)
            pieces.append(fmt.ReadRequest(a, b, r.dst[a - r.start : b - r.start]))
            a = b
    units: list[list[fmt.ReadRequest]] = []
    cur: list[fmt.ReadRequest] = []
    size = 0
    for p in pieces:
        cur.append(p)
        size += p.end - p.start
        if size >= unit:
            units.append(cur)
            cur, size = [], 0
    if cur:
        units.append(cur)
    return units


def execute(
    storage: Storage,
    plan: ReadPlan,
    files: dict[str, FileInfo],
    *,
    threads: int = 8,
    unit: int = 16 << 20,
    on_read: Any = None,
) -> None:
    """Run every planned read, then copy scratch buffers into targets.

    Reads run as ~16 MiB units on ``threads`` threads (files and ranges within a file in
    parallel): a cold load is bound by storage latency and queue depth, not bandwidth.
    """
    work = [
        (path, u)
        for path in sorted(plan.requests)
        for u in _units(plan.requests[path], files[path].block_size, unit)
    ]

    def one(path: str, reqs: list[fmt.ReadRequest]) -> None:
        info = files[path]
        fmt.read_verified(
            storage,
            path,
            reqs,
            size=info.size,
            block_size=info.block_size,
            crcs=info.crcs,
            max_segment=unit,
            on_read=on_read,
        )

    if threads > 1 and len(work) > 1:
        with ThreadPoolExecutor(max_workers=min(threads, len(work))) as pool:
            for f in [pool.submit(one, p, u) for p, u in work]:
                f.result()
    else:
        for p, u in work:
            one(p, u)
    with torch.no_grad():
        for view, src in plan.post:
            view.copy_(src)
