"""``save_hf``'s machinery: every rank writes the bytes it holds straight into the HF files.

A safetensors file is a header followed by each tensor's bytes, row-major, at offsets the
header fixes; those offsets follow from names, shapes and dtypes alone. So after one exchange
of what each rank holds (keys, shapes, dtypes, and the boxes ``(offsets, shape)`` of its
pieces), every rank computes the same plan: the files (size-capped, in key order), one writer
per file (the rank holding most of its bytes), and which rank writes each piece (a piece
several ranks hold, a replica, is written once). Then:

1. A writer that holds every byte of its file writes it whole and renames it into place. A
   writer of a file whose pieces are spread over ranks creates it under a temporary name with
   only its header.
2. Every rank writes its pieces of those spread files at their offsets (``write_at``): no
   tensor is gathered, on rank 0 or anywhere.
3. A tensor with a layout transform (a key of ``transforms``) was written in the layout of
   its pieces; the lowest rank holding it reads it back whole, transforms it and rewrites it.
4. Writers rename their spread files into place; rank 0 writes the index, then (when given)
   ``generation_config.json`` and ``config.json``. ``config.json`` is the folder's commit:
   when one is to be written, rank 0 first removes a stale ``config.json`` (and index and
   ``generation_config.json``) before any rank writes a weight, so an interrupted overwrite
   of an earlier export never looks loadable.

The ranks agree after each phase (a small all-gather that doubles as a barrier and carries
each rank's success), so a failure on one rank leaves only temporary files, on every rank.
"""

from __future__ import annotations

