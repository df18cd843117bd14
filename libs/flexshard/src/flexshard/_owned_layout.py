"""``Owned``: each parameter whole on one rank, gathered by broadcast, reduced to its owner."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from flexshard._groups import GroupInfo
from flexshard._layout import Layout, Pending
from flexshard.placements import Owned


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
