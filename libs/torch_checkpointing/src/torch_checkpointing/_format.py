"""On-storage format: names, safetensors headers, checksummed writes and verified range reads.

Imports no torch: the background writer process uses this module alone.

A checkpoint is one folder per save attempt, ``step-<step:012d>.<token>``, under a root
that also holds one lock file per rank (``.lock-00000.json``, see ``_lock``)::

    step-000000000100.5f2a9c01d3e4-3/
        model-00000.safetensors   rank 0's part of the item "model" (one file per item per rank)
        model-00001.safetensors   rank 1's part
        optim-00000.safetensors
        done-00000.json           rank 0's done-marker: its files, sizes, block checksums
        done-00001.json
        manifest.json             global layout (items, keys, shapes, dtypes) and the run's
                                  lineage, by rank 0

Every data file is a valid safetensors file; its ``__metadata__`` carries the non-tensor
state (JSON) where that rank writes it. The checkpoint is complete exactly when
``manifest.json`` and a done-marker from every rank it lists are present; each is written
under a temporary name and renamed into place after the data files it describes.
"""

from __future__ import annotations

import json
import re
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import xxhash

from ._errors import CorruptCheckpointError

if TYPE_CHECKING:  # pragma: no cover
    from .storage import Storage

FORMAT = "torch_checkpointing/1"
DEFAULT_BLOCK_SIZE = 1 << 20
WRITE_CHUNK = 32 << 20
_VERIFY_CHUNK = 1 << 20
MANIFEST = "manifest.json"
META_KEY = "torch_checkpointing"

_DIR_RE = re.compile(r"^step-(\d{12})\.([0-9a-f]{12})-(\d+)$")
_TMP_PREFIX = ".tmp-"
_LOCK_PREFIX = ".lock-"

# dtype name -> (item size, safetensors code or None when safetensors has no code for it)
DTYPES: dict[str, tuple[int, str | None]] = {
    "float64": (8, "F64"),
    "float32": (4, "F32"),
    "float16": (2, "F16"),
    "bfloat16": (2, "BF16"),
    "int64": (8, "I64"),
    "int32": (4, "I32"),
    "int16": (2, "I16"),
    "int8": (1, "I8"),
    "uint8": (1, "U8"),
    "bool": (1, "BOOL"),
    "uint16": (2, "U16"),
    "uint32": (4, "U32"),
    "uint64": (8, "U64"),
    "float8_e4m3fn": (1, "F8_E4M3"),
    "float8_e5m2": (1, "F8_E5M2"),
    "complex64": (8, "C64"),
    "complex128": (16, None),
    "complex32": (4, None),
    "float8_e4m3fnuz": (1, None),
    "float8_e5m2fnuz": (1, None),
    "float8_e8m0fnu": (1, None),
}
ST_TO_DTYPE = {code: name for name, (_, code) in DTYPES.items() if code is not None}


# ---------------------------------------------------------------------------------- names


def step_dir(step: int, nonce: str, seq: int) -> str:
    return f"step-{step:012d}.{nonce}-{seq}"


def parse_step_dir(name: str) -> tuple[int, str, int] | None:
    m = _DIR_RE.match(name)
    return None if m is None else (int(m.group(1)), m.group(2), int(m.group(3)))


def item_file(item: str, rank: int) -> str:
    return f"{quote(item, safe='')}-{rank:05d}.safetensors"


def marker_file(rank: int) -> str:
    return f"done-{rank:05d}.json"


def lock_file(rank: int) -> str:
    return f"{_LOCK_PREFIX}{rank:05d}.json"


def tmp_name(path: str, tag: str) -> str:
    head, _, tail = path.rpartition("/")
    name = f"{_TMP_PREFIX}{tag}-{tail}"
    return f"{head}/{name}" if head else name


# --------------------------------------------------------------------- JSON with a checksum