import contextlib
import json
import math
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _format as fmt
from . import _reshard as rs
from . import _tree as tr
from ._errors import CheckpointError
from ._exchange import allgather_bytes, allgather_int64

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""A piece of a tensor: its offsets in the global tensor and its shape."""


@dataclass(slots=True)
class _Tensor:
    """One tensor of the export, as every rank sees it after the exchange."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    """Shape of the pieces' layout (the transform's input)."""
    hf_shape: tuple[int, ...]
    """Shape written in the header (the transform's output)."""
    transformed: bool
    holders: dict[Box, list[int]] = field(default_factory=dict)
    """Each distinct non-empty piece and the ranks that hold it."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * fmt.DTYPES[self.dtype][0]


@dataclass(slots=True)
class _File:
    name: str
    keys: list[str]
    writer: int
    whole: bool
    """The writer holds every piece: it writes the file in one go."""
    offsets: dict[str, int] = field(default_factory=dict)
    """Absolute offset of each tensor's bytes in the file."""
    header: bytes = b""


@dataclass(slots=True)
class _Plan:
    tensors: dict[str, _Tensor]
    files: list[_File]
    writer_of: dict[tuple[str, Box], int]
    """Which rank writes each piece."""
    tag: str


def describe(
    state_dict: Mapping[str, Any],
    transforms: Mapping[str, Callable[[torch.Tensor], torch.Tensor]],
) -> list[list[Any]]:
    """This rank's entries as JSON-ready rows ``[key, dtype, shape, hf_shape, transformed,
    boxes]``, validated; nothing is copied."""
    unknown = sorted(set(transforms) - set(state_dict))
    if unknown:
        raise ValueError(f"save_hf: transforms name keys not in state_dict: {unknown}")
    rows = []
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise TypeError(f"save_hf: keys must be str, got {key!r}")
        if not tr.is_tensor_like(value):
            raise TypeError(
                f"save_hf: {key} must be a tensor, DTensor or sharded tensor (global_shape, "
                f"dtype, local_chunks()), got {type(value).__name__}"
            )
        leaf = tr.as_leaf(value, key, "hf", False)
        if fmt.DTYPES[leaf.dtype][1] is None:
            raise TypeError(f"save_hf: {key} has dtype {leaf.dtype}, which safetensors lacks")
        hf_shape = leaf.shape
        fn = transforms.get(key)
        if fn is not None:
            hf_shape = _transformed_shape(key, fn, leaf)
        boxes = [[list(o), list(t.shape)] for o, t in rs.local_chunks(leaf) if t.numel()]
        rows.append([key, leaf.dtype, list(leaf.shape), list(hf_shape), fn is not None, boxes])
    return rows


def _transformed_shape(key: str, fn: Callable, leaf: tr.Leaf) -> tuple[int, ...]:
    """The output shape of a layout transform, evaluated on the meta device."""
    if not callable(fn):
        raise TypeError(f"save_hf: transforms[{key!r}] must be callable, got {fn!r}")
    dtype = tr.torch_dtype(leaf.dtype)
    out = fn(torch.empty(leaf.shape, dtype=dtype, device="meta"))
    if (
        not isinstance(out, torch.Tensor)
        or out.dtype != dtype
        or out.numel() != math.prod(leaf.shape)
    ):
        raise ValueError(
            f"save_hf: transforms[{key!r}] must return a tensor of the same dtype and number of "
            f"elements (a layout change), got {getattr(out, 'dtype', type(out).__name__)} "
            f"{list(getattr(out, 'shape', []))} for {leaf.dtype} {list(leaf.shape)}"
        )
    return tuple(out.shape)


def exchange(
    pg: Any, rows: list[list[Any]], error: Exception | None
) -> tuple[list[list[list[Any]]], str]:
    """Every rank's rows (one all-gather; none alone) and a tag for temporary names. A rank
    whose input was refused (``error``) raises it; the others raise naming that rank."""
    tag = secrets.token_hex(4)
    if pg is None or pg.size() == 1:
        if error is not None:
            raise error
        return [rows], tag
    mine = {"tag": tag, "rows": rows, "error": None if error is None else str(error)}
    gathered = [json.loads(d) for d in allgather_bytes(pg, json.dumps(mine).encode())]
    if error is not None:
        raise error
    bad = [(r, g["error"]) for r, g in enumerate(gathered) if g["error"] is not None]
    if bad:
        raise ValueError(f"save_hf: rank {bad[0][0]} refused its input: {bad[0][1]}")
    return [g["rows"] for g in gathered], gathered[0]["tag"]


def plan(all_rows: list[list[list[Any]]], limit: int, tag: str, metadata: dict[str, str]) -> _Plan:
    """The files and who writes what; the same on every rank. ``ValueError`` when the ranks
    disagree on a tensor or their pieces do not cover it exactly once."""
    tensors: dict[str, _Tensor] = {}
    for rank, rows in enumerate(all_rows):
        for key, dtype, shape, hf_shape, transformed, boxes in rows:
            t = tensors.get(key)
            if t is None:
                t = tensors[key] = _Tensor(key, dtype, tuple(shape), tuple(hf_shape), transformed)
            elif (t.dtype, t.shape, t.hf_shape, t.transformed) != (
                dtype,
                tuple(shape),
                tuple(hf_shape),
                transformed,
            ):
                raise ValueError(
                    f"save_hf: ranks disagree on {key}: {t.dtype} {list(t.shape)} -> "
                    f"{list(t.hf_shape)} (transformed: {t.transformed}) on one, {dtype} {shape} "
                    f"-> {hf_shape} (transformed: {transformed}) on rank {rank}"
                )
            for offsets, size in boxes:
                if math.prod(size):
                    t.holders.setdefault((tuple(offsets), tuple(size)), []).append(rank)
    if not tensors:
        raise ValueError("save_hf: no rank passed any tensor")
    for t in tensors.values():
        _check_cover(t)

    groups: list[list[str]] = [[]]
    size = 0
    for key, t in tensors.items():
        if groups[-1] and size + t.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += t.nbytes
    n = len(groups)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    files, writer_of = [], {}
    for name, keys in zip(names, groups, strict=True):
        held: dict[int, int] = {}
        for key in keys:
            t = tensors[key]
            for box, ranks in t.holders.items():
                for r in ranks:
                    held[r] = held.get(r, 0) + math.prod(box[1])
        writer = min(held, key=lambda r: (-held[r], r)) if held else 0
        whole = True
        for key in keys:
            for box, ranks in tensors[key].holders.items():
                writer_of[(key, box)] = writer if writer in ranks else min(ranks)
                whole = whole and writer in ranks
        file = _File(name, keys, writer, whole)
        _layout(file, tensors, metadata)
        files.append(file)
    return _Plan(tensors, files, writer_of, tag)


def _check_cover(t: _Tensor) -> None:
    """The distinct pieces tile the tensor: no element twice, none left out."""
    numel = math.prod(t.shape)
    boxes = sorted(t.holders)
    covered = sum(math.prod(n) for _, n in boxes)
    for i, (lo, n) in enumerate(boxes):
        if any(o < 0 or o + s > g for o, s, g in zip(lo, n, t.shape, strict=True)):
            raise ValueError(
                f"save_hf: {t.key} has a piece at {list(lo)} of shape {list(n)} "
                f"outside its shape {list(t.shape)}"
            )
        for lo2, n2 in boxes[i + 1 :]:
            if t.shape and lo2[0] >= lo[0] + n[0]:
                break  # sorted by the first offset: no later piece reaches back
            if all(a < b + m and b < a + k for a, k, b, m in zip(lo, n, lo2, n2, strict=True)):
                raise ValueError(
                    f"save_hf: {t.key}: pieces at {list(lo)} {list(n)} and {list(lo2)} "
                    f"{list(n2)} overlap (pieces held by several ranks must be identical)"
                )
    if covered != numel:
        raise ValueError(
            f"save_hf: the ranks' pieces of {t.key} cover {covered} of its {numel} elements"
        )


def _layout(file: _File, tensors: dict[str, _Tensor], metadata: dict[str, str]) -> None:
    """The file's header and where each tensor's bytes start."""
    entries, pos = [], 0
    for key in file.keys:
        t = tensors[key]
        entries.append((key, fmt.DTYPES[t.dtype][1], t.hf_shape, pos, pos + t.nbytes))
        pos += t.nbytes
    file.header = fmt.safetensors_header(entries, metadata)
    file.offsets = {e[0]: len(file.header) + e[3] for e in entries}


def write(
    store: Any,
    pg: Any,
    rank: int,
    state_dict: Mapping[str, Any],
    transforms: Mapping[str, Callable[[torch.Tensor], torch.Tensor]],
    p: _Plan,
    configs: Mapping[str, bytes] | None = None,
) -> dict[str, Any]:
    """Run the four phases, then write the index and ``configs`` (file name -> bytes, in
    order; ``config.json`` last); returns the index (the same on every rank)."""
    spread = [f for f in p.files if not f.whole]
    if spread and not callable(getattr(store, "write_at", None)):
        raise CheckpointError(
            f"save_hf: the pieces of {spread[0].name} are held by several ranks, which write "
            f"them in place, and {store!r} cannot write at an offset (FileSystemStorage can)"
        )
    configs = dict(configs or {})
    tmp = {f.name: fmt.tmp_name(f.name, p.tag) for f in p.files}
    mine = [f for f in p.files if f.writer == rank]
    if CONFIG in configs:  # retract the commit of an earlier export before touching its files

        def retract() -> None:
            if rank == 0:
                for name in (CONFIG, INDEX, *configs):
                    if store.exists(name):
                        store.delete(name)

        _phase(pg, retract)
    try:
        _phase(pg, lambda: _write_own_files(store, rank, state_dict, transforms, p, mine, tmp))
        if spread:
            _phase(pg, lambda: _write_pieces(store, rank, state_dict, p, spread, tmp))
            _phase(pg, lambda: _finish_transforms(store, rank, transforms, p, spread, tmp))
            _phase(pg, lambda: [store.rename(tmp[f.name], f.name) for f in spread if f in mine])
    except BaseException:
        for f in mine:
            with contextlib.suppress(Exception):
                store.delete(tmp[f.name])
        raise
    weight_map = {k: f.name for f in p.files for k in f.keys}
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in p.tensors.values())},
        "weight_map": weight_map,
    }
    last = dict(configs)
    if len(p.files) > 1:
        last = {INDEX: json.dumps(index, indent=2).encode(), **last}
    if last:

        def write_last() -> None:
            if rank == 0:
                for file, data in last.items():
                    name = fmt.tmp_name(file, p.tag)
                    store.write(name, [data])
                    store.rename(name, file)

        _phase(pg, write_last)
    return index


