"""Dispatchers: move routed tokens to the experts that own them and the results back.

All dispatchers share one interface::

    rows_RD, group_ends, ctx = dispatcher.dispatch(x_TD, indices_TK, counts=None)
    y_RD = experts(rows_RD, group_ends)             # this rank's experts only
    out_TD = dispatcher.combine(y_RD, weights_TK, ctx)

* ``LocalDispatcher``: every expert is local; permute → experts → unpermute-and-combine.
* ``AllToAllDispatcher(group)``: expert parallelism over a process group (gloo or NCCL).
  Expert ``e`` lives on rank ``e // (E / ep)``. Dropless: a token travels once to each rank
  that owns at least one of its experts (not once per expert), with its local expert ids;
  counts are exchanged first (one small all-to-all and one read-back for the split sizes),
  tokens go with an uneven ``all_to_all_single``, the owner groups the received
  (token, local expert) assignments by expert, runs them, combines them with the routing
  weights (sent over at combine time) into one partial sum per token, and sends that one row
  back; the source adds the partial sums of the ranks it visited. Capacity mode
  (``capacity_factor``): each rank sends exactly ``C`` rows per expert (padding and drops as
  in ``permute.py``), so the exchange is an even all-to-all with no host sync at all (every
  rank must then hold the same number of tokens).
* ``SymmMemDispatcher(group)`` (``symm_mem.py``): one-sided puts into peers' symmetric
  buffers with signal flags, static shapes, no host sync; expert GEMMs overlap the exchange.

``forward_experts(experts, x_TD, indices_TK, weights_TK, counts)`` is the three calls above
in one; the MoE layer calls it so a dispatcher can interleave them (the symmetric-memory
dispatcher runs each chunk of experts as soon as its tokens have arrived).

All exchanges are autograd functions whose backward is the reverse exchange, so gradients of
experts, router and input flow exactly as in the local computation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dist_moe.kernels import expert_histogram
from dist_moe.permute import (
    PermuteConfig,
    PermutePlan,
    permute,
    plan_permutation,
    unpermute_and_combine,
)
from dist_moe.placement import ExpertPlacement

__all__ = [
    "AllToAllDispatcher",
    "Dispatcher",
    "LocalDispatcher",
]


class Dispatcher:
    """Base class: see the module docstring for the contract."""

    num_experts: int
    num_local_experts: int
    config: PermuteConfig

    def dispatch(
        self, x_TD: torch.Tensor, indices_TK: torch.Tensor, counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        raise NotImplementedError

    def combine(self, y_RD: torch.Tensor, weights_TK: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError

    def forward_experts(
        self,
        experts: Any,
        x_TD: torch.Tensor,
        indices_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        counts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``combine(experts(*dispatch(x)), weights)``: the routed part of the MoE layer."""
        rows_RD, group_ends, ctx = self.dispatch(x_TD, indices_TK, counts)
        return self.combine(experts(rows_RD, group_ends), weights_TK, ctx)


def check_num_experts(num_experts: int) -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")


class LocalDispatcher(Dispatcher):
    """All experts on this rank."""

    def __init__(self, num_experts: int, config: PermuteConfig | None = None) -> None:
        check_num_experts(num_experts)
        self.num_experts = self.num_local_experts = num_experts
        self.config = config if config is not None else PermuteConfig()

    def dispatch(self, x_TD, indices_TK, counts=None):
        plan = plan_permutation(indices_TK, self.num_experts, self.config, counts=counts)
        return permute(x_TD, plan), plan.group_ends, plan

    def combine(self, y_RD, weights_TK, ctx: PermutePlan):
        return unpermute_and_combine(y_RD, ctx, weights_TK)


# ---------------------------------------------------------------------------------------
# exchanges (autograd functions)
# ---------------------------------------------------------------------------------------


