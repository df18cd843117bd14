"""What each rank writes: the layout digest, the one metadata exchange, and this rank's chunks.

The first time a *global layout* (items, keys, kinds, dtypes, global shapes, DTensor meshes
and placements) is saved, the ranks run ONE ``allgather`` of a fixed-size int64 record
(layout digest, a fresh nonce from rank 0, the bytes each rank writes anyway); from it every
rank derives the same balanced choice of who writes each replicated plain tensor. Never again
for that layout.

Everything that depends only on the layout (a DTensor shard's global offsets, whether this
rank writes that shard's replica) is computed once per layout and cached: torch's
``compute_local_shape_and_global_offset`` allocates an ``arange`` over the sharded dimension,
which costs more than copying a large 1-D shard.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import zlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from . import _format as fmt
from . import _reshard as rs
from . import _tree as tr
from ._errors import CheckpointError

FORMAT_VERSION = 1


class Chunk(NamedTuple):
    """One box of a global tensor this rank writes."""

    item: str
    key: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    src: torch.Tensor


@dataclass(slots=True)
class GlobalPlan:
    """What the exchange decided for one layout."""

    digest: bytes
    nonce: str
    writer_of: dict[tuple[str, str], int]  # replicated plain tensor -> the rank writing it
    manifest_items: dict[str, Any]


_ARITH_ROWS = 1 << 20


def shard_box(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: Any, placements: Any
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offsets) of the shard at mesh ``coord`` of a tensor placed with
    ``Shard`` / ``Replicate``: each ``Shard(d)``, left to right, splits the current extent of
    dim ``d`` as ``torch.chunk`` does. Arithmetic only (torch's own computation allocates an
    index tensor the size of the sharded dimension)."""
    local, off = list(shape), [0] * len(shape)
    for m, p in enumerate(placements):
        d = getattr(p, "dim", None)
        if d is None:  # Replicate
            continue
        d %= len(shape)
        size, n = local[d], mesh_shape[m]
        chunk = -(-size // n)
        start = min(int(coord[m]) * chunk, size)
        local[d] = min(size, start + chunk) - start
        off[d] += start
    return tuple(local), tuple(off)


class LayoutCache:
    """DTensor facts that depend only on (mesh, placements, global shape), per manager."""

    def __init__(self) -> None:
        self._offsets: dict[tuple, tuple[int, ...] | None] = {}
        self._writes: dict[tuple, bool] = {}

    def dtensor_offsets(self, dt: Any, name: str) -> tuple[int, ...] | None:
        """Global offsets of this rank's shard of ``dt`` (``None``: not in its mesh)."""
        mesh = dt.device_mesh
        key = (mesh, tuple(dt.placements), tuple(dt.shape))
        try:
            return self._offsets[key]
        except KeyError:
            pass
        rs.check_placements(dt, name)
        offsets = None
        coord = mesh.get_coordinate()
        if coord is not None:
            # torch's computation is the reference, but allocates an int64 index over each
            # sharded dim (64 MiB for 8 M rows, on the first save or load of a layout): past
            # _ARITH_ROWS rows, the same split by arithmetic, checked against the local shape.
            local, off = shard_box(tuple(dt.shape), tuple(mesh.shape), coord, dt.placements)
            rows = max((dt.shape[p.dim] for p in dt.placements if hasattr(p, "dim")), default=0)
            if rows <= _ARITH_ROWS or local != tuple(dt._local_tensor.shape):
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                _, off = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
            offsets = tuple(int(o) for o in off)
        self._offsets[key] = offsets
        return offsets

    def local_chunks(self, leaf: tr.Leaf) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """``_reshard.local_chunks`` with DTensor offsets from the cache."""
        if leaf.kind != "dtensor":
            return rs.local_chunks(leaf)
        offsets = self.dtensor_offsets(leaf.obj, leaf.key)
        return [] if offsets is None else [(offsets, leaf.obj._local_tensor)]

    def writes_replica(self, dt: Any, name: str) -> bool:
        """Whether this rank writes its shard of ``dt``: on every mesh dim where the tensor is
        replicated, one coordinate (chosen by a hash of the name, to spread the writes) does."""
        mesh = dt.device_mesh
        key = (mesh, tuple(dt.placements), name)
        hit = self._writes.get(key)
        if hit is not None:
            return hit
        from torch.distributed.tensor import Replicate

        rs.check_placements(dt, name)
        coord = mesh.get_coordinate()
        h = zlib.crc32(name.encode())
        writes = coord is not None and all(
            coord[d] == h % mesh.size(d)
            for d, p in enumerate(dt.placements)
            if isinstance(p, Replicate)
        )
        self._writes[key] = writes
        return writes

    def clear(self) -> None:
        self._offsets.clear()
        self._writes.clear()


# ------------------------------------------------------------------------- collectives


def _pg_device(pg: Any) -> torch.device:
    try:
        import torch.distributed as dist

        backend = str(dist.get_backend(pg))
    except Exception:
        try:
            backend = str(pg.name())
        except Exception:
            backend = "gloo"
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def allgather_int64(pg: Any, values: list[int]) -> list[list[int]]:
    t = torch.tensor(values, dtype=torch.int64, device=_pg_device(pg))
    out = [torch.empty_like(t) for _ in range(pg.size())]
    pg.allgather([out], [t]).wait()
    return [o.cpu().tolist() for o in out]


def allgather_bytes(pg: Any, data: bytes) -> list[bytes]:
    """Variable-size exchange (two collectives); used only to explain a layout mismatch."""
    sizes = allgather_int64(pg, [len(data)])
    n = max(s[0] for s in sizes)
    dev = _pg_device(pg)
    t = torch.zeros(n, dtype=torch.uint8, device=dev)
    if data:
        t[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    out = [torch.empty_like(t) for _ in range(pg.size())]
    pg.allgather([out], [t]).wait()
    return [bytes(o.cpu()[: s[0]].tolist()) for o, s in zip(out, sizes, strict=True)]


# ------------------------------------------------------------------------------ layout


def digest(flats: dict[str, tr.Flat], world_size: int, block_size: int) -> tuple[bytes, list[str]]:
    """A digest of the global layout, and its text (to explain a mismatch between ranks)."""
    lines = [f"format={FORMAT_VERSION} world={world_size} block={block_size}"]
    for item in sorted(flats):
        flat = flats[item]
        if flat.per_rank:
            lines.append(f"item {item!r} per_rank")
            continue
        lines.append(f"item {item!r}")
        for key in sorted(flat.leaves):
            leaf = flat.leaves[key]
            line = f"  {tr.display(item, key)!r} {leaf.kind} {leaf.dtype} {list(leaf.shape)}"
            if leaf.kind == "dtensor":
                mesh = leaf.obj.device_mesh
                line += f" mesh={tuple(mesh.shape)} placements={tuple(leaf.obj.placements)}"
            lines.append(line)
    return hashlib.sha256("\n".join(lines).encode()).digest(), lines


def exchange(
    pg: Any,
    rank: int,
    flats: dict[str, tr.Flat],
    layout_digest: bytes,
    summary: list[str],
    own: list[Chunk],
) -> GlobalPlan:
    """The one collective of a layout (none without a group): check that every rank sees the
    same layout, agree on a nonce, and deal the replicated plain tensors to ranks by load."""
    words = [
        int.from_bytes(layout_digest[i : i + 8], "little", signed=True) for i in range(0, 32, 8)
    ]
    nonce = secrets.randbits(47) if rank == 0 else 0
    record = [*words, nonce, sum(c.nbytes for c in own), FORMAT_VERSION]
    rows = [record] if pg is None else allgather_int64(pg, record)
    if any(r[:4] != rows[0][:4] for r in rows):
        _explain_mismatch(pg, rows, summary)
    loads = [r[5] for r in rows]
    replicated = sorted(
        (-math.prod(leaf.shape) * fmt.DTYPES[leaf.dtype][0], item, key)
        for item, flat in flats.items()
        if not flat.per_rank
        for key, leaf in flat.leaves.items()
        if leaf.kind == "tensor"
    )
    writer_of: dict[tuple[str, str], int] = {}
    for negbytes, item, key in replicated:
        r = min(range(len(loads)), key=lambda i: (loads[i], i))
        writer_of[(item, key)] = r
        loads[r] += -negbytes
    items = {}
    for item in sorted(flats):
        flat = flats[item]
        items[item] = {
            "per_rank": flat.per_rank,
            "entries": {}
            if flat.per_rank
            else {k: [lf.kind, lf.dtype, list(lf.shape)] for k, lf in flat.leaves.items()},
        }
    return GlobalPlan(layout_digest, f"{rows[0][4]:012x}", writer_of, items)


def _explain_mismatch(pg: Any, rows: list[list[int]], summary: list[str]) -> None:
    differing = [r for r, row in enumerate(rows) if row[:4] != rows[0][:4]]
    try:
        texts = allgather_bytes(pg, "\n".join(summary).encode())
        base = set(texts[0].decode().splitlines())
        parts = []
        for r in differing[:4]:
            mine = set(texts[r].decode().splitlines())
            only_r, only_0 = sorted(mine - base)[:8], sorted(base - mine)[:8]
            parts.append(f"rank {r} has {only_r} where rank 0 has {only_0}")
        detail = "; ".join(parts)
    except Exception as e:  # pragma: no cover - best effort
        detail = f"(could not exchange details: {e})"
    raise CheckpointError(
        f"save: ranks {differing} see a different state layout from rank 0 (every rank "
        f"must save the same items, keys, dtypes, global shapes and placements): {detail}"
    )


# ---------------------------------------------------------------------------- chunks


def _whole(item: str, key: str, leaf: tr.Leaf) -> Chunk:
    t = leaf.obj
    nbytes = t.numel() * fmt.DTYPES[leaf.dtype][0]
    return Chunk(item, key, (0,) * t.dim(), tuple(t.shape), leaf.dtype, nbytes, t)


def own_chunks(flats: dict[str, tr.Flat], layout: LayoutCache) -> list[Chunk]:
    """Chunks this rank writes whatever the exchange says: its DTensor shards (one replica
    per shard), its sharded-protocol chunks, its PerRank tensors."""
    out = []
    for item, flat in flats.items():
        for key, leaf in flat.leaves.items():
            if flat.per_rank:
                out.append(_whole(item, key, leaf))
                continue
            if leaf.kind == "tensor":
                continue
            if leaf.kind == "dtensor" and not layout.writes_replica(leaf.obj, f"{item}/{key}"):
                continue
            isz = fmt.DTYPES[leaf.dtype][0]
            for offsets, t in layout.local_chunks(leaf):
                if t.numel():
                    out.append(
                        Chunk(item, key, offsets, tuple(t.shape), leaf.dtype, t.numel() * isz, t)
                    )
    return out


def replicated_chunks(flats: dict[str, tr.Flat], plan: GlobalPlan, rank: int) -> list[Chunk]:
    """The replicated plain tensors the exchange dealt to this rank."""
    return [
        _whole(item, key, leaf)
        for item, flat in flats.items()
        if not flat.per_rank
        for key, leaf in flat.leaves.items()
        if leaf.kind == "tensor" and plan.writer_of[(item, key)] == rank
    ]