def _phase(pg: Any, work: Callable[[], Any]) -> None:
    """Run ``work`` here, then wait for every rank; if any failed, every rank raises."""
    error: BaseException | None = None
    try:
        work()
    except Exception as e:  # reported to the other ranks, then re-raised here
        error = e
    if pg is not None and pg.size() > 1:
        failed = [r for r, (ok,) in enumerate(allgather_int64(pg, [error is None])) if not ok]
    else:
        failed = [0] if error is not None else []
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"save_hf: rank(s) {failed} failed writing; nothing was published")


def _local_pieces(value: Any, key: str) -> dict[Box, torch.Tensor]:
    leaf = tr.as_leaf(value, key, "hf", False)
    return {(tuple(o), tuple(t.shape)): t for o, t in rs.local_chunks(leaf) if t.numel()}


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def _write_own_files(
    store: Any,
    rank: int,
    state_dict: Mapping[str, Any],
    transforms: Mapping[str, Callable],
    p: _Plan,
    mine: list[_File],
    tmp: dict[str, str],
) -> None:
    """Phase 1: whole files written and renamed; spread files created with their header."""
    for file in mine:
        if not file.whole:
            store.write(tmp[file.name], [file.header])
            continue
        views: list[bytes | memoryview] = [file.header]
        keep = []
        for key in file.keys:
            t = p.tensors[key]
            pieces = _local_pieces(state_dict[key], key)
            full = pieces.get(((0,) * len(t.shape), t.shape))
            if full is None:
                full = torch.empty(t.shape, dtype=tr.torch_dtype(t.dtype))
                for (lo, n), piece in pieces.items():
                    full[tuple(slice(o, o + s) for o, s in zip(lo, n, strict=True))] = piece
            if t.transformed:
                full = transforms[key](full)
            full = _host(full)
            keep.append(full)
            views.append(rs.bytes_view(full))
        store.write(tmp[file.name], views)
        store.rename(tmp[file.name], file.name)