# A manifest holds one short line per state entry (key, kind, dtype, global shape: ~100-200
# bytes) and nothing per rank, so its size does not grow with the world size; 1M entries (a
# per-expert MoE with optimizer state is ~150k) fit in 256 MiB. A done-marker holds one
# checksum per block of its rank's files (<= 21 bytes per block of at least 4 KiB) and one line
# per chunk (bounded by the manifest's entries): ``marker_max_bytes`` scales with both.
MANIFEST_MAX_BYTES = 256 << 20
MARKER_BASE_MAX_BYTES = 64 << 20
MIN_BLOCK_SIZE = 4096
MAX_WORLD_SIZE = 1 << 20

_CHECKED_RE = re.compile(rb'\A\{"crc32": ?(\d{1,10}), ?"body": ?(\{.*\})\}\Z', re.DOTALL)


def marker_max_bytes(manifest_bytes: int, rank_data_bytes: int) -> int:
    """The largest done-marker a real save writes for a rank with ``rank_data_bytes`` of data
    files, under a manifest of ``manifest_bytes`` (see ``MANIFEST_MAX_BYTES``)."""
    return MARKER_BASE_MAX_BYTES + 4 * manifest_bytes + 32 * -(-rank_data_bytes // MIN_BLOCK_SIZE)


def read_small(storage: Storage, path: str, limit: int) -> bytes:
    """The bytes of the metadata file ``path``: a regular file inside the root of at most
    ``limit`` bytes, or a ``CorruptCheckpointError`` (``FileNotFoundError`` when absent).

    A FIFO, a device, a symlink leaving the root or an oversized file is damage, never a read
    that blocks, runs out of memory or stalls (``FileSystemStorage.read_small``; other backends
    check the size before reading).
    """
    reader = getattr(storage, "read_small", None)
    try:
        if callable(reader):
            data = reader(path, limit)
        else:
            size = storage.size(path)
            if size > limit:
                raise CorruptCheckpointError(
                    f"{path}: {size} bytes, more than any real metadata file ({limit})", path
                )
            data = storage.read(path, 0, size)
    except (FileNotFoundError, CorruptCheckpointError):
        raise
    except (OSError, EOFError, ValueError) as e:
        raise CorruptCheckpointError(f"{path}: unreadable ({e})", path) from e
    if len(data) > limit:
        raise CorruptCheckpointError(f"{path}: more than {limit} bytes", path)
    return data


def dump_checked(body: dict[str, Any]) -> bytes:
    """``body`` as JSON with a CRC32 of its canonical text, so a damaged file is detected.

    The body is written as that canonical text, so a reader checks the CRC on the raw bytes
    before parsing anything."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return b'{"crc32":%d,"body":%s}' % (zlib.crc32(text), text)


def load_checked(data: bytes, path: str) -> dict[str, Any]:
    """The body of a ``dump_checked`` file; any damage (checksum, syntax, nesting, memory) is a
    ``CorruptCheckpointError``.

    Files written since the body is stored canonically are checked before parsing; older ones
    (body re-serialised by ``json.dumps``) are parsed first, with every parse error caught."""
    m = _CHECKED_RE.match(data)
    if m is not None and zlib.crc32(m.group(2)) == int(m.group(1)):
        try:
            body = json.loads(m.group(2))
        except Exception as e:  # RecursionError, MemoryError, ... : not our file
            raise CorruptCheckpointError(
                f"{path}: unreadable JSON ({type(e).__name__})", path
            ) from None
        if not isinstance(body, dict):
            raise CorruptCheckpointError(f"{path}: body is not a JSON object", path)
        return body
    if not data.startswith(b'{"crc32"'):
        raise CorruptCheckpointError(
            f"{path}: not a checkpoint JSON file (or its checksum fails)", path
        )
    try:
        outer = json.loads(data)
        body = outer["body"]
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        ok = zlib.crc32(text.encode()) == outer["crc32"] and isinstance(body, dict)
    except Exception as e:  # RecursionError, MemoryError, ... : damaged, never a crash
        raise CorruptCheckpointError(
            f"{path}: not a valid checkpoint JSON file ({type(e).__name__}: {str(e)[:200]})", path
        ) from None
    if not ok:
        raise CorruptCheckpointError(f"{path}: checksum mismatch, the file is corrupt", path)
    return body


# -------------------------------------------------------------------- safetensors headers


def safetensors_header(
    tensors: Sequence[tuple[str, str, Sequence[int], int, int]], metadata: dict[str, str] | None
) -> bytes:
    """The 8-byte length and JSON header of a safetensors file.

    ``tensors``: ``(name, safetensors dtype code, shape, start, end)`` with offsets relative
    to the data section, which must tile it without holes.
    """
    head: dict[str, Any] = {}
    if metadata:
        head["__metadata__"] = metadata
    for name, code, shape, start, end in tensors:
        head[name] = {"dtype": code, "shape": list(shape), "data_offsets": [start, end]}
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def parse_safetensors_header(read: Callable[[int, int], bytes], path: str) -> tuple[dict, int]:
    """(header dict, start of the data section) of a safetensors file read through ``read``."""
    try:
        (n,) = struct.unpack("<Q", read(0, 8))
    except (EOFError, struct.error) as e:
        raise CorruptCheckpointError(f"{path}: too short for a safetensors file", path) from e
    if n > 100_000_000:
        raise CorruptCheckpointError(f"{path}: safetensors header length {n} is absurd", path)
    try:
        head = json.loads(read(8, n))
    except EOFError as e:
        raise CorruptCheckpointError(f"{path}: unreadable safetensors header ({e})", path) from e
    except Exception as e:  # any parse error, RecursionError included, is damage
        raise CorruptCheckpointError(
            f"{path}: unreadable safetensors header ({type(e).__name__}: {str(e)[:200]})", path
        ) from None
    if not isinstance(head, dict):
        raise CorruptCheckpointError(f"{path}: safetensors header is not a JSON object", path)
    return head, 8 + n


# ------------------------------------------------------------------------ checksummed write


def block_digest(data: memoryview) -> int:
    """The checksum of one block: XXH3-64 (about 5x zlib's CRC32 per core; a checked load
    costs little more than an unchecked one)."""
    return xxhash.xxh3_64_intdigest(data)


def block_hasher() -> Any:
    """A streaming hasher giving ``block_digest`` of the bytes fed to it."""
    return xxhash.xxh3_64()


def _block_digests(pieces: Sequence[memoryview], block_size: int) -> list[int]:
    digests: list[int] = []
    hasher = xxhash.xxh3_64()
    fill = 0
    for piece in pieces:
        j = 0
        n = piece.nbytes
        while j < n:
            take = min(block_size - fill, n - j)
            hasher.update(piece[j : j + take])
            fill += take
            j += take
            if fill == block_size:
                digests.append(hasher.intdigest())
                hasher.reset()
                fill = 0
    if fill:
        digests.append(hasher.intdigest())
    return digests


def write_checksummed(
    storage: Storage, path: str, pieces: Sequence[Any], block_size: int
) -> tuple[int, list[int]]:
    """Write the concatenation of ``pieces`` to ``path``; return (size, per-block digests).

    The checksums are computed by a helper thread while the bytes are written (both release
    the GIL), so checksumming costs no extra wall time on large files.
    """
    views = [memoryview(p).cast("B") for p in pieces]
    total = sum(v.nbytes for v in views)
    result: list[list[int]] = []
    errors: list[BaseException] = []

    def crc_job() -> None:
        try:
            result.append(_block_digests(views, block_size))
        except BaseException as e:  # pragma: no cover - xxhash does not fail on memoryviews
            errors.append(e)

    worker = None
    if total >= 4 * block_size:
        worker = threading.Thread(target=crc_job, name="tcp-crc", daemon=True)
        worker.start()

    def chunks():
        for v in views:
            for i in range(0, v.nbytes, WRITE_CHUNK):
                yield v[i : i + WRITE_CHUNK]

    try:
        storage.write(path, chunks())
    finally:
        if worker is not None:
            worker.join()
    if worker is None:
        crc_job()
    if errors:  # pragma: no cover
        raise errors[0]
    return total, result[0]


# ------------------------------------------------------------------------ verified reads


@dataclass(slots=True)
class ReadRequest:
    """Bytes ``[start, end)`` of a file, to land in ``dst`` (a writable byte memoryview)."""

    start: int
    end: int
    dst: memoryview


def read_verified(
    storage: Storage,
    path: str,
    requests: Sequence[ReadRequest],
    *,
    size: int,
    block_size: int | None,
    crcs: Sequence[int] | None,
    max_segment: int = 64 << 20,
    on_read: Callable[[int], None] | None = None,
) -> None:
    """Fill every request from ``path``, reading only the checksum blocks they touch.

    A block that one request covers entirely is read straight into that request's buffer;
    other blocks are read once into a scratch buffer and copied to every request touching
    them. Each block read is checked against its digest. Without ``crcs`` (files from other
    tools) each request is read as is.
    """
    reqs = sorted((r for r in requests if r.end > r.start), key=lambda r: r.start)
    for r in reqs:
        if r.end > size:
            raise CorruptCheckpointError(
                f"{path}: needs bytes up to {r.end} but the file has {size}; it is truncated",
                path,
            )
    if crcs is None or block_size is None:
        for r in reqs:
            storage.read_into(path, r.start, r.dst)
            if on_read:
                on_read(r.end - r.start)
        return
    nblocks = -(-size // block_size)
    if len(crcs) != nblocks:
        raise CorruptCheckpointError(
            f"{path}: {size} bytes should have {nblocks} checksum blocks, its marker lists "
            f"{len(crcs)}; the file is truncated or replaced",
            path,
        )
    touched: dict[int, list[int]] = {}
    for i, r in enumerate(reqs):
        for blk in range(r.start // block_size, (r.end - 1) // block_size + 1):
            touched.setdefault(blk, []).append(i)

    def block_range(blk: int) -> tuple[int, int]:
        return blk * block_size, min((blk + 1) * block_size, size)

    def direct_owner(blk: int) -> int | None:
        owners = touched[blk]
        if len(owners) != 1:
            return None
        r = reqs[owners[0]]
        lo, hi = block_range(blk)
        return owners[0] if r.start <= lo and r.end >= hi else None

    def verify(view: memoryview, first_blk: int) -> None:
        off = 0
        blk = first_blk
        while off < view.nbytes:
            lo, hi = block_range(blk)
            if block_digest(view[off : off + hi - lo]) != crcs[blk]:
                raise CorruptCheckpointError(
                    f"{path}: checksum mismatch in bytes [{lo}, {hi}) (block {blk}); "
                    "the file is corrupt",
                    path,
                )
            off += hi - lo
            blk += 1

    blocks = sorted(touched)
    i = 0
    while i < len(blocks):
        blk = blocks[i]
        owner = direct_owner(blk)
        j = i + 1
        seg_bytes = block_range(blk)[1] - block_range(blk)[0]
        while (
            j < len(blocks)
            and blocks[j] == blocks[j - 1] + 1
            and direct_owner(blocks[j]) == owner
            and (owner is not None or seg_bytes < max_segment)
        ):
            seg_bytes += block_range(blocks[j])[1] - block_range(blocks[j])[0]
            j += 1
        lo = block_range(blk)[0]
        hi = block_range(blocks[j - 1])[1]
        if owner is not None:
            # Straight into the caller's buffer, a few blocks per read, each verified while
            # it is still in the CPU cache.
            r = reqs[owner]
            step = max(1, _VERIFY_CHUNK // block_size) * block_size
            pos = lo
            while pos < hi:
                nxt = min(hi, pos + step)
                view = r.dst[pos - r.start : nxt - r.start]
                storage.read_into(path, pos, view)
                verify(view, pos // block_size)
                pos = nxt
        else:
            buf = bytearray(hi - lo)
            view = memoryview(buf)
            storage.read_into(path, lo, view)
            verify(view, blk)
            seen: set[int] = set()
            for b in range(blk, blocks[j - 1] + 1):
                for k in touched[b]:
                    if k in seen:
                        continue
                    seen.add(k)
                    r = reqs[k]
                    x, y = max(r.start, lo), min(r.end, hi)
                    if x < y:
                        r.dst[x - r.start : y - r.start] = view[x - lo : y - lo]
        if on_read:
            on_read(hi - lo)
        i = j