def _all_to_all(
    x: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group
) -> torch.Tensor:
    x = x.contiguous()
    rows = sum(out_splits) if out_splits is not None else x.shape[0]
    out = x.new_empty((rows, *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows ``[sum(in[:p]), sum(in[:p+1]))`` go to rank p; backward is the swapped exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


@dataclass(slots=True)
class _EPContext:
    plan: PermutePlan
    """Source side: dropless, (token, destination rank) pairs; capacity, by global expert."""
    local_plan: PermutePlan | None = None
    """Dropless: the received (row, local expert) assignments grouped by local expert."""
    splits: tuple[list[int], list[int]] | None = None
    """Dropless: (rows received from each rank, rows sent to each rank)."""
    token: torch.Tensor | None = None
    """Dropless: the token of each sent row."""
    rows_per_expert: int = 0
    """Capacity mode: C, rows each source sends per expert."""


class ExpertParallelDispatcher(Dispatcher):
    def __init__(
        self, num_experts: int, group: dist.ProcessGroup | None, config: PermuteConfig | None
    ) -> None:
        check_num_experts(num_experts)
        self.group = group
        self.config = config if config is not None else PermuteConfig()
        self.placement = ExpertPlacement.from_group(num_experts, group)
        self.num_experts = num_experts
        self.num_local_experts = self.placement.num_local_experts

    # capacity (static) mode ------------------------------------------------------------
    def _exchange(self, x_PRD: torch.Tensor) -> torch.Tensor:
        """Even exchange of (ep, rows, D): out[p] = rank p's x[me]. Differentiable."""
        raise NotImplementedError

    def _dispatch_capacity(self, x_TD, indices_TK, counts):
        ep, el = self.placement.ep_size, self.num_local_experts
        plan = plan_permutation(indices_TK, self.num_experts, self.config, counts=counts)
        c = plan.num_rows // self.num_experts
        send = permute(x_TD, plan).reshape(ep, el * c, -1)  # rows for rank p: experts of p
        recv = self._exchange(send)  # (source, el * c, D)
        d = recv.shape[-1]
        rows = recv.reshape(ep, el, c, d).transpose(0, 1).reshape(el * ep * c, d)
        group_ends = torch.arange(1, el + 1, dtype=torch.int32, device=x_TD.device) * (ep * c)
        return rows, group_ends, _EPContext(plan=plan, rows_per_expert=c)

    def _combine_capacity(self, y_RD, weights_TK, ctx: _EPContext):
        ep, el, c = self.placement.ep_size, self.num_local_experts, ctx.rows_per_expert
        d = y_RD.shape[-1]
        back = y_RD.reshape(el, ep, c, d).transpose(0, 1).reshape(ep, el * c, d)
        y_buf = self._exchange(back).reshape(ep * el * c, d)
        return unpermute_and_combine(y_buf, ctx.plan, weights_TK)


class AllToAllDispatcher(ExpertParallelDispatcher):
    """Expert parallelism over ``group`` with ``all_to_all_single`` (uneven when dropless)."""

    def __init__(
        self,
        num_experts: int,
        group: dist.ProcessGroup | None = None,
        config: PermuteConfig | None = None,
    ) -> None:
        super().__init__(num_experts, group, config)

    def _exchange(self, x_PRD):
        ep = x_PRD.shape[0]
        out = _AllToAll.apply(x_PRD.reshape(-1, x_PRD.shape[-1]), None, None, self.group)
        return out.reshape(ep, -1, x_PRD.shape[-1])

    def dispatch(self, x_TD, indices_TK, counts=None):
        if self.config.capacity_factor is not None:
            return self._dispatch_capacity(x_TD, indices_TK, counts)
        ep, el, e = self.placement.ep_size, self.num_local_experts, self.num_experts
        device = x_TD.device
        if counts is None:
            counts = expert_histogram(indices_TK, e, backend=self.config.kernels)
        # 1. which ranks each token must visit (once per rank, however many experts there).
        member_TP = torch.zeros(indices_TK.shape[0], ep, dtype=torch.bool, device=device)
        member_TP.scatter_(1, indices_TK // el, True)
        dest_TP = torch.where(member_TP, torch.arange(ep, device=device), -1)
        # 2. exchange counts: for each destination, assignments per local expert and rows.
        meta_send = torch.cat([counts.reshape(ep, el), member_TP.sum(0)[:, None]], 1)
        meta_recv = torch.empty_like(meta_send)
        dist.all_to_all_single(meta_recv, meta_send.contiguous(), group=self.group)
        host = torch.cat([meta_send[:, el], meta_recv.reshape(-1)]).tolist()  # the host sync
        in_splits = host[:ep]
        recv_meta = [host[ep + s * (el + 1) : ep + (s + 1) * (el + 1)] for s in range(ep)]
        out_splits = [m[el] for m in recv_meta]
        per_expert = [sum(m[j] for m in recv_meta) for j in range(el)]
        # 3. rows for each destination rank, in token order, with their local expert ids.
        send_plan = plan_permutation(
            dest_TP,
            ep,
            PermuteConfig(alignment=1, kernels=self.config.kernels),
            counts=meta_send[:, el],
            num_rows=sum(in_splits),
        )
        token = send_plan.row_assignment // ep
        local_ids = (
            indices_TK.index_select(0, token) - (send_plan.row_assignment % ep * el)[:, None]
        )
        local_ids = torch.where((local_ids >= 0) & (local_ids < el), local_ids, -1)
        recv_x = _AllToAll.apply(permute(x_TD, send_plan), out_splits, in_splits, self.group)
        recv_ids = _all_to_all(local_ids, out_splits, in_splits, self.group)
        # 4. group the received (token, local expert) assignments by local expert.
        align = self.config.alignment
        local_plan = plan_permutation(
            recv_ids,
            el,
            PermuteConfig(alignment=align, kernels=self.config.kernels),
            counts=meta_recv[:, :el].sum(0),
            num_rows=sum(-(-c // align) * align for c in per_expert),
        )
        rows = permute(recv_x, local_plan)
        ctx = _EPContext(
            plan=send_plan, local_plan=local_plan, splits=(out_splits, in_splits), token=token
        )
        return rows, local_plan.group_ends, ctx

    def combine(self, y_RD, weights_TK, ctx: _EPContext):
        if ctx.local_plan is None:
            return self._combine_capacity(y_RD, weights_TK, ctx)
        assert ctx.splits is not None  # set with local_plan (dropless)
        out_splits, in_splits = ctx.splits
        # Weighted sum over this rank's experts, per received token; then one row per token
        # goes back, and the source adds up the partial sums of the ranks it visited.
        recv_w = _AllToAll.apply(
            weights_TK.index_select(0, ctx.token), out_splits, in_splits, self.group
        )
        partial = unpermute_and_combine(y_RD, ctx.local_plan, recv_w)
        back = _AllToAll.apply(partial, in_splits, out_splits, self.group)
        return unpermute_and_combine(back, ctx.plan)
