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

from flexshard._groups import GroupInfo
from flexshard.placements import BlockShard, Owned, Placement, Replicate, Shard

UINT8 = torch.uint8
FP8_E4M3 = torch.float8_e4m3fn


class DeviceOnly:
    """Stands in for the flat buffer at issue time: layouts only read its device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device


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
        flat: torch.Tensor | DeviceOnly,
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

    def finish_reduce(self, p: Pending, predivide: bool) -> list[torch.Tensor | None]:
        p.wait()
        out = self._sum_over_ranks(p.recv) if self.rank_ordered else p.recv
        p.keep = []
        if not predivide:
            out.div_(self.g.divide)
        return [self.out_view(out, i) for i in range(len(self.infos))]


def make_layout(placement: Placement, infos: list[Any], g: GroupInfo) -> Layout:
    from flexshard._block_layout import BlockShardLayout  # (they subclass Layout)
    from flexshard._owned_layout import OwnedLayout

    if isinstance(placement, Shard):
        return ShardLayout(infos, g, placement)
    if isinstance(placement, BlockShard):
        return BlockShardLayout(infos, g, placement)
    if isinstance(placement, Owned):
        return OwnedLayout(infos, g, placement)
    if isinstance(placement, Replicate):
        return ReplicateLayout(infos, g, placement)
    raise ValueError(f"unknown placement {placement!r}")
