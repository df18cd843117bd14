"""How one bucket's parameters are laid out over the ranks, and its collectives.

A layout knows, for every parameter of a bucket, which part each rank holds; it builds the
local shard from a full tensor, lists the local chunks with their global offsets, and issues
(asynchronously) and finishes the bucket's gather (full parameters from the shards) and
reduction (gradients to their placement). Layouts do no autograd and hold no state between
calls beyond the static layout; the runtime (``_runtime.py``) drives them.

Every layout writes gathered parameters into one flat buffer at offsets it chooses
(``full_offsets``), so ``Owned`` can broadcast each owner's parameters as one contiguous
region and the runtime can free a bucket with one storage resize.

Reduction order. By default gradients are summed by the backend's collective (NCCL / gloo
choose the order, so the last bit of a sum of >= 3 ranks depends on the algorithm). With
``rank_ordered`` each rank instead receives every rank's contribution to its part (one
all-to-all, the bytes of a reduce-scatter; an all-gather for ``Replicate``) and adds them in
rank order 0, 1, 2, ...: the result equals, bit for bit, a single process summing the
per-rank gradients in that order, on any backend and world size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from flexshard.fp8 import dequantize_tiles, quantize_tiles
from flexshard.placements import BlockShard, Owned, Placement, Replicate, Shard

_U8 = torch.uint8
_FP8 = torch.float8_e4m3fn


class CommStats:
    """Bytes this rank put into collectives (the send buffer of each call), by kind."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + int(nbytes)
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"bytes": dict(self.bytes), "calls": dict(self.calls)}


@dataclass
class Pending:
    """An in-flight collective: its work handles and the buffers it must keep alive."""

    works: list[Any] = field(default_factory=list)
    recv: Any = None
    keep: list[Any] = field(default_factory=list)
    transient_bytes: int = 0
    extra: Any = None

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = []


@dataclass
class GroupInfo:
    """The ranks a bucket is laid out over (``group``) and, under HSDP, the replicas of this
    rank's shard (``replicate_group``); gradients are divided by ``divide`` once reduced."""

    group: Any
    rank: int
    world: int
    replicate_group: Any = None
    replicate_world: int = 1
    divide: float = 1.0


