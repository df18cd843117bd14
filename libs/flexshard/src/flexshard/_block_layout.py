"""``BlockShard``: 2-D tiles dealt round-robin over the ranks, with the block-FP8 gather."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flexshard._groups import GroupInfo
from flexshard._layout import FP8_E4M3, UINT8, Layout, Pending
from flexshard.fp8 import dequantize_tiles, quantize_tiles
from flexshard.placements import BlockShard


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
        self.block: tuple[int, int] = placement.block
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
        br, bc = self.block
        return full.view(s.nti, br, s.ntj, bc).permute(0, 2, 1, 3).reshape(s.nti * s.ntj, br, bc)

    def local_from_full(self, i, full):
        s = self.specs[i]
        return self._tiles(full, s).index_select(0, s.local_tiles.to(full.device)).contiguous()

    def local_chunks(
        self, i: int, local: torch.Tensor
    ) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        s = self.specs[i]
        br, bc = self.block
        out: list[tuple[tuple[int, ...], torch.Tensor]] = []
        for j, t in enumerate(s.local_tiles.tolist()):
            ti, tj = divmod(t, s.ntj)
            out.append(((ti * br, tj * bc), local[j]))
        return out

    def holds_anything(self, i: int) -> bool:
        return self.specs[i].local_tiles.numel() > 0

    def _cat_local(self, locals_: list[torch.Tensor], dtype: torch.dtype, dev) -> torch.Tensor:
        br, bc = self.block
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
        if quantize is not None:
            local = self._cat_local(locals_, torch.float32, dev)[: self.my_tiles]
            q, scale = quantize_tiles(local, pow2=quantize == "fp8_block_pow2")
            seg = M * (tile + 4)
            send = torch.zeros(seg, dtype=UINT8, device=dev)
            send[: self.my_tiles * tile].copy_(q.view(UINT8).reshape(-1))
            send[M * tile : M * tile + 4 * self.my_tiles].copy_(scale.view(UINT8))
            recv = torch.empty(W * seg, dtype=UINT8, device=dev)
        else:
            send = self._cat_local(locals_, dtype, dev).view(-1)
            recv = torch.empty(W * M * tile, dtype=dtype, device=dev)
        work = dist.all_gather_into_tensor(recv, send, group=self.g.group, async_op=True)
        stats.add("all_gather", send.nbytes)
        return Pending([work], recv, [send], send.nbytes + recv.nbytes, extra=(quantize, dtype))

    def finish_gather(self, p, flat):
        p.wait()
        W, M, tile = self.g.world, self.M, self.tile
        br, bc = self.block
        quantize, dtype = p.extra
        if quantize is not None:
            rv = p.recv.view(W, M * (tile + 4))
            q = rv[:, : M * tile].contiguous().view(FP8_E4M3).view(W * M, br, bc)
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
        br, bc = self.block
        send = torch.zeros(W * M * tile, dtype=rdtype, device=device)
        st = send.view(W * M, br, bc)
        for s, gr in zip(self.specs, grads, strict=True):
            if gr is None:
                continue
            st.index_copy_(0, s.src_index.to(device), self._tiles(gr.to(rdtype), s))
        return self._reduce_scatter(send, M * tile, predivide, stats)

    def finish_reduce(self, p, predivide):
        out = self._reduced(p, predivide)
        br, bc = self.block
        tiles = out.view(self.M, br, bc)
        r = self.g.rank
        res: list[torch.Tensor | None] = []
        for s in self.specs:
            res.append(tiles[s.offsets[r] : s.offsets[r] + s.counts[r]])
        p.keep = []
        return res