def _write_pieces(
    store: Any,
    rank: int,
    state_dict: Mapping[str, Any],
    p: _Plan,
    spread: list[_File],
    tmp: dict[str, str],
) -> None:
    """Phase 2: this rank's pieces of the spread files, each run of bytes at its offset."""
    for file in spread:
        for key in file.keys:
            t = p.tensors[key]
            todo = [box for box in t.holders if p.writer_of[(key, box)] == rank]
            if not todo:
                continue
            pieces = _local_pieces(state_dict[key], key)
            item = fmt.DTYPES[t.dtype][0]
            for box in todo:
                host = _host(pieces[box])
                data = rs.bytes_view(host)
                starts, run = rs.contiguous_runs(t.shape, *box)
                step = run * item
                writes = [
                    (file.offsets[key] + s * item, data[i * step : (i + 1) * step])
                    for i, s in enumerate(starts)
                ]
                store.write_at(tmp[file.name], writes)
                del host, data


def _finish_transforms(
    store: Any,
    rank: int,
    transforms: Mapping[str, Callable],
    p: _Plan,
    spread: list[_File],
    tmp: dict[str, str],
) -> None:
    """Phase 3: the lowest holder of a transformed tensor rewrites it in the HF layout."""
    for file in spread:
        for key in file.keys:
            t = p.tensors[key]
            if not t.transformed or min(r for rk in t.holders.values() for r in rk) != rank:
                continue
            raw = torch.empty(t.shape, dtype=tr.torch_dtype(t.dtype))
            store.read_into(tmp[file.name], file.offsets[key], rs.bytes_view(raw))
            out = _host(transforms[key](raw))
            store.write_at(tmp[file.name], [(file.offsets[key], rs.bytes_view(out))])
