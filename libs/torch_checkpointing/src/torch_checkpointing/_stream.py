"""Streaming verified reads: each file's needed blocks in large sequential chunks.

A load's reads are, per file, *direct* requests (bytes landing in contiguous CPU target
memory: a writable byte view of the tensor's storage) and *copy pieces* (bytes that must be
copied into a strided view or another device's memory). Each file is read in chunks of about
``CHUNK`` bytes, one ``preadv`` per chunk (more only past ``SCRATCH`` dropped bytes or
``_IOV_MAX`` buffers) scattering the bytes straight to their places: direct bytes into the
targets, copy pieces into a staging buffer, bytes only needed for their checksum (headers,
padding, parts of partly needed blocks) into a small per-thread scratch. Every checksum block
is hashed right after its read, while it is in the CPU cache (no second pass); only then are
the chunk's copy pieces copied from staging into their targets, on a copy thread (CPU) or a
CUDA stream from pinned staging, while the same worker reads its next chunk into its other
staging buffer. Staging buffers (two per I/O thread) are reused across tensors and files and
sized by the largest chunk's staged bytes: a load of contiguous CPU targets stages nothing.

Verified before used: a copy piece reaches its target only after its blocks are verified. A
direct request lands in the target first and is verified right after; a mismatch raises
``CorruptCheckpointError`` before ``load`` applies anything else (non-tensor state,
``load_state_dict``) and before it returns, so a partly filled state is never presented as
loaded (``_load`` says so in the error and ``fallback=True`` overwrites it).
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from . import _format as fmt
from ._errors import CorruptCheckpointError
from ._stats import LoadStats
from .storage import open_reader

if TYPE_CHECKING:  # pragma: no cover
    from .storage import Storage

CHUNK = 8 << 20  # bytes per read (one preadv)
PIECE = 4 << 20  # largest span of file bytes one copy piece covers
UNIT = 32 << 20  # bytes of one file a worker reads before the next worker's turn
SCRATCH = 256 << 10  # per I/O thread: bytes read only to be hashed (headers, padding, ...)
_IOV_MAX = 512
_ALIGN = 64  # staging offsets keep the file offsets' alignment modulo this


@dataclass(slots=True)
class CopyPiece:
    """File bytes ``[start, end)`` holding ``view`` (any strides, any device) as a source of
    element ``strides`` starting at ``start``."""

    start: int
    end: int
    view: torch.Tensor
    strides: tuple[int, ...]
    dtype: torch.dtype


def split_copy(
    start: int,
    view: torch.Tensor,
    strides: Sequence[int],
    isz: int,
    limit: int = PIECE,
    *,
    sparse: bool = True,
) -> list[CopyPiece]:
    """Cut the copy of ``view`` from a source of element ``strides`` at byte ``start`` into
    pieces each spanning at most ``limit`` bytes (unless one innermost row is larger) and,
    with ``sparse``, not more than twice the bytes they need (rows far apart are separate
    pieces, so the bytes between them are not read)."""
    out: list[CopyPiece] = []
    strides = tuple(int(s) for s in strides)
    _split(out, start, view, strides, isz, limit, 2 if sparse else math.inf)
    return out


def _hull(shape: Sequence[int], strides: Sequence[int], isz: int) -> int:
    return (sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1) * isz


def _split(
    out: list[CopyPiece],
    start: int,
    view: torch.Tensor,
    strides: tuple[int, ...],
    isz: int,
    limit: int,
    slack: float,
) -> None:
    shape = tuple(view.shape)
    if view.numel() == 0:
        return
    need = math.prod(shape) * isz
    hull = _hull(shape, strides, isz)
    if view.dim() == 0 or (hull <= limit and hull <= slack * need):
        out.append(CopyPiece(start, start + hull, view, strides, view.dtype))
        return
    row_hull = _hull(shape[1:], strides[1:], isz)
    row_need = math.prod(shape[1:]) * isz
    step = strides[0] * isz
    if row_hull > limit or row_hull > slack * row_need:
        for i in range(shape[0]):
            _split(out, start + i * step, view[i], strides[1:], isz, limit, slack)
        return
    # k rows span (k - 1) * step + row_hull bytes for k * row_need needed.
    k = max(1, (limit - row_hull) // step + 1)
    if step > slack * row_need:
        k = 1
    for i in range(0, shape[0], k):
        j = min(shape[0], i + k)
        sub = view[i:j]
        a = start + i * step
        out.append(CopyPiece(a, a + _hull(sub.shape, strides, isz), sub, strides, view.dtype))


@dataclass(slots=True)
class FilePlan:
    """A file's reads: its size and checksums, direct requests and copy pieces."""

    path: str
    size: int
    block_size: int | None
    crcs: list[int] | None
    direct: list[fmt.ReadRequest] = field(default_factory=list)
    pieces: list[CopyPiece] = field(default_factory=list)
    direct_starts: list[int] = field(default_factory=list)
    piece_starts: list[int] = field(default_factory=list)
    guard: list[list[int]] = field(default_factory=list)
    guard_starts: list[int] = field(default_factory=list)


