"""SwiGLU experts as 3-D weights, computed with grouped GEMM or a per-expert loop; shared experts.

Shapes: ``E`` experts (local ones, under expert parallelism), ``D`` model dim, ``I`` expert
hidden dim, ``R`` rows of the permuted buffer, grouped by expert with ``group_ends`` (E,).

Weights use the ``nn.Linear`` layout per expert: ``w_gate``/``w_up`` (E, I, D), ``w_down``
(E, D, I); ``expert(x) = act(x @ w_gate[e].T, x @ w_up[e].T) @ w_down[e].T`` with ``act`` the
``SwiGLU`` activation (``silu(g) * u`` by default; clamped, with a sigmoid gain and an offset
on the up branch for gpt-oss / DeepSeek-V4). With ``bias=True`` every projection adds its
expert's bias (``b_gate``/``b_up`` (E, I), ``b_down`` (E, D), gpt-oss); a row's expert is read
off ``group_ends`` on the device (no host sync).

``torch._grouped_mm`` facts this relies on (checked on CPU, torch 2.15): ``offs`` are int32
group *ends*; rows past ``offs[-1]`` of the output are left uninitialised (no token reads
them: the combine only reads rows that hold assignments); the row stride of each operand must
be a multiple of 16 bytes (D and I multiples of 4 in fp32, 8 in bf16), otherwise the loop is
used; its backward fails on a stride-0 gradient, hence the ``contiguous`` hook.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from dist_moe.kernels import resolve_backend
from dist_moe.triton_gemm import triton_grouped_mm

__all__ = [
    "ExpertRun",
    "GroupedExperts",
    "GroupedGemm",
    "SharedExperts",
    "SwiGLU",
    "grouped_mm_available",
]

ExpertsImpl = Literal["auto", "grouped_mm", "loop"]
GroupedGemm = Literal["torch", "triton", "cute"]
"""Kernel of the grouped GEMMs: ``torch._grouped_mm``, the Triton kernel (``triton_gemm``) or
the CuTe DSL kernel (``cute_gemm``)."""
GROUPED_GEMMS: tuple[str, ...] = ("torch", "triton", "cute")
ExpertWeights = tuple[torch.Tensor, ...]
"""(w_gate, w_up, w_down) or, with biases, (w_gate, w_up, w_down, b_gate, b_up, b_down)."""


@dataclass(eq=False, slots=True)
class _Runs:
    """The split of one set of weights into runs of ``sizes`` experts, made once."""

    sizes: tuple[int, ...]
    source: ExpertWeights | None = None
    runs: list[ExpertWeights] = field(default_factory=list)

    def get(self, index: int, weights: ExpertWeights) -> ExpertWeights:
        fresh = self.source is None or any(
            a is not b for a, b in zip(self.source, weights, strict=True)
        )
        if fresh:  # one split per weight: its backward concatenates once
            parts = [w.split(list(self.sizes)) for w in weights]
            self.source, self.runs = weights, list(zip(*parts, strict=True))
        return self.runs[index]


@dataclass(frozen=True, slots=True)
class ExpertRun:
    """Run ``index`` of consecutive runs of experts (from ``GroupedExperts.split_weights``):
    resolved inside the experts' forward, where a sharding wrapper (flexshard) has put the
    full weights in place, and split once for all the runs of one forward."""

    runs: _Runs
    index: int


@dataclass(frozen=True, slots=True)
class SwiGLU:
    """The gated activation ``act(g, u)`` of an expert's hidden layer, on the projections
    ``g = x W_gate^T`` and ``u = x W_up^T``:

    ``g' = min(g, limit)``, ``u' = clamp(u, -limit, limit)`` (no clamp when ``limit`` is None),
    ``act = g' · sigmoid(alpha · g') · (u' + up_offset)``.

    The default is the plain SwiGLU ``silu(g) · u``; DeepSeek-V4 is ``SwiGLU(limit=10.0)``,
    gpt-oss ``SwiGLU(limit=7.0, alpha=1.702, up_offset=1.0)``.
    """

    limit: float | None = None
    """Clamp of the gate (from above) and the up projection (both sides); None: no clamp."""
    alpha: float = 1.0
    """Gain inside the sigmoid (1: SiLU)."""
    up_offset: float = 0.0
    """Added to the (clamped) up projection before the product."""

    def __post_init__(self) -> None:
        if self.limit is not None and not self.limit > 0:
            raise ValueError(f"SwiGLU.limit must be > 0 or None, got {self.limit!r}")
        if not self.alpha > 0:
            raise ValueError(f"SwiGLU.alpha must be > 0, got {self.alpha!r}")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit is not None:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
        if self.up_offset:
            up = up + self.up_offset
        if self.alpha == 1.0:
            return F.silu(gate) * up
        return gate * torch.sigmoid(gate * self.alpha) * up


def _grouped_mm_fn() -> Callable[..., torch.Tensor] | None:
    fn = getattr(F, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


def grouped_mm_available(x: torch.Tensor, *dims: int) -> bool:
    """Whether grouped GEMM can run on ``x``'s device/dtype with these inner dims."""
    if _grouped_mm_fn() is None:
        return False
    if x.device.type in ("cpu", "meta"):  # meta: shapes only (planning, fake backends)
        ok_dtype = x.dtype in (torch.float32, torch.bfloat16)
    elif x.device.type == "cuda":
        ok_dtype = x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 8
    else:
        return False
    return ok_dtype and all((d * x.element_size()) % 16 == 0 for d in dims)


def _grouped_mm(x_RK: torch.Tensor, w_EKN: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    fn = _grouped_mm_fn()
    assert fn is not None  # callers check grouped_mm_available
    out = fn(x_RK, w_EKN, offs=offs)
    if out.requires_grad:
        out.register_hook(lambda g: g.contiguous())
    return out


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts over a buffer grouped by expert."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        impl: ExpertsImpl = "auto",
        *,
        activation: SwiGLU | None = None,
        bias: bool = False,
        gemm: GroupedGemm = "torch",
    ):
        """``activation``: the gated activation (``SwiGLU()`` by default); ``bias``: a bias
        per expert on every projection; ``gemm``: the grouped GEMM kernel, ``"torch"``
        (``torch._grouped_mm``, any device), ``"triton"`` (``triton_grouped_mm``: CUDA, any
        float dtype, ragged groups; ``impl="loop"`` still runs the loop) or ``"cute"`` (the
        CuTe DSL kernel: SM90 / SM100, bf16, experts in equal static groups, see ``forward``)."""
        super().__init__()
        check_grouped_gemm(gemm, "GroupedExperts: gemm")
        for name, v in (("dim", dim), ("hidden_dim", hidden_dim), ("num_experts", num_experts)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"GroupedExperts: {name} must be an int >= 1, got {v!r}")
        if impl not in ("auto", "grouped_mm", "loop"):
            raise ValueError(
                f"GroupedExperts: impl must be 'auto', 'grouped_mm' or 'loop', got {impl!r}"
            )
        if activation is not None and not isinstance(activation, SwiGLU):
            raise ValueError(f"GroupedExperts: activation must be a SwiGLU, got {activation!r}")
        self.dim, self.hidden_dim, self.num_experts, self.impl = dim, hidden_dim, num_experts, impl
        self.gemm: GroupedGemm = gemm
        self.activation = activation if activation is not None else SwiGLU()
        self.w_gate = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w_up = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w_down = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.b_gate = nn.Parameter(torch.empty(num_experts, hidden_dim)) if bias else None
        self.b_up = nn.Parameter(torch.empty(num_experts, hidden_dim)) if bias else None
        self.b_down = nn.Parameter(torch.empty(num_experts, dim)) if bias else None
        self.reset_parameters()

    @property
    def has_bias(self) -> bool:
        """Whether the projections carry per-expert biases."""
        return self.b_gate is not None

    def reset_parameters(self, std: float = 0.02) -> None:
        for w in (self.w_gate, self.w_up, self.w_down):
            nn.init.trunc_normal_(w, std=std, a=-3 * std, b=3 * std)
        if self.has_bias:
            for b in (self.b_gate, self.b_up, self.b_down):
                assert b is not None  # made together with b_gate
                nn.init.zeros_(b)

    def uses_grouped_mm(self, x: torch.Tensor) -> bool:
        if self.impl == "loop":
            return False
        ok = grouped_mm_available(x, self.dim, self.hidden_dim)
        if self.impl == "grouped_mm" and not ok:
            raise RuntimeError(
                f"GroupedExperts(impl='grouped_mm'): grouped GEMM unavailable for {x.dtype} on "
                f"{x.device.type} with dim={self.dim}, hidden_dim={self.hidden_dim}"
            )
        return ok

    def split_weights(self, sizes: list[int]) -> list[ExpertRun]:
        """Consecutive runs of ``sizes`` experts, each passed to ``forward`` as ``weights``.

        The runs resolve inside ``forward`` (a sharding wrapper's full weights exist only
        there) to one ``split`` per weight shared by all the runs: its backward concatenates
        once, where slicing each run would materialise a full-size zero gradient per run.
        """
        runs = _Runs(tuple(sizes))
        return [ExpertRun(runs, i) for i in range(len(sizes))]

    def resolve_weights(self, weights: ExpertWeights | ExpertRun | None) -> ExpertWeights:
        """The weight tensors a forward uses: all experts' (None), a run's, or as given."""
        if weights is None:
            return self._weights()
        if isinstance(weights, ExpertRun):
            return weights.runs.get(weights.index, self._weights())
        return weights

    def forward(
        self,
        x_RD: torch.Tensor,
        group_ends: torch.Tensor,
        weights: ExpertWeights | ExpertRun | None = None,
    ) -> torch.Tensor:
        """(R, D) rows grouped by expert (``group_ends`` (E,) int) → (R, D).

        ``weights`` (from ``split_weights``) runs a subset of the experts: ``group_ends``
        then has one entry per expert of the subset. With ``gemm="cute"`` the groups must
        be equal and static, ``R / E`` rows each (a capacity layout), and R, D, hidden_dim
        multiples of 128.
        """
        w = self.resolve_weights(weights)
        w_gate, w_up, w_down = w[:3]
        if self.gemm == "cute":
            from dist_moe.cute_gemm import cute_swiglu_experts

            return cute_swiglu_experts(x_RD, w, self.activation, w_gate.shape[0])
        if self.gemm == "triton" and self.impl != "loop":
            if x_RD.device.type != "meta":  # meta: shapes only
                resolve_backend("triton", x_RD.device, what="GroupedExperts: gemm")
            mm = triton_grouped_mm
        elif self.uses_grouped_mm(x_RD):
            mm = _grouped_mm
        else:
            return self.forward_loop(x_RD, group_ends, weights)
        offs = group_ends.to(torch.int32)
        gate = mm(x_RD, w_gate.transpose(-2, -1), offs)
        up = mm(x_RD, w_up.transpose(-2, -1), offs)
        if len(w) == 3:
            return mm(self.activation(gate, up), w_down.transpose(-2, -1), offs)
        b_gate, b_up, b_down = (_with_zero_row(b) for b in w[3:])
        expert_R = _row_experts(group_ends, x_RD.shape[0])
        hidden = self.activation(gate + b_gate[expert_R], up + b_up[expert_R])
        return mm(hidden, w_down.transpose(-2, -1), offs) + b_down[expert_R]

    def _weights(self) -> ExpertWeights:
        b_gate, b_up, b_down = self.b_gate, self.b_up, self.b_down
        if b_gate is not None and b_up is not None and b_down is not None:  # has_bias
            return self.w_gate, self.w_up, self.w_down, b_gate, b_up, b_down
        return self.w_gate, self.w_up, self.w_down

    def forward_loop(
        self,
        x_RD: torch.Tensor,
        group_ends: torch.Tensor,
        weights: ExpertWeights | ExpertRun | None = None,
    ) -> torch.Tensor:
        """Reference: one dense SwiGLU per expert on its rows (reads group_ends to the host)."""
        w = self.resolve_weights(weights)
        ends = group_ends.tolist()
        sizes = [end - start for start, end in zip([0, *ends[:-1]], ends, strict=True)]
        # split/unbind rather than slicing/indexing: their backward concatenates/stacks once
        # instead of materialising a full-size zero gradient per expert.
        xs = torch.split(x_RD, [*sizes, x_RD.shape[0] - ends[-1]])
        per_expert = [t.unbind(0) for t in w]
        if len(w) == 3:  # no biases
            per_expert += [[None] * len(per_expert[0])] * 3
        act = self.activation
        outs = [
            F.linear(act(F.linear(xe, wg, bg), F.linear(xe, wu, bu)), wd, bd)
            for xe, wg, wu, wd, bg, bu, bd in zip(xs, *per_expert, strict=False)
        ]
        outs.append(x_RD.new_zeros(xs[-1].shape[0], self.dim))  # slack rows: zeros
        return torch.cat(outs)


def check_grouped_gemm(gemm: str, what: str) -> None:
    if gemm not in GROUPED_GEMMS:
        raise ValueError(f"{what} must be one of {GROUPED_GEMMS}, got {gemm!r}")


def _row_experts(group_ends: torch.Tensor, rows: int) -> torch.Tensor:
    """(R,) expert of every row of a buffer grouped by ``group_ends``; slack rows past the last
    group get index E (a zero bias row: grouped GEMM leaves their values, and gradients,
    undefined, which must not reach any expert's bias)."""
    index_R = torch.arange(rows, device=group_ends.device, dtype=group_ends.dtype)
    return torch.searchsorted(group_ends, index_R, right=True)


def _with_zero_row(bias_EX: torch.Tensor) -> torch.Tensor:
    return torch.cat([bias_EX, bias_EX.new_zeros(1, bias_EX.shape[1])])


class SharedExperts(nn.Module):
    """Dense SwiGLU MLP seen by every token (DeepSeek's shared experts, Qwen2-MoE's shared
    expert); ``gate=True`` adds Qwen2-MoE's per-token sigmoid gate; ``activation`` as in
    ``GroupedExperts`` (DeepSeek-V4 clamps its shared expert too)."""

    def __init__(
        self, dim: int, hidden_dim: int, *, gate: bool = False, activation: SwiGLU | None = None
    ) -> None:
        super().__init__()
        for name, v in (("dim", dim), ("hidden_dim", hidden_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SharedExperts: {name} must be an int >= 1, got {v!r}")
        self.w_gate = nn.Linear(dim, hidden_dim, bias=False)
        self.w_up = nn.Linear(dim, hidden_dim, bias=False)
        self.w_down = nn.Linear(hidden_dim, dim, bias=False)
        self.gate = nn.Linear(dim, 1, bias=False) if gate else None
        self.activation = activation if activation is not None else SwiGLU()
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in (self.w_gate, self.w_up, self.w_down, self.gate):
            if m is not None:
                nn.init.trunc_normal_(m.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        out = self.w_down(self.activation(self.w_gate(x_TD), self.w_up(x_TD)))
        if self.gate is not None:
            out = torch.sigmoid(self.gate(x_TD)) * out
        return out
