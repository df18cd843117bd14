"""Token permutation: sort (token, expert) assignments by expert into an aligned buffer, and back.

Shapes: ``T`` tokens, ``K`` experts per token, ``N = T * K`` assignments (assignment ``a`` is
token ``a // K``'s ``a % K``-th choice), ``E`` experts, ``H`` hidden size, ``R`` rows of the
permuted buffer, ``A`` the alignment.

Layout of the buffer: expert ``e`` owns rows ``[group_ends[e-1], group_ends[e])``; its
assignments come first in token order, then zero rows up to a multiple of ``A`` (grouped GEMM
kernels want aligned groups). Three sizing modes:

* dropless, dynamic (default): ``R = sum_e ceil(count_e / A) * A`` exactly. Allocating it
  reads the counts back to the host (one sync on GPU) unless the caller knows ``R``.
* dropless, static (``static_shapes=True``, "activation packing"): ``R = N + E * (A - 1)``
  rounded up to ``A``, an upper bound known from shapes alone, so nothing is read back.
  Rows past ``group_ends[-1]`` are slack: grouped GEMM skips them and no token reads them.
* capacity (``capacity_factor=c``): every expert gets ``C = ceil(c * N / E)`` rows (rounded
  up to ``A``), ``R = E * C``; assignments past an expert's first ``C`` (in token order) are
  dropped (``slot = -1``) and contribute nothing. Static shapes, no sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dist_moe.kernels import KernelBackend, combine_rows, expert_histogram, permute_rows

__all__ = [
    "PermuteConfig",
    "PermutePlan",
    "permute",
    "plan_permutation",
    "unpermute",
    "unpermute_and_combine",
]


@dataclass(kw_only=True, slots=True)
class PermuteConfig:
    """How tokens are laid out for the experts."""

    alignment: int = 8
    """Each expert's group of rows is padded to a multiple of this (8 = 16 bytes of bf16)."""
    capacity_factor: float | None = None
    """None: dropless. A float c > 0: each expert keeps at most ceil(c * N / E) assignments."""
    static_shapes: bool = False
    """Dropless only: size the buffer by the upper bound N + E * (A - 1); no host sync
    (expert parallelism: even, padded exchanges, see ``dispatch.py``)."""
    kernels: KernelBackend = "auto"
    """Data-movement backend: "auto" (Triton on CUDA, torch elsewhere), "torch", "triton"."""

    def __post_init__(self) -> None:
        if isinstance(self.alignment, bool) or not isinstance(self.alignment, int):
            raise ValueError(f"PermuteConfig.alignment must be an int >= 1, got {self.alignment!r}")
        if self.alignment < 1:
            raise ValueError(f"PermuteConfig.alignment must be >= 1, got {self.alignment}")
        if self.capacity_factor is not None and not (
            isinstance(self.capacity_factor, int | float)
            and math.isfinite(self.capacity_factor)
            and self.capacity_factor > 0
        ):
            raise ValueError(
                "PermuteConfig.capacity_factor must be None (dropless) or a finite number > 0, "
                f"got {self.capacity_factor!r}"
            )
        if self.kernels not in ("auto", "torch", "triton"):
            raise ValueError(
                f"PermuteConfig.kernels must be 'auto', 'torch' or 'triton', got {self.kernels!r}"
            )

    def capacity(self, num_assignments: int, num_experts: int) -> int:
        """Rows per expert in capacity mode: ceil(c * N / E) rounded up to the alignment."""
        assert self.capacity_factor is not None
        c = math.ceil(self.capacity_factor * num_assignments / num_experts)
        return _round_up(max(c, 1), self.alignment)


