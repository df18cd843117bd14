"""Dispatchers: move routed tokens to the experts that own them and the results back.

All dispatchers share one interface::

    rows_RD, group_ends, ctx = dispatcher.dispatch(x_TD, indices_TK, counts=None)
    y_RD = experts(rows_RD, group_ends)             # this rank's experts only
    out_TD = dispatcher.combine(y_RD, weights_TK, ctx)

* ``LocalDispatcher``: every expert is local; permute → experts → unpermute-and-combine.
* ``AllToAllDispatcher(group)``: expert parallelism over a process group (gloo or NCCL).
  Expert ``e`` lives on rank ``e // (E / ep)``. Dropless: a token travels once to each rank
  that owns at least one of its experts (not once per expert), with its local expert ids;
  the owner groups the received (token, local expert) assignments by expert, runs them,
  combines them with the routing weights (sent over at combine time) into one partial sum per
  token, and sends that one row back; the source adds the partial sums of the ranks it
  visited. Three sizings of the exchange:

  - dynamic (default): counts are exchanged first (one small all-to-all and one read-back
    of the split sizes: the host sync), tokens go with an uneven ``all_to_all_single``;
  - static (``static_shapes=True``): each rank sends every rank a block of ``max_tokens``
    rows (default: its T, which every rank must then share), its tokens for that rank in
    token order and zero rows after them: an even all-to-all, no host sync, no drop (a rank
    needs a token at most once). Pad, never drop: the numerics are bitwise the dynamic
    mode's. The cost is memory: ``ep * max_tokens`` rows each way, and an expert buffer
    sized for the worst case, ``ep * max_tokens * min(K, E / ep)`` assignments (+ alignment
    padding), where the dynamic mode holds what arrived;
  - capacity (``capacity_factor``): each rank sends exactly ``C`` rows per expert (padding
    and drops as in ``permute.py``): even, no host sync, assignments past ``C`` dropped
    (every rank must then hold the same number of tokens).
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
    """Dropless, dynamic: (rows received from each rank, rows sent to each rank); None with
    static shapes (even blocks)."""
    token: torch.Tensor | None = None
    """Dropless: the token of each sent row (0 for padding rows)."""
    order: torch.Tensor | None = None
    """Dropless: (rows, min(K, local experts)) which of its token's K choices each sent row
    carries, valid ones first."""
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
    """Expert parallelism over ``group`` with ``all_to_all_single``: uneven when dropless
    (split sizes read on the host), even with static shapes or a capacity factor.

    ``max_tokens`` (``PermuteConfig.static_shapes`` only): the most tokens any rank passes in
    one call; every rank then sends ``max_tokens`` rows to every rank, so ranks may hold
    different token counts. None: this call's T, which every rank must then share (a
    training step's micro-batches do).
    """

    def __init__(
        self,
        num_experts: int,
        group: dist.ProcessGroup | None = None,
        config: PermuteConfig | None = None,
        *,
        max_tokens: int | None = None,
    ) -> None:
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise ValueError(
                f"AllToAllDispatcher: max_tokens must be None or an int >= 1, got {max_tokens!r}"
            )
        super().__init__(num_experts, group, config)
        self.max_tokens = max_tokens

    def _exchange(self, x_PRD):
        ep = x_PRD.shape[0]
        out = _AllToAll.apply(x_PRD.reshape(-1, x_PRD.shape[-1]), None, None, self.group)
        return out.reshape(ep, -1, x_PRD.shape[-1])

    def _rows_per_rank(self, num_tokens: int) -> int:
        """Static shapes: rows each rank sends every rank (a rank gets a token at most once)."""
        if self.max_tokens is None:
            return num_tokens
        if num_tokens > self.max_tokens:
            raise ValueError(
                f"AllToAllDispatcher: this rank got {num_tokens} tokens, more than "
                f"max_tokens={self.max_tokens}"
            )
        return self.max_tokens

    def dispatch(self, x_TD, indices_TK, counts=None):
        if self.config.capacity_factor is not None:
            return self._dispatch_capacity(x_TD, indices_TK, counts)
        ep, el = self.placement.ep_size, self.num_local_experts
        kernels, static = self.config.kernels, self.config.static_shapes
        device = x_TD.device
        # 1. which ranks each token must visit (once per rank, however many experts there).
        member_TP = torch.zeros(indices_TK.shape[0], ep, dtype=torch.bool, device=device)
        member_TP.scatter_(1, indices_TK // el, True)
        dest_TP = torch.where(member_TP, torch.arange(ep, device=device), -1)
        # 2. rows for each destination rank, in token order: max_tokens-row blocks (static,
        # zero rows after the real ones), or exactly the rows it needs, counted on the host.
        splits = recv_counts = None
        if static:
            send_plan = plan_permutation(
                dest_TP,
                ep,
                PermuteConfig(alignment=1, kernels=kernels),
                capacity=self._rows_per_rank(x_TD.shape[0]),
            )
        else:
            splits, recv_counts, send_counts = self._exchange_counts(indices_TK, member_TP, counts)
            send_plan = plan_permutation(
                dest_TP,
                ep,
                PermuteConfig(alignment=1, kernels=kernels),
                counts=send_counts,
                num_rows=sum(splits[1]),
            )
        # 3. each sent row carries its token's local expert ids on the destination (-1 for
        # experts elsewhere and for padding rows), the valid ones first, in k order.
        assignment = send_plan.row_assignment
        token = assignment.clamp(min=0) // ep
        local_ids = indices_TK.index_select(0, token) - (assignment % ep * el)[:, None]
        valid = (local_ids >= 0) & (local_ids < el) & (assignment >= 0)[:, None]
        keep = min(indices_TK.shape[1], el)  # a token meets at most el experts on one rank
        order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, :keep]
        local_ids = torch.where(valid, local_ids, -1).gather(1, order)
        out_splits, in_splits = splits if splits is not None else (None, None)
        recv_x = _AllToAll.apply(permute(x_TD, send_plan), out_splits, in_splits, self.group)
        recv_ids = _all_to_all(local_ids, out_splits, in_splits, self.group)
        # 4. group the received (token, local expert) assignments by local expert.
        align = self.config.alignment
        num_rows = None
        if recv_counts is not None:
            num_rows = sum(-(-c // align) * align for c in recv_counts)
        local_plan = plan_permutation(
            recv_ids,
            el,
            PermuteConfig(alignment=align, static_shapes=static, kernels=kernels),
            num_rows=num_rows,
        )
        rows = permute(recv_x, local_plan)
        ctx = _EPContext(
            plan=send_plan, local_plan=local_plan, splits=splits, token=token, order=order
        )
        return rows, local_plan.group_ends, ctx

    def _exchange_counts(
        self, indices_TK: torch.Tensor, member_TP: torch.Tensor, counts: torch.Tensor | None
    ) -> tuple[tuple[list[int], list[int]], list[int], torch.Tensor]:
        """Dropless, dynamic shapes: (rows received from / sent to each rank), assignments
        received per local expert (host ints: the host sync of this mode), and rows sent per
        rank (device)."""
        ep, el = self.placement.ep_size, self.num_local_experts
        if counts is None:
            counts = expert_histogram(indices_TK, self.num_experts, backend=self.config.kernels)
        meta_send = torch.cat([counts.reshape(ep, el), member_TP.sum(0)[:, None]], 1)
        meta_recv = torch.empty_like(meta_send)
        dist.all_to_all_single(meta_recv, meta_send.contiguous(), group=self.group)
        host = torch.cat([meta_send[:, el], meta_recv.reshape(-1)]).tolist()  # the host sync
        in_splits = host[:ep]
        recv_meta = [host[ep + s * (el + 1) : ep + (s + 1) * (el + 1)] for s in range(ep)]
        out_splits = [m[el] for m in recv_meta]
        per_expert = [sum(m[j] for m in recv_meta) for j in range(el)]
        return (out_splits, in_splits), per_expert, meta_send[:, el]

    def combine(self, y_RD, weights_TK, ctx: _EPContext):
        if ctx.local_plan is None:
            return self._combine_capacity(y_RD, weights_TK, ctx)
        out_splits, in_splits = ctx.splits if ctx.splits is not None else (None, None)
        # Weighted sum over this rank's experts, per received token; then one row per token
        # goes back, and the source adds up the partial sums of the ranks it visited.
        assert ctx.token is not None and ctx.order is not None  # set with local_plan
        w = weights_TK.index_select(0, ctx.token).gather(1, ctx.order)
        recv_w = _AllToAll.apply(w, out_splits, in_splits, self.group)
        partial = unpermute_and_combine(y_RD, ctx.local_plan, recv_w)
        back = _AllToAll.apply(partial, in_splits, out_splits, self.group)
        return unpermute_and_combine(back, ctx.plan)
