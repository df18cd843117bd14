"""Range checks of a manifest's and a done-marker's fields, before anything uses them.

Imports no torch: retention (in the background writer process) checks manifests too.

A checksum only proves a file is what some writer wrote, not that our writer wrote it: a
forged or foreign file with a valid checksum must still be damage (``CorruptCheckpointError``
naming the field and its value), never a loop, a huge allocation or an arithmetic error.
"""

from __future__ import annotations

import math
import re
from typing import Any

from . import _format as fmt
from ._errors import CorruptCheckpointError

_MAX_STEP = 10**12
_MAX_BLOCK_SIZE = 1 << 40
_MAX_INT = (1 << 63) - 1
_TOKEN_RE = re.compile(r"^[0-9a-f]{12}-\d{1,18}$")
_KINDS = ("tensor", "dtensor", "sharded")


def _known(value: Any, names: Any) -> bool:
    return isinstance(value, str) and value in names


def _bad(path: str, field: str, value: Any, allowed: str) -> CorruptCheckpointError:
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return CorruptCheckpointError(f"{path}: field {field} = {text}, expected {allowed}", path)


def _int(path: str, field: str, value: Any, lo: int, hi: int = _MAX_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad(path, field, value, f"an int in [{lo}, {hi}]")
    return value


def _ints(path: str, field: str, value: Any, lo: int = 0, hi: int = _MAX_INT) -> list[int]:
    if not isinstance(value, list) or len(value) > 64:
        raise _bad(path, field, value, "a list of at most 64 ints")
    return [_int(path, f"{field}[{i}]", v, lo, hi) for i, v in enumerate(value)]


def _str(path: str, field: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _bad(path, field, value, "a str")
    return value


def _block_size(path: str, field: str, value: Any) -> int:
    b = _int(path, field, value, fmt.MIN_BLOCK_SIZE, _MAX_BLOCK_SIZE)
    if b & (b - 1):
        raise _bad(path, field, b, f"a power of two >= {fmt.MIN_BLOCK_SIZE}")
    return b


def _numel(path: str, field: str, shape: list[int]) -> int:
    n = math.prod(shape)
    if n > _MAX_INT:
        raise _bad(path, field, shape, "a shape of fewer than 2**63 elements")
    return n


def check_manifest(m: dict[str, Any], path: str) -> None:
    """Every field of a manifest is in range and consistent; else ``CorruptCheckpointError``."""
    if m.get("format") != fmt.FORMAT:
        raise _bad(path, "format", m.get("format"), repr(fmt.FORMAT))
    if not _TOKEN_RE.match(_str(path, "token", m.get("token"))):
        raise _bad(path, "token", m.get("token"), "'<12 hex digits>-<seq>'")
    _int(path, "step", m.get("step"), 0, _MAX_STEP - 1)
    _int(path, "world_size", m.get("world_size"), 1, fmt.MAX_WORLD_SIZE)
    _block_size(path, "block_size", m.get("block_size"))
    t = m.get("time", 0.0)
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
        raise _bad(path, "time", t, "a finite number")
    if "lineage" in m and m["lineage"] is not None:
        _str(path, "lineage", m["lineage"])
    items = m.get("items")
    if not isinstance(items, dict):
        raise _bad(path, "items", items, "an object")
    for item, spec in items.items():
        where = f"items[{item!r}]"
        if not isinstance(spec, dict) or not isinstance(spec.get("per_rank"), bool):
            raise _bad(path, where, spec, "an object with a bool per_rank")
        entries = spec.get("entries")
        if not isinstance(entries, dict) or (spec["per_rank"] and entries):
            raise _bad(path, f"{where}.entries", entries, "an object (empty when per_rank)")
        for key, e in entries.items():
            ew = f"{where}.entries[{key!r}]"
            if not (
                isinstance(e, list)
                and len(e) == 3
                and _known(e[0], _KINDS)
                and _known(e[1], fmt.DTYPES)
            ):
                raise _bad(path, ew, e, "[kind, dtype, shape] with a known kind and dtype")
            _numel(path, f"{ew} shape", _ints(path, f"{ew} shape", e[2]))


def check_marker(
    m: dict[str, Any], manifest: dict[str, Any], rank: int, path: str
) -> dict[str, dict[str, Any]]:
    """Every field of rank ``rank``'s done-marker is in range and agrees with ``manifest``
    (already checked): chunks tile each file's data section in order, each chunk's byte
    length is its shape's, lies inside its entry's global shape, and each file has exactly
    one checksum per block. Returns the marker's files."""
    for field in ("format", "token", "world_size", "step"):
        if m.get(field) != manifest[field]:
            raise CorruptCheckpointError(
                f"{path}: done-marker belongs to another save (field {field} = "
                f"{m.get(field)!r}, the manifest says {manifest[field]!r})",
                path,
            )
    if m.get("rank") != rank:
        raise _bad(path, "rank", m.get("rank"), str(rank))
    files = m.get("files")
    if not isinstance(files, dict):
        raise _bad(path, "files", files, "an object")
    items_m = manifest["items"]
    for name, info in files.items():
        where = f"files[{name!r}]"
        if not isinstance(info, dict):
            raise _bad(path, where, info, "an object")
        item = info.get("item")
        if (
            not isinstance(item, str)
            or not _known(item, items_m)
            or name != fmt.item_file(item, rank)
        ):
            raise _bad(path, f"{where}.item", item, "an item of the manifest, named by the file")
        if not isinstance(info.get("tree"), bool):
            raise _bad(path, f"{where}.tree", info.get("tree"), "a bool")
        size = _int(path, f"{where}.size", info.get("size"), 8)
        start = _int(path, f"{where}.data_start", info.get("data_start"), 8, size)
        block = _block_size(path, f"{where}.block_size", info.get("block_size"))
        crcs = info.get("block_xxh3_64")
        if not isinstance(crcs, list) or len(crcs) != -(-size // block):
            n = len(crcs) if isinstance(crcs, list) else crcs
            raise _bad(path, f"{where}.block_xxh3_64", n, f"{-(-size // block)} checksums")
        for i, c in enumerate(crcs):
            _int(path, f"{where}.block_xxh3_64[{i}]", c, 0, (1 << 64) - 1)
        chunks = info.get("chunks")
        if not isinstance(chunks, list):
            raise _bad(path, f"{where}.chunks", chunks, "a list")
        entries = items_m[item]["entries"]
        pos = 0
        for i, c in enumerate(chunks):
            cw = f"{where}.chunks[{i}]"
            if not (isinstance(c, list) and len(c) == 6 and _known(c[3], fmt.DTYPES)):
                raise _bad(path, cw, c, "[key, offsets, shape, dtype, start, end]")
            key = _str(path, f"{cw} key", c[0])
            offs, shape = _ints(path, f"{cw} offsets", c[1]), _ints(path, f"{cw} shape", c[2])
            nbytes = _numel(path, f"{cw} shape", shape) * fmt.DTYPES[c[3]][0]
            if len(offs) != len(shape):
                raise _bad(path, f"{cw} offsets", offs, f"{len(shape)} offsets, one per dim")
            if c[4] != pos or c[5] != pos + nbytes:
                raise _bad(path, f"{cw} [start, end]", c[4:], f"[{pos}, {pos + nbytes}]")
            pos += nbytes
            if not items_m[item]["per_rank"]:
                e = entries.get(key)
                if e is None or e[1] != c[3] or len(e[2]) != len(shape):
                    raise _bad(path, f"{cw} key", key, "an entry of the manifest, same dtype")
                if any(o + s > g for o, s, g in zip(offs, shape, e[2], strict=True)):
                    raise _bad(path, f"{cw} box", [offs, shape], f"inside the shape {e[2]}")
        if start + pos != size:
            raise _bad(path, f"{where}.size", size, f"data_start + chunk bytes = {start + pos}")
    return files