@dataclass(slots=True)
class PermutePlan:
    """Where every assignment goes in the permuted buffer, and back (all device tensors)."""

    slot: torch.Tensor
    """(N,) int64: buffer row of assignment a, or -1 when it was dropped."""
    row_assignment: torch.Tensor
    """(R,) int64: assignment held by row r, or -1 for a padding row."""
    group_ends: torch.Tensor
    """(E,) int32: end row of each expert's group (the ``offs`` of grouped GEMM)."""
    counts: torch.Tensor
    """(E,) int64: assignments routed to each expert, before any drop."""
    num_tokens: int
    top_k: int
    kernels: KernelBackend = "auto"

    @property
    def num_rows(self) -> int:
        return self.row_assignment.shape[0]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_permutation(
    indices_TK: torch.Tensor,
    num_experts: int,
    config: PermuteConfig,
    *,
    counts: torch.Tensor | None = None,
    num_rows: int | None = None,
    capacity: int | None = None,
) -> PermutePlan:
    """Compute the permutation of ``indices_TK`` (T, K) into expert-major aligned groups.

    A negative entry means "not routed": it gets no row and ``slot = -1`` (the dispatchers
    use it for assignments that belong to another rank). ``counts`` (E,) may be passed when
    already known (the router computes it). ``num_rows`` gives the dynamic dropless size when
    the caller already knows it on the host, which saves this mode's one host sync.
    ``capacity`` switches to capacity mode with exactly that many rows per expert (the
    symmetric-memory dispatcher sizes it from its static buffers, not from this call's T).
    """
    if indices_TK.dim() != 2:
        raise ValueError(f"indices_TK must be 2-D (T, K), got shape {tuple(indices_TK.shape)}")
    num_tokens, top_k = indices_TK.shape
    n = num_tokens * top_k
    device = indices_TK.device
    align = config.alignment
    e_N = indices_TK.reshape(-1).long()
    routed = e_N >= 0
    key_N = torch.where(routed, e_N, num_experts)  # unrouted entries sort last
    if counts is None:
        counts = expert_histogram(key_N, num_experts + 1, backend=config.kernels)[:num_experts]
    counts_ext = torch.cat([counts, (n - counts.sum()).reshape(1)])

    # rank of each assignment within its expert, in token order (stable sort keeps it).
    sorted_key, order = torch.sort(key_N, stable=True)
    starts = torch.cumsum(counts_ext, 0) - counts_ext
    rank_sorted = torch.arange(n, device=device) - starts.index_select(0, sorted_key)
    rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
    e_safe = key_N.clamp(max=num_experts - 1)

    if capacity is not None or config.capacity_factor is not None:
        cap = capacity if capacity is not None else config.capacity(n, num_experts)
        rows = num_experts * cap
        slot = torch.where(routed & (rank < cap), e_safe * cap + rank, -1)
        group_ends = torch.arange(1, num_experts + 1, device=device, dtype=torch.int32) * cap
    else:
        padded = (counts + (align - 1)) // align * align
        ends = torch.cumsum(padded, 0)
        slot = torch.where(routed, (ends - padded).index_select(0, e_safe) + rank, -1)
        group_ends = ends.to(torch.int32)
        if num_rows is not None:
            rows = num_rows
        elif config.static_shapes:
            rows = _round_up(n + num_experts * (align - 1), align)
        else:
            rows = int(ends[-1])  # the one host sync of this mode

    # Invert slot -> row_assignment; dropped assignments land in a discarded extra row.
    row_assignment = torch.full((rows + 1,), -1, dtype=torch.int64, device=device)
    row_assignment.scatter_(0, torch.where(slot < 0, rows, slot), torch.arange(n, device=device))
    return PermutePlan(
        slot=slot,
        row_assignment=row_assignment[:rows],
        group_ends=group_ends,
        counts=counts,
        num_tokens=num_tokens,
        top_k=top_k,
        kernels=config.kernels,
    )


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH: torch.Tensor, plan: PermutePlan) -> torch.Tensor:
        ctx.plan = plan
        return permute_rows(x_TH, plan.row_assignment, plan.top_k, backend=plan.kernels)

    @staticmethod
    def backward(ctx, grad_RH: torch.Tensor):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        plan: PermutePlan = ctx.plan
        grad_x = combine_rows(grad_RH, plan.slot, plan.top_k, backend=plan.kernels)
        return grad_x, None


class _UnpermuteCombine(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, y_RH: torch.Tensor, weights_TK: torch.Tensor | None, plan: PermutePlan
    ) -> torch.Tensor:
        ctx.plan = plan
        ctx.save_for_backward(y_RH, weights_TK)
        return combine_rows(y_RH, plan.slot, plan.top_k, weights_TK, backend=plan.kernels)

    @staticmethod
    def backward(ctx, grad_TH: torch.Tensor):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        plan: PermutePlan = ctx.plan
        y_RH, weights_TK = ctx.saved_tensors
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_y = permute_rows(
                grad_TH, plan.row_assignment, plan.top_k, weights_TK, backend=plan.kernels
            )
        if weights_TK is not None and ctx.needs_input_grad[1]:
            # grad_w[t, k] = <grad_out[t], y[slot[t, k]]>; dropped assignments get 0.
            dropped = plan.slot < 0
            y_ext = torch.cat([y_RH, y_RH.new_zeros(1, y_RH.shape[1])])
            rows = y_ext.index_select(0, torch.where(dropped, y_RH.shape[0], plan.slot))
            g = grad_TH.repeat_interleave(plan.top_k, dim=0)
            acc = torch.promote_types(y_RH.dtype, torch.float32)
            grad_w = (rows.to(acc) * g.to(acc)).sum(-1).reshape(weights_TK.shape)
            grad_w = grad_w.to(weights_TK.dtype)
        return grad_y, grad_w, None


def permute(x_TH: torch.Tensor, plan: PermutePlan) -> torch.Tensor:
    """Gather tokens into the expert-major buffer (R, H); padding rows are zero. Differentiable."""
    return _Permute.apply(x_TH, plan)


def unpermute_and_combine(
    y_RH: torch.Tensor, plan: PermutePlan, weights_TK: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[t] = sum_k weights[t, k] * y[slot[t, k]]`` (T, H); weights default to 1."""
    return _UnpermuteCombine.apply(y_RH, weights_TK, plan)


def unpermute(y_RH: torch.Tensor, plan: PermutePlan) -> torch.Tensor:
    """The exact inverse of ``permute``: (T, K, H) with row ``y[slot[t, k]]`` (0 if dropped)."""
    if plan.top_k == 1:
        return unpermute_and_combine(y_RH, plan)[:, None]
    t, k = plan.num_tokens, plan.top_k
    flat = PermutePlan(
        slot=plan.slot,
        row_assignment=plan.row_assignment,
        group_ends=plan.group_ends,
        counts=plan.counts,
        num_tokens=t * k,
        top_k=1,
        kernels=plan.kernels,
    )
    return unpermute_and_combine(y_RH, flat).reshape(t, k, -1)
