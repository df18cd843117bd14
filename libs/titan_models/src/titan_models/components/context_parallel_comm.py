"""The collectives of a context-parallel group, each started at once and waited on later, so a
transfer overlaps the compute issued between (async ``isend``/``irecv`` through
``batch_isend_irecv``, async all-gather and reduce-scatter; the point-to-point ``send`` and
``recv`` that pass linear-attention states along the chain of chunks). Any
``torch.distributed`` backend: NCCL, gloo, or the fake backend of scale tests."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _Pending:
    """A collective in flight and the tensor it fills."""

    __slots__ = ("_keep", "_result", "_works")

    def __init__(self, works: list, result: torch.Tensor, keep: torch.Tensor) -> None:
        self._works, self._result = works, result
        self._keep: torch.Tensor | None = (
            keep  # the buffer being sent stays alive until the transfer completes
        )

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._works, self._keep = [], None
        return self._result


class _Done:
    """The result of a collective over one rank (nothing to send)."""

    __slots__ = ("_result",)

    def __init__(self, result: torch.Tensor) -> None:
        self._result = result

    def wait(self) -> torch.Tensor:
        return self._result


class GroupComm:
    """Ring shift, all-gather and reduce-scatter over one process group (or one process when
    ``group`` is ``None`` and no default group exists)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        single = group is None and not dist.is_initialized()
        self.rank = 0 if single else dist.get_rank(group)
        self.size = 1 if single else dist.get_world_size(group)
        self._batched = True
        if self.size > 1:
            pg = group if group is not None else dist.group.WORLD
            assert pg is not None  # dist is initialized when size > 1
            self._global = [dist.get_global_rank(pg, r) for r in range(self.size)]
            self._next = dist.get_global_rank(pg, (self.rank + 1) % self.size)
            self._prev = dist.get_global_rank(pg, (self.rank - 1) % self.size)

    def all_gather(self, x: torch.Tensor) -> _Pending | _Done:
        """``(size, *x.shape)``: every rank's ``x``, in rank order."""
        x = x.contiguous()
        if self.size == 1:
            return _Done(x[None])
        out = x.new_empty((self.size, *x.shape))
        work = dist.all_gather_into_tensor(
            out.view(-1), x.view(-1), group=self.group, async_op=True
        )
        return _Pending([work], out, x)

    def reduce_scatter(self, x: torch.Tensor) -> _Pending | _Done:
        """``x`` is ``(size, ...)``: the sum over ranks of their ``x[rank]``."""
        x = x.contiguous()
        if self.size == 1:
            return _Done(x[0])
        out = x.new_empty(x.shape[1:])
        work = dist.reduce_scatter_tensor(out.view(-1), x.view(-1), group=self.group, async_op=True)
        return _Pending([work], out, x)

    def ring_shift(self, x: torch.Tensor) -> _Pending | _Done:
        """Send ``x`` to rank ``rank + 1``, receive the same shape from ``rank - 1``."""
        x = x.contiguous()
        if self.size == 1:
            return _Done(x)
        out = torch.empty_like(x)
        ops = [
            dist.P2POp(dist.isend, x, self._next, self.group),
            dist.P2POp(dist.irecv, out, self._prev, self.group),
        ]
        if self._batched:
            try:  # one group of both ops: what NCCL needs for a ring of sends and receives
                return _Pending(dist.batch_isend_irecv(ops), out, x)
            except RuntimeError:  # no backend for these tensors' device (fake mode's meta)
                self._batched = False
        works = [dist.isend(x, self._next, self.group), dist.irecv(out, self._prev, self.group)]
        return _Pending(works, out, x)

    def send(self, x: torch.Tensor, to: int) -> _Pending:
        """Send ``x`` to rank ``to`` of the group (matched by its ``recv``)."""
        x = x.contiguous()
        return _Pending([dist.isend(x, self._global[to], self.group)], x, x)

    def recv(self, like: torch.Tensor, source: int) -> _Pending:
        """A tensor of ``like``'s shape and dtype from rank ``source`` of the group."""
        out = torch.empty_like(like, memory_format=torch.contiguous_format)
        return _Pending([dist.irecv(out, self._global[source], self.group)], out, out)