def _prepare(fp: FilePlan) -> tuple[int, list[tuple[int, int]]]:
    """Check a file's requests against its size; demote overlapping direct requests to copy
    pieces; return the read alignment and the chunks ``[a, b)`` to read, in order."""
    path, size = fp.path, fp.size
    for r in (*fp.direct, *fp.pieces):
        if r.end > size:
            raise CorruptCheckpointError(
                f"{path}: needs bytes up to {r.end} but the file has {size}; it is truncated",
                path,
            )
    verify = fp.crcs is not None and fp.block_size is not None
    if verify:
        assert fp.block_size is not None and fp.crcs is not None
        nblocks = -(-size // fp.block_size)
        if len(fp.crcs) != nblocks:
            raise CorruptCheckpointError(
                f"{path}: {size} bytes should have {nblocks} checksum blocks, its marker lists "
                f"{len(fp.crcs)}; the file is truncated or replaced",
                path,
            )
    align = fp.block_size if verify else 1
    assert align is not None
    fp.direct = sorted((r for r in fp.direct if r.end > r.start), key=lambda r: r.start)
    fp.pieces.sort(key=lambda p: p.start)
    # Bytes wanted by two requests are read once (into staging) and copied to both.
    spans = [(p.start, p.end) for p in fp.pieces]
    ends = list(itertools.accumulate((e for _, e in spans), max))
    keep: list[fmt.ReadRequest] = []
    reach = -1  # end of the requests demoted so far
    for r in fp.direct:
        if (
            (keep and keep[-1].end > r.start)
            or reach > r.start
            or _overlaps(spans, ends, r.start, r.end)
        ):
            if keep and keep[-1].end > r.start:
                prev = keep.pop()
                _demote(fp, prev)
                reach = max(reach, prev.end)
            _demote(fp, r)
            reach = max(reach, r.end)
        else:
            keep.append(r)
    fp.direct = keep
    fp.pieces.sort(key=lambda p: p.start)
    # Extents: merged [lo, hi) of every aligned range needed.
    ranges = sorted(
        (r.start // align * align, min(size, -(-r.end // align) * align))
        for r in (*fp.direct, *fp.pieces)
    )
    extents: list[list[int]] = []
    for lo, hi in ranges:
        if extents and lo <= extents[-1][1]:
            extents[-1][1] = max(extents[-1][1], hi)
        else:
            extents.append([lo, hi])
    # Copy pieces are never cut by a chunk boundary.
    guard: list[list[int]] = []
    for p in fp.pieces:
        if guard and p.start < guard[-1][1]:
            guard[-1][1] = max(guard[-1][1], p.end)
        else:
            guard.append([p.start, p.end])
    fp.direct_starts = [r.start for r in fp.direct]
    fp.piece_starts = [p.start for p in fp.pieces]
    fp.guard, fp.guard_starts = guard, [g[0] for g in guard]
    starts = [g[0] for g in guard]
    step = max(align, CHUNK // align * align)
    chunks: list[tuple[int, int]] = []
    for lo, hi in extents:
        a = lo
        while a < hi:
            b = min(hi, a + step)
            i = bisect.bisect_left(starts, b) - 1
            if b < hi and i >= 0 and guard[i][0] < b < guard[i][1]:
                cut = guard[i][0] // align * align
                b = cut if cut > a else min(hi, -(-guard[i][1] // align) * align)
            chunks.append((a, b))
            a = b
    return align, chunks


def _overlaps(spans: list[tuple[int, int]], reach: list[int], lo: int, hi: int) -> bool:
    """Whether ``[lo, hi)`` overlaps a span (sorted; ``reach[i]``: the largest end of the
    first i + 1)."""
    i = bisect.bisect_left(spans, (hi, -1))
    return i > 0 and reach[i - 1] > lo


def _demote(fp: FilePlan, r: fmt.ReadRequest) -> None:
    t = torch.frombuffer(r.dst, dtype=torch.uint8)
    fp.pieces.append(CopyPiece(r.start, r.end, t, (1,), torch.uint8))


class _Verifier:
    """Checks a file's blocks against their digests as the bytes of one chunk are fed to it in
    file order (a block may span several buffers and reads)."""

    def __init__(self, fp: FilePlan, align: int, start: int) -> None:
        self.fp, self.align, self.pos = fp, align, start
        self.hasher: Any = None

    def feed(self, view: memoryview) -> None:
        fp, align = self.fp, self.align
        n, j = view.nbytes, 0
        while j < n:
            blk = self.pos // align
            end = min((blk + 1) * align, fp.size)
            take = min(end - self.pos, n - j)
            if self.hasher is None and self.pos == blk * align and take == end - self.pos:
                digest = fmt.block_digest(view[j : j + take])  # a whole block in one buffer
            else:
                if self.hasher is None:
                    self.hasher = fmt.block_hasher()
                self.hasher.update(view[j : j + take])
                digest = self.hasher.intdigest() if self.pos + take == end else None
            self.pos += take
            j += take
            if digest is None:
                continue
            self.hasher = None
            assert fp.crcs is not None
            if digest != fp.crcs[blk]:
                raise CorruptCheckpointError(
                    f"{fp.path}: checksum mismatch in bytes [{blk * align}, {end}) (block "
                    f"{blk}); the file is corrupt",
                    fp.path,
                )


class _Slot:
    """One reused staging buffer and the copies still reading from it."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.view: memoryview | None = None
        self.pending: list[Any] = []


class Streamer:
    """Runs a load's ``FilePlan``s on ``threads`` I/O threads (see the module docstring)."""

    def __init__(
        self,
        storage: Storage,
        plans: Sequence[FilePlan],
        *,
        threads: int = 8,
        stats: LoadStats | None = None,
        pin: bool | None = None,
    ) -> None:
        self.storage = storage
        self.plans = [p for p in plans if p.direct or p.pieces]
        self.threads = max(1, threads)
        self.stats = stats if stats is not None else LoadStats()
        devices = {p.view.device.type for fp in self.plans for p in fp.pieces}
        self.cuda = "cuda" in devices
        self.pin = self.cuda if pin is None else pin
        self._local = threading.local()
        self._slots: list[_Slot] = []
        self._lock = threading.Lock()
        self._copier: ThreadPoolExecutor | None = None
        self._streams: list[Any] = []
        self._failed = threading.Event()
        self._scratch_bytes = 0

    # ------------------------------------------------------------------ run
    def run(self) -> None:
        work: list[tuple[FilePlan, int, list[tuple[int, int]]]] = []
        for fp in self.plans:
            align, chunks = _prepare(fp)
            unit: list[tuple[int, int]] = []
            size = 0
            for c in chunks:
                unit.append(c)
                size += c[1] - c[0]
                if size >= UNIT:
                    work.append((fp, align, unit))
                    unit, size = [], 0
            if unit:
                work.append((fp, align, unit))
        self.stats.add(files=len(self.plans))
        try:
            n = min(self.threads, len(work))
            if n > 1:
                with ThreadPoolExecutor(max_workers=n, thread_name_prefix="tcp-load") as pool:
                    futures = [pool.submit(self._unit, *w) for w in work]
                    errors = [f.exception() for f in futures]
                first = next((e for e in errors if e is not None), None)
                if first is not None:
                    raise first
            else:
                for w in work:
                    self._unit(*w)
        finally:
            self._finish()

    def _finish(self) -> None:
        """Wait for every copy (also after a failure: nothing writes into the targets once the
        load has returned or raised), then free the staging buffers."""
        errors = []
        for slot in self._slots:
            try:
                self._wait(slot)
            except BaseException as e:
                errors.append(e)
        for s in self._streams:
            s.synchronize()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        for slot in self._slots:
            if slot.buf is not None:
                self.stats.buffer(-slot.buf.numel())
            slot.buf = slot.view = None
        self.stats.buffer(-self._scratch_bytes)
        self._scratch_bytes = 0
        if errors:
            raise errors[0]

    # ------------------------------------------------------------- one unit
    def _unit(self, fp: FilePlan, align: int, chunks: list[tuple[int, int]]) -> None:
        local = self._local
        if not hasattr(local, "slots"):
            local.slots = [_Slot(), _Slot()]
            local.turn = 0
            local.stream = None
            with self._lock:
                self._slots.extend(local.slots)
        t0 = time.perf_counter()
        reader = open_reader(self.storage, fp.path)
        self.stats.add(open_s=time.perf_counter() - t0)
        try:
            for a, b in chunks:
                if self._failed.is_set():
                    return
                slot = local.slots[local.turn]
                local.turn ^= 1
                try:
                    self._chunk(reader, fp, align, a, b, slot)
                except BaseException:
                    self._failed.set()
                    raise
        finally:
            reader.close()

    def _chunk(self, reader: Any, fp: FilePlan, align: int, a: int, b: int, slot: _Slot) -> None:
        # Where each byte of [a, b) goes: a direct request ("d"), staging for the copy pieces
        # ("s", at an offset keeping the file offset's alignment, so it views as its dtype),
        # or a small reused scratch ("x": headers, padding, unneeded parts of checksum blocks,
        # hashed and dropped).
        layout: list[tuple[int, int, str, Any]] = []
        i = max(0, bisect.bisect_right(fp.direct_starts, a) - 1)
        pos, soff = a, 0
        while pos < b:
            while i < len(fp.direct) and fp.direct[i].end <= pos:
                i += 1
            r = fp.direct[i] if i < len(fp.direct) and fp.direct[i].start < b else None
            if r is not None and r.start <= pos:
                y = min(r.end, b)
                layout.append((pos, y, "d", r))
                pos = y
                continue
            gap_end = b if r is None else r.start
            while pos < gap_end:  # split the gap into staged (copy pieces) and dropped bytes
                g = bisect.bisect_right(fp.guard_starts, pos) - 1
                if g >= 0 and fp.guard[g][1] > pos:
                    y = min(fp.guard[g][1], gap_end)
                    soff += (pos - soff) % _ALIGN
                    layout.append((pos, y, "s", soff))
                    soff += y - pos
                else:
                    nxt = fp.guard_starts[g + 1] if g + 1 < len(fp.guard) else gap_end
                    y = min(nxt, gap_end)
                    layout.append((pos, y, "x", None))
                pos = y
        view = self._staging(slot, soff) if soff else None
        scratch = self._scratch() if any(e[2] == "x" for e in layout) else memoryview(b"")
        verifier = _Verifier(fp, align, a) if fp.crcs is not None else None
        batch: list[memoryview] = []
        batch_lo, used = a, 0
        direct = 0
        for lo, hi, kind, where in layout:
            while lo < hi:
                if len(batch) >= _IOV_MAX or (kind == "x" and used == scratch.nbytes):
                    self._flush(reader, fp, batch_lo, batch, verifier)
                    batch, batch_lo, used = [], lo, 0
                if kind == "d":
                    part = where.dst[lo - where.start : hi - where.start]
                    direct += hi - lo
                elif kind == "s":
                    assert view is not None
                    part = view[where : where + hi - lo]
                else:
                    part = scratch[used : used + min(hi - lo, scratch.nbytes - used)]
                    used += part.nbytes
                batch.append(part)
                lo += part.nbytes
        if batch:
            self._flush(reader, fp, batch_lo, batch, verifier)
        self.stats.add(bytes_read=b - a, bytes_direct=direct)
        todo = []
        staged = [(lo, hi, w) for lo, hi, k, w in layout if k == "s"]
        staged_lo = [g[0] for g in staged]
        for p in fp.pieces[bisect.bisect_left(fp.piece_starts, a) :]:
            if p.start >= b:
                break
            g = staged[bisect.bisect_right(staged_lo, p.start) - 1]
            assert g[0] <= p.start and p.end <= g[1], (p.start, p.end, g)
            todo.append((p, g[2] + p.start - g[0]))
        if todo:
            self._submit(slot, todo)

    def _flush(
        self,
        reader: Any,
        fp: FilePlan,
        offset: int,
        batch: list[memoryview],
        verifier: _Verifier | None,
    ) -> None:
        """One scatter read of ``batch`` from ``offset``, then every byte of it hashed."""
        t0 = time.perf_counter()
        try:
            reader.readv(offset, batch)
        except EOFError as e:
            raise CorruptCheckpointError(
                f"{fp.path}: truncated while loading ({e})", fp.path
            ) from e
        t1 = time.perf_counter()
        self.stats.add(read_s=t1 - t0)
        if verifier is not None:
            for part in batch:
                verifier.feed(part)
            self.stats.add(checksum_s=time.perf_counter() - t1)

    def _scratch(self) -> memoryview:
        local = self._local
        if getattr(local, "scratch", None) is None:
            local.scratch = memoryview(bytearray(SCRATCH))
            self.stats.buffer(SCRATCH)
            with self._lock:
                self._scratch_bytes += SCRATCH
        return local.scratch

    # ------------------------------------------------------ staging + copies
    def _staging(self, slot: _Slot, need: int) -> memoryview:
        t0 = time.perf_counter()
        self._wait(slot)
        self.stats.add(wait_s=time.perf_counter() - t0)
        if slot.buf is None or slot.buf.numel() < need:
            if slot.buf is not None:
                self.stats.buffer(-slot.buf.numel())
            size = -(-need // 65536) * 65536
            slot.buf = slot.view = None
            slot.buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.stats.buffer(size)
            from ._reshard import bytes_view

            slot.view = bytes_view(slot.buf)
        assert slot.view is not None
        return slot.view

    def _wait(self, slot: _Slot) -> None:
        pending, slot.pending = slot.pending, []
        for h in pending:
            if isinstance(h, Future):
                h.result()
            else:
                h.synchronize()

    def _submit(self, slot: _Slot, todo: list[tuple[CopyPiece, int]]) -> None:
        assert slot.buf is not None
        cpu, dev = [], []
        for p, off in todo:
            src = slot.buf[off : off + p.end - p.start]
            isz = p.view.element_size()
            if off % isz:
                src = src.clone()  # a dtype wider than the staging alignment
            src = src.view(p.dtype).as_strided(tuple(p.view.shape), p.strides)
            (dev if p.view.device.type != "cpu" else cpu).append((p.view, src))
        nbytes = sum(p.view.numel() * p.view.element_size() for p, _ in todo)
        self.stats.add(bytes_copied=nbytes)
        if cpu:
            if self._copier is None:
                with self._lock:
                    if self._copier is None:
                        self._copier = ThreadPoolExecutor(1, thread_name_prefix="tcp-copy")
            slot.pending.append(self._copier.submit(self._copy_cpu, cpu))
        if dev:
            t0 = time.perf_counter()
            stream = self._stream()
            with torch.cuda.stream(stream), torch.no_grad():
                for dst, src in dev:
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            slot.pending.append(event)
            self.stats.add(copy_s=time.perf_counter() - t0)

    def _copy_cpu(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        t0 = time.perf_counter()
        with torch.no_grad():  # grad mode is per thread
            for dst, src in pairs:
                dst.copy_(src)
        self.stats.add(copy_s=time.perf_counter() - t0)

    def _stream(self) -> Any:
        local = self._local
        if local.stream is None:
            local.stream = torch.cuda.Stream()
            with self._lock:
                self._streams.append(local.stream)
        return local.stream
