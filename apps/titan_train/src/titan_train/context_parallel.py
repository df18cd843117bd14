"""Context parallelism in the app: the ``cp`` group's collectives for titan_models'
``context_parallel`` attention backend, and each rank's shard of a batch.

titan_models holds the attention math (head-tail layout, masks in global indices, ring and
all-gather schedules, the backward) and never imports ``torch.distributed``; it asks for
three collectives through ``titan_models.ContextParallelComm``. ``ProcessGroupComm`` is
that protocol on a process group (NCCL, gloo, or the fake backend). Every rank of one
data-parallel position reads the same batch and keeps its own two chunks of every row
(``shard_batch``): tokens, labels, positions and document ids alike, so the loss of a rank's
tokens is that of those tokens in the full row.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import titan_models
from titan_train.data.packing import Batch


class _Pending:
    """A collective in flight and the tensor it fills."""

    def __init__(self, works: list[dist.Work], result: torch.Tensor, *keep: torch.Tensor):
        self._works, self._result = works, result
        self._keep = keep  # buffers being sent stay alive until the transfer completes

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._works, self._keep = [], ()
        return self._result


class ProcessGroupComm:
    """``titan_models.ContextParallelComm`` on a ``torch.distributed`` process group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self._prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def all_gather(self, x: torch.Tensor) -> _Pending:
        """``(size, *x.shape)``: every rank's ``x`` in rank order."""
        x = x.contiguous()
        out = x.new_empty((self.size, *x.shape))
        work = dist.all_gather_into_tensor(out.view(-1), x.view(-1), group=self.group, async_op=True)
        return _Pending([work], out, x)

    def reduce_scatter(self, x: torch.Tensor) -> _Pending:
        """Sum over ranks of their ``x[rank]`` (``x`` is ``(size, ...)``)."""
        x = x.contiguous()
        out = x.new_empty(x.shape[1:])
        work = dist.reduce_scatter_tensor(out.view(-1), x.view(-1), group=self.group, async_op=True)
        return _Pending([work], out, x)

    def ring_shift(self, x: torch.Tensor) -> _Pending:
        """Send ``x`` to the next rank, receive the previous rank's."""
        x = x.contiguous()
        out = torch.empty_like(x)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, x, self._next, self.group),
                dist.P2POp(dist.irecv, out, self._prev, self.group),
            ]
        )
        return _Pending(works, out, x)


def shard_batch(batch: Batch, cp: titan_models.ContextParallel) -> Batch:
    """This rank's chunks of every row of ``batch`` (head-tail layout)."""
    fields = (batch.input_ids, batch.labels, batch.document_ids, batch.positions)
    return Batch(*(cp.shard(t, dim=1) for t in fields))
