"""Expert parallelism under tensor parallelism: split a replicated input's tokens over a group.

Under tensor parallelism (no sequence parallelism) every rank of a tensor-parallel group holds
the same tokens, so an MoE layer there would route, dispatch and run all of them ``tp`` times.
``TokenSplitDispatcher(inner, group)`` wraps an expert-parallel dispatcher: every rank still
routes every token (router and shared experts see the whole replicated input, as they would on
one process), but each rank of ``group`` dispatches only its contiguous ``ceil(T / n)`` tokens
through ``inner``; the routed outputs are all-gathered over ``group``.

Gradients stay those of one process, with no extra reduction: the split's backward all-gathers
the slices' gradients of the input and of the routing weights, so every rank gets the whole
gradient of both (router and shared experts then get full, identical gradients on every rank
of ``group``); the gather's backward keeps this rank's slice of the output's gradient, which
must be the same on every rank of ``group`` (the replicated residual stream of tensor
parallelism is). A routed expert's gradient sums the tokens its ``inner`` group sent it, as
without the split.

Shapes: ``T`` tokens of this rank, ``n`` ranks of ``group``, ``C = ceil(T / n)`` tokens per
slice (the last slices may be shorter or empty; the gathers pad them to ``C``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dist_moe.dispatch import Dispatcher

__all__ = ["TokenSplitDispatcher"]


@dataclass(frozen=True, slots=True)
class _Slice:
    """This rank's tokens ``[start, stop)`` of ``total``, slices of ``size`` over ``group``."""

    start: int
    stop: int
    size: int
    total: int
    group: Any


def _gather_slices(local: torch.Tensor, sl: _Slice) -> torch.Tensor:
    """Every rank's slice, in rank order: the whole ``(total, ...)`` tensor."""
    n = dist.get_world_size(sl.group)
    pad = local.new_zeros((sl.size, *local.shape[1:]))
    pad[: local.shape[0]] = local
    out = local.new_empty((n * sl.size, *local.shape[1:]))
    dist.all_gather_into_tensor(out, pad, group=sl.group)
    return out[: sl.total]


class _Split(torch.autograd.Function):
    """Forward: this rank's slice. Backward: the slices' gradients gathered (whole, on every
    rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sl: _Slice) -> torch.Tensor:
        ctx.sl = sl
        return x[sl.start : sl.stop].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        return _gather_slices(grad.contiguous(), ctx.sl), None


class _Gather(torch.autograd.Function):
    """Forward: every rank's slice gathered. Backward: this rank's slice of the (replicated)
    gradient."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, sl: _Slice) -> torch.Tensor:
        ctx.sl = sl
        return _gather_slices(local.contiguous(), sl)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        sl = ctx.sl
        return grad[sl.start : sl.stop], None


class TokenSplitDispatcher(Dispatcher):
    """``inner``'s dispatch of this rank's slice of a token batch replicated over ``group``
    (see the module docstring)."""

    def __init__(self, inner: Dispatcher, group: dist.ProcessGroup | None) -> None:
        if not isinstance(inner, Dispatcher):
            raise ValueError(
                f"TokenSplitDispatcher: inner must be a Dispatcher, got {type(inner).__name__}"
            )
        self.inner = inner
        self.group = group
        self.num_experts = inner.num_experts
        self.num_local_experts = inner.num_local_experts
        self.config = inner.config

    def _slice(self, num_tokens: int) -> _Slice:
        n, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if self.config.capacity_factor is not None and num_tokens % n:
            # capacity mode sends C rows per expert from every rank: equal token counts
            raise ValueError(
                f"TokenSplitDispatcher: with capacity_factor={self.config.capacity_factor} the "
                f"{num_tokens} tokens must split evenly over the {n} ranks of the token group"
            )
        size = -(-num_tokens // n)
        start = min(rank * size, num_tokens)
        return _Slice(start, min(start + size, num_tokens), size, num_tokens, self.group)

    def dispatch(self, x_TD, indices_TK, counts=None):
        sl = self._slice(x_TD.shape[0])
        rows, group_ends, ctx = self.inner.dispatch(
            _Split.apply(x_TD, sl), indices_TK[sl.start : sl.stop]
        )
        return rows, group_ends, (ctx, sl)

    def combine(self, y_RD, weights_TK, ctx):
        inner_ctx, sl = ctx
        out = self.inner.combine(y_RD, _Split.apply(weights_TK, sl), inner_ctx)
        return _Gather.apply(out, sl)

    def forward_experts(self, experts, x_TD, indices_TK, weights_TK, counts=None):
        """The routed part on this rank's slice (``inner``'s own interleaving kept), gathered.
        ``counts`` (of every token) is not this slice's: ``inner`` counts its own."""
        sl = self._slice(x_TD.shape[0])
        out = self.inner.forward_experts(
            experts,
            _Split.apply(x_TD, sl),
            indices_TK[sl.start : sl.stop],
            _Split.apply(weights_TK, sl),
        )
        return _Gather.apply(out, sl)