class Layout:
    """Base class. ``infos`` are the bucket's ``ParamInfo`` objects, in bucket order."""

    placement: Placement
    # True: issue_gather writes into ``flat`` (which must exist then); False: it only reads
    # ``flat.device`` and the data arrive in finish_gather.
    writes_flat_at_issue = False
    # Sum gradients in rank order (see the module docstring); set by ``shard``.
    rank_ordered = False

    def __init__(self, infos: list[Any], g: GroupInfo) -> None:
        self.infos = infos
        self.g = g
        off = 0
        self.full_offsets: list[int] = [0] * len(infos)
        for i in self.full_order():
            self.full_offsets[i] = off
            off += infos[i].numel
        self.full_numel = off

    # -- static layout -------------------------------------------------------------------
    def full_order(self) -> list[int]:
        return list(range(len(self.infos)))

    def local_from_full(self, i: int, full: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def local_chunks(
        self, i: int, local: torch.Tensor
    ) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        raise NotImplementedError

    def holds_anything(self, i: int) -> bool:
        return True

    # -- collectives ---------------------------------------------------------------------
    def issue_gather(
        self,
        locals_: list[torch.Tensor],
        flat: torch.Tensor,
        dtype: torch.dtype,
        quantize: str | None,
        stats: CommStats,
    ) -> Pending:
        raise NotImplementedError

    def finish_gather(self, p: Pending, flat: torch.Tensor) -> None:
        p.wait()

    def issue_reduce(
        self,
        grads: list[torch.Tensor | None],
        rdtype: torch.dtype,
        predivide: bool,
        stats: CommStats,
        device: torch.device,
    ) -> Pending:
        raise NotImplementedError

    def finish_reduce(self, p: Pending, predivide: bool) -> list[torch.Tensor | None]:
        raise NotImplementedError

    # -- helpers -------------------------------------------------------------------------
    def _reduce_scatter(
        self, send: torch.Tensor, out_numel: int, predivide: bool, stats: CommStats
    ) -> Pending:
        """Start the (optionally pre-divided) sum-reduce-scatter of ``send`` into a new buffer."""
        if predivide:
            send.div_(self.g.divide)
        if self.rank_ordered:  # every rank's segment for this rank, summed at finish
            recv = torch.empty(self.g.world * out_numel, dtype=send.dtype, device=send.device)
            work = dist.all_to_all_single(recv, send, group=self.g.group, async_op=True)
            stats.add("all_to_all", send.nbytes)
            return Pending([work], recv, [send], send.nbytes + recv.nbytes)
        out = torch.empty(out_numel, dtype=send.dtype, device=send.device)
        work = dist.reduce_scatter_tensor(
            out, send, op=dist.ReduceOp.SUM, group=self.g.group, async_op=True
        )
        stats.add("reduce_scatter", send.nbytes)
        return Pending([work], out, [send], send.nbytes + out.nbytes)

    def _reduced(self, p: Pending, predivide: bool) -> torch.Tensor:
        """Wait for ``_reduce_scatter`` and return this rank's averaged segment."""
        p.wait()
        out = self._sum_over_ranks(p.recv) if self.rank_ordered else p.recv
        if not predivide:
            out.div_(self.g.divide)
        return out

    def _full_send(
        self,
        grads: list[torch.Tensor | None],
        rdtype: torch.dtype,
        predivide: bool,
        device: torch.device,
    ) -> torch.Tensor:
        """Every gradient of the bucket at its ``full_offsets`` (zeros for missing ones) in
        ``rdtype``, pre-divided by the world size when asked."""
        send = torch.empty(self.full_numel, dtype=rdtype, device=device)
        for i, gr in enumerate(grads):
            v = self.out_view(send, i)
            if gr is None:
                v.zero_()
            else:
                v.copy_(gr)
        if predivide:
            send.div_(self.g.divide)
        return send

    def _sum_over_ranks(self, recv: torch.Tensor) -> torch.Tensor:
        """The ``world`` equal parts of ``recv`` added in rank order 0, 1, 2, ..."""
        parts = recv.view(self.g.world, -1)
        out = parts[0].clone()
        for r in range(1, self.g.world):
            out.add_(parts[r])
        return out

    def out_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        info = self.infos[i]
        off = self.full_offsets[i]
        return flat[off : off + info.numel].view(info.shape)


# ---------------------------------------------------------------------------------------
# Shard(dim)
# ---------------------------------------------------------------------------------------


@dataclass
class _ShardSpec:
    d: int
    n: int
    chunk: int
    start: int
    length: int
    pshape: tuple[int, ...]
    pnumel: int
    seg_off: int


class ShardLayout(Layout):
    def __init__(self, infos: list[Any], g: GroupInfo, placement: Shard) -> None:
        self.placement = placement
        self.specs: list[_ShardSpec] = []
        off = 0
        for info in infos:
            nd = len(info.shape)
            d = placement.dim + nd if placement.dim < 0 else placement.dim
            n = info.shape[d]
            chunk = math.ceil(n / g.world)
            start = min(g.rank * chunk, n)
            length = max(0, min((g.rank + 1) * chunk, n) - start)
            pshape = (*info.shape[:d], chunk, *info.shape[d + 1 :])
            pnumel = math.prod(pshape)
            self.specs.append(_ShardSpec(d, n, chunk, start, length, pshape, pnumel, off))
            off += pnumel
        self.seg = off
        super().__init__(infos, g)

    def local_from_full(self, i: int, full: torch.Tensor) -> torch.Tensor:
        s = self.specs[i]
        return full.narrow(s.d, s.start, s.length).clone(memory_format=torch.contiguous_format)

    def local_chunks(self, i, local):
        s = self.specs[i]
        if s.length == 0:
            return []
        offset = [0] * len(self.infos[i].shape)
        offset[s.d] = s.start
        return [(tuple(offset), local)]

    def holds_anything(self, i: int) -> bool:
        return self.specs[i].length > 0

    def _pack(self, send: torch.Tensor, locals_: list[torch.Tensor]) -> None:
        for s, loc in zip(self.specs, locals_, strict=True):
            if s.pnumel == 0:
                continue
            v = send[s.seg_off : s.seg_off + s.pnumel].view(s.pshape)
            if s.length:
                v.narrow(s.d, 0, s.length).copy_(loc)
            if s.length < s.chunk:
                v.narrow(s.d, s.length, s.chunk - s.length).zero_()

    def issue_gather(self, locals_, flat, dtype, quantize, stats):
        W = self.g.world
        dev = flat.device
        send = torch.empty(self.seg, dtype=dtype, device=dev)
        self._pack(send, locals_)
        recv = torch.empty(W * self.seg, dtype=dtype, device=dev)
        work = dist.all_gather_into_tensor(recv, send, group=self.g.group, async_op=True)
        stats.add("all_gather", send.nbytes)
        return Pending([work], recv, [send], send.nbytes + recv.nbytes)

    def finish_gather(self, p, flat):
        p.wait()
        W = self.g.world
        rv = p.recv.view(W, self.seg)
        for i, s in enumerate(self.specs):
            if s.pnumel == 0:
                continue
            out = self.out_view(flat, i)
            g = rv[:, s.seg_off : s.seg_off + s.pnumel].view(W, *s.pshape)
            k, rem = divmod(s.n, s.chunk)
            if k:
                out.narrow(s.d, 0, k * s.chunk).unflatten(s.d, (k, s.chunk)).copy_(
                    g[:k].movedim(0, s.d)
                )
            if rem:
                out.narrow(s.d, k * s.chunk, rem).copy_(g[k].narrow(s.d, 0, rem))
        p.recv = None
        p.keep = []

    def issue_reduce(self, grads, rdtype, predivide, stats, device):
        W = self.g.world
        send = torch.empty(W * self.seg, dtype=rdtype, device=device)
        sv = send.view(W, self.seg)
        for s, gr in zip(self.specs, grads, strict=True):
            if s.pnumel == 0:
                continue
            dst = sv[:, s.seg_off : s.seg_off + s.pnumel].view(W, *s.pshape)
            if gr is None:
                dst.zero_()
                continue
            k, rem = divmod(s.n, s.chunk)
            if k:
                dst[:k].movedim(0, s.d).copy_(
                    gr.narrow(s.d, 0, k * s.chunk).unflatten(s.d, (k, s.chunk))
                )
            if rem:
                dst[k].narrow(s.d, 0, rem).copy_(gr.narrow(s.d, k * s.chunk, rem))
                dst[k].narrow(s.d, rem, s.chunk - rem).zero_()
                if k + 1 < W:
                    dst[k + 1 :].zero_()
            elif k < W:
                dst[k:].zero_()
        return self._reduce_scatter(send, self.seg, predivide, stats)

    def finish_reduce(self, p, predivide):
        out = self._reduced(p, predivide)
        res: list[torch.Tensor | None] = []
        for s in self.specs:
            res.append(
                out[s.seg_off : s.seg_off + s.pnumel].view(s.pshape).narrow(s.d, 0, s.length)
            )
        p.keep = []
        return res


# ---------------------------------------------------------------------------------------
# BlockShard(block=(r, c))
# ---------------------------------------------------------------------------------------


@dataclass
class _BlockSpec:
    nti: int
    ntj: int
    counts: list[int]  # tiles held by each rank
    offsets: list[int]  # tile offset of this param in each rank's segment
    local_tiles: torch.Tensor  # indices of this rank's tiles (row-major tile index)
    src_index: torch.Tensor  # for every tile: its position in the (world * M) tile array
    owners: torch.Tensor  # owning rank of every tile


class BlockShardLayout(Layout):
    def __init__(self, infos: list[Any], g: GroupInfo, placement: BlockShard) -> None:
        self.placement = placement
        br, bc = placement.block
        self.tile = br * bc
        W = g.world
        k0 = 0
        rank_tiles = [0] * W
        specs = []
        for info in infos:
            R, C = info.shape
            nti, ntj = R // br, C // bc
            nt = nti * ntj
            owners = (torch.arange(nt) + k0) % W
            k0 += nt
            counts = [int((owners == r).sum()) for r in range(W)]
            offsets = list(rank_tiles)
            src = torch.empty(nt, dtype=torch.long)
            for r in range(W):
                idx = (owners == r).nonzero().flatten()
                src[idx] = torch.arange(counts[r]) + offsets[r]  # offset inside rank r's segment
                rank_tiles[r] += counts[r]
            local = (owners == g.rank).nonzero().flatten()
            specs.append(_BlockSpec(nti, ntj, counts, offsets, local, src, owners))
        self.M = max(rank_tiles) if rank_tiles else 0
        for s in specs:
            s.src_index = s.src_index + s.owners * self.M
        self.specs = specs
        self.my_tiles = rank_tiles[g.rank]
        super().__init__(infos, g)

    def _tiles(self, full: torch.Tensor, s: _BlockSpec) -> torch.Tensor:
        br, bc = self.placement.block
        return full.view(s.nti, br, s.ntj, bc).permute(0, 2, 1, 3).reshape(s.nti * s.ntj, br, bc)

    def local_from_full(self, i, full):
        s = self.specs[i]
        return self._tiles(full, s).index_select(0, s.local_tiles.to(full.device)).contiguous()

    def local_chunks(self, i, local):
        s = self.specs[i]
        br, bc = self.placement.block
        out = []
        for j, t in enumerate(s.local_tiles.tolist()):
            ti, tj = divmod(t, s.ntj)
            out.append(((ti * br, tj * bc), local[j]))
        return out

    def holds_anything(self, i: int) -> bool:
        return self.specs[i].local_tiles.numel() > 0

    def _cat_local(self, locals_: list[torch.Tensor], dtype: torch.dtype, dev) -> torch.Tensor:
        br, bc = self.placement.block
        buf = torch.empty(self.M, br, bc, dtype=dtype, device=dev)
        for s, loc in zip(self.specs, locals_, strict=True):
            n = s.counts[self.g.rank]
            if n:
                buf[s.offsets[self.g.rank] : s.offsets[self.g.rank] + n].copy_(loc)
        if self.my_tiles < self.M:
            buf[self.my_tiles :].zero_()
        return buf

    def issue_gather(self, locals_, flat, dtype, quantize, stats):
        W, M, tile = self.g.world, self.M, self.tile
        dev = flat.device
        if quantize == "fp8_block":
            local = self._cat_local(locals_, torch.float32, dev)[: self.my_tiles]
            q, scale = quantize_tiles(local)
            seg = M * (tile + 4)
            send = torch.zeros(seg, dtype=_U8, device=dev)
            send[: self.my_tiles * tile].copy_(q.view(_U8).reshape(-1))
            send[M * tile : M * tile + 4 * self.my_tiles].copy_(scale.view(_U8))
            recv = torch.empty(W * seg, dtype=_U8, device=dev)
        else:
            send = self._cat_local(locals_, dtype, dev).view(-1)
            recv = torch.empty(W * M * tile, dtype=dtype, device=dev)
        work = dist.all_gather_into_tensor(recv, send, group=self.g.group, async_op=True)
        stats.add("all_gather", send.nbytes)
        return Pending([work], recv, [send], send.nbytes + recv.nbytes, extra=(quantize, dtype))

    def finish_gather(self, p, flat):
        p.wait()
        W, M, tile = self.g.world, self.M, self.tile
        br, bc = self.placement.block
        quantize, dtype = p.extra
        if quantize == "fp8_block":
            rv = p.recv.view(W, M * (tile + 4))
            q = rv[:, : M * tile].contiguous().view(_FP8).view(W * M, br, bc)
            scale = rv[:, M * tile :].contiguous().view(torch.float32).view(W * M)
            tiles = dequantize_tiles(q, scale, dtype)
        else:
            tiles = p.recv.view(W * M, br, bc)
        for i, s in enumerate(self.specs):
            out = self.out_view(flat, i)
            t = tiles.index_select(0, s.src_index.to(tiles.device))
            out.view(s.nti, br, s.ntj, bc).copy_(t.view(s.nti, s.ntj, br, bc).permute(0, 2, 1, 3))
        p.recv = None
        p.keep = []

    def issue_reduce(self, grads, rdtype, predivide, stats, device):
        W, M, tile = self.g.world, self.M, self.tile
        br, bc = self.placement.block
        send = torch.zeros(W * M * tile, dtype=rdtype, device=device)
        st = send.view(W * M, br, bc)
        for s, gr in zip(self.specs, grads, strict=True):
            if gr is None:
                continue
            st.index_copy_(0, s.src_index.to(device), self._tiles(gr.to(rdtype), s))
        return self._reduce_scatter(send, M * tile, predivide, stats)

    def finish_reduce(self, p, predivide):
        out = self._reduced(p, predivide)
        br, bc = self.placement.block
        tiles = out.view(self.M, br, bc)
        r = self.g.rank
        res: list[torch.Tensor | None] = []
        for s in self.specs:
            res.append(tiles[s.offsets[r] : s.offsets[r] + s.counts[r]])
        p.keep = []
        return res


# ---------------------------------------------------------------------------------------
# Owned
# ---------------------------------------------------------------------------------------


class OwnedLayout(Layout):
    """Parameters grouped by owner in the flat buffer: one broadcast / reduce per owner."""

    writes_flat_at_issue = True

    def __init__(self, infos: list[Any], g: GroupInfo, placement: Owned) -> None:
        self.placement = placement
        self.owners = [info.owner for info in infos]
        super().__init__(infos, g)
        self.regions: list[tuple[int, int, int, list[int]]] = []  # (owner, start, numel, members)
        for r in range(g.world):
            members = [i for i in self.full_order() if self.owners[i] == r]
            if not members:
                continue
            start = self.full_offsets[members[0]]
            numel = sum(infos[i].numel for i in members)
            self.regions.append((r, start, numel, members))

    def full_order(self) -> list[int]:
        return sorted(range(len(self.infos)), key=lambda i: self.owners[i])

    def local_from_full(self, i, full):
        if self.owners[i] == self.g.rank:
            return full.clone(memory_format=torch.contiguous_format)
        return full.new_empty(0)

    def local_chunks(self, i, local):
        if self.owners[i] != self.g.rank:
            return []
        return [((0,) * len(self.infos[i].shape), local)]

    def holds_anything(self, i: int) -> bool:
        return self.owners[i] == self.g.rank

    def issue_gather(self, locals_, flat, dtype, quantize, stats):
        works = []
        for r, start, numel, members in self.regions:
            if r == self.g.rank:
                for i in members:
                    self.out_view(flat, i).copy_(locals_[i].view(self.infos[i].shape))
                stats.add("broadcast", numel * flat.element_size())
            works.append(
                dist.broadcast(
                    flat[start : start + numel], group=self.g.group, group_src=r, async_op=True
                )
            )
        return Pending(works)

    def issue_reduce(self, grads, rdtype, predivide, stats, device):
        if self.rank_ordered:
            return self._issue_ordered_reduce(grads, rdtype, predivide, stats, device)
        works, bufs = [], []
        for r, start, numel, members in self.regions:
            send = torch.empty(numel, dtype=rdtype, device=device)
            for i in members:
                off = self.full_offsets[i] - start
                v = send[off : off + self.infos[i].numel].view(self.infos[i].shape)
                if grads[i] is None:
                    v.zero_()
                else:
                    v.copy_(grads[i])
            if predivide:
                send.div_(self.g.divide)
            works.append(
                dist.reduce(
                    send, group=self.g.group, group_dst=r, op=dist.ReduceOp.SUM, async_op=True
                )
            )
            stats.add("reduce", send.nbytes)
            bufs.append(send)
        return Pending(works, bufs, [], sum(b.nbytes for b in bufs))

    def _issue_ordered_reduce(self, grads, rdtype, predivide, stats, device) -> Pending:
        """One all-to-all: each owner receives every rank's gradients of its parameters (the
        flat order groups parameters by owner, so the send buffer is already split by
        destination)."""
        send = self._full_send(grads, rdtype, predivide, device)
        splits = [0] * self.g.world
        for r, _start, numel, _members in self.regions:
            splits[r] = numel
        mine = splits[self.g.rank]
        recv = torch.empty(self.g.world * mine, dtype=rdtype, device=device)
        work = dist.all_to_all_single(
            recv, send, [mine] * self.g.world, splits, group=self.g.group, async_op=True
        )
        stats.add("all_to_all", send.nbytes)
        return Pending([work], recv, [send], send.nbytes + recv.nbytes)

    def finish_reduce(self, p, predivide):
        p.wait()
        res: list[torch.Tensor | None] = [None] * len(self.infos)
        if self.rank_ordered:
            region = next((x for x in self.regions if x[0] == self.g.rank), None)
            if region is not None:
                _r, start, _numel, members = region
                out = self._sum_over_ranks(p.recv)
                if not predivide:
                    out.div_(self.g.divide)
                for i in members:
                    off = self.full_offsets[i] - start
                    res[i] = out[off : off + self.infos[i].numel].view(self.infos[i].shape)
            p.recv, p.keep = None, []
            return res
        for (r, start, _numel, members), send in zip(self.regions, p.recv, strict=True):
            if r != self.g.rank:
                continue
            if not predivide:
                send.div_(self.g.divide)
            for i in members:
                off = self.full_offsets[i] - start
                res[i] = send[off : off + self.infos[i].numel].view(self.infos[i].shape)
        p.recv = None
        return res


# ---------------------------------------------------------------------------------------
# Replicate
# ---------------------------------------------------------------------------------------


class ReplicateLayout(Layout):
    writes_flat_at_issue = True

    def __init__(self, infos: list[Any], g: GroupInfo, placement: Replicate) -> None:
        self.placement = placement
        super().__init__(infos, g)

    def local_from_full(self, i, full):
        return full.clone(memory_format=torch.contiguous_format)

    def local_chunks(self, i, local):
        return [((0,) * len(self.infos[i].shape), local)]

    def issue_gather(self, locals_, flat, dtype, quantize, stats):
        for i, loc in enumerate(locals_):
            self.out_view(flat, i).copy_(loc)
        return Pending()

    def issue_reduce(self, grads, rdtype, predivide, stats, device):
        send = self._full_send(grads, rdtype, predivide, device)
        if self.rank_ordered:  # every rank's whole gradient, summed in rank order at finish
            recv = torch.empty(self.g.world * send.numel(), dtype=rdtype, device=device)
            work = dist.all_gather_into_tensor(recv, send, group=self.g.group, async_op=True)
            stats.add("all_gather", send.nbytes)
            return Pending([work], recv, [send], send.nbytes + recv.nbytes)
        work = dist.all_reduce(send, op=dist.ReduceOp.SUM, group=self.g.group, async_op=True)
        stats.add("all_reduce", send.nbytes)
        return Pending([work], send, [], send.nbytes)

    def finish_reduce(self, p, predivide):
        p.wait()
        out = self._sum_over_ranks(p.recv) if self.rank_ordered else p.recv
        p.keep = []
        if not predivide:
            out.div_(self.g.divide)
        return [self.out_view(out, i) for i in range(len(self.infos))]


def make_layout(placement: Placement, infos: list[Any], g: GroupInfo) -> Layout:
    if isinstance(placement, Shard):
        return ShardLayout(infos, g, placement)
    if isinstance(placement, BlockShard):
        return BlockShardLayout(infos, g, placement)
    if isinstance(placement, Owned):
        return OwnedLayout(infos, g, placement)
    if isinstance(placement, Replicate):
        return ReplicateLayout(infos, g, placement)
    raise ValueError(f"unknown placement {placement!r}")
