"""LoRA: low-rank adapters on frozen linears and grouped MoE experts (Hu et al., 2021).

A targeted ``nn.Linear`` computing ``y = x Wᵀ + b`` becomes a :class:`LoRALinear` computing
``y = x Wᵀ + b + s · (drop(x) Aᵀ) Bᵀ`` with ``A: (r, in)``, ``B: (out, r)`` and ``s = alpha / r``.
Routed experts (``dist_moe.GroupedExperts``, weights ``(E, out, in)``) become
:class:`LoRAGroupedExperts` with one ``A: (E, r, in)`` / ``B: (E, out, r)`` pair per projection
(gate, up, down); their grouped GEMMs run on ``W + s · B A`` (one batched matmul per
projection per step), so expert parallelism and every expert kernel see ordinary weights.

The swapped modules keep the base parameters under their own names (``wq.weight``,
``experts.w_gate``): HF key maps, sharding plans and checkpoints of the base are unchanged, and
the adapters are the extra parameters whose last name starts with ``lora_``. ``B`` starts at
zero, so an adapted model starts as its base. ``A`` is drawn (N(0, 1/in), Kaiming's with a
linear gain) from ``init_state`` with the adapters' own seed: a model built on ``meta`` gets
the same adapter values from ``Transformer.init_weights`` or a sharded ``init_state`` (the
modules report them through ``adapter_inits()``) as a materialised model gets in
``apply_lora``, whatever seed the base was initialised with.

Shapes: E experts, r rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dist_moe import GroupedExperts

from ..fqn import fqn_matches
from .init import Constant, Init, Normal, init_state

__all__ = [
    "LoRAGroupedExperts",
    "LoRALinear",
    "apply_lora",
    "is_lora_param",
    "lora_delta",
    "lora_weights",
    "merge_lora",
]

_PROJECTIONS = ("gate", "up", "down")


def is_lora_param(fqn: str) -> bool:
    """Whether ``fqn`` names a LoRA adapter parameter (its last segment starts ``lora_``)."""
    return fqn.rpartition(".")[2].startswith("lora_")


def lora_delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale · B A``: ``(out, in)`` from ``A (r, in)``, ``B (out, r)``, or ``(E, out, in)``
    from per-expert stacks."""
    return torch.matmul(b, a) * scale


class LoRALinear(nn.Linear):
    """``nn.Linear`` with a frozen base (``weight``, ``bias``) plus ``s · B A`` on the input."""

    def __init__(
        self, linear: nn.Linear, *, rank: int, alpha: float, dropout: float, seed: int
    ) -> None:
        nn.Module.__init__(self)  # nn.Linear.__init__ would allocate new parameters
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.rank, self.alpha, self.seed = rank, alpha, seed
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        like = dict(device=linear.weight.device, dtype=linear.weight.dtype)
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, **like))
        self.lora_b = nn.Parameter(torch.empty(self.out_features, rank, **like))

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's parameter name
        x = input
        y = F.linear(x, self.weight, self.bias)
        a, b = self.lora_a.to(x.dtype), self.lora_b.to(x.dtype)
        return y + F.linear(F.linear(self.dropout(x), a), b) * self.scale

    def adapter_inits(self) -> dict[str, Init]:
        """How the adapters start: ``A`` ~ N(0, 1/in) from the adapters' seed, ``B`` zero."""
        std = 1.0 / math.sqrt(self.in_features)
        return {"lora_a": Normal(std, seed=self.seed), "lora_b": Constant(0.0)}

    def lora_pairs(self) -> dict[str, tuple[str, str]]:
        """Base weight name -> (A name, B name)."""
        return {"weight": ("lora_a", "lora_b")}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


class LoRAGroupedExperts(GroupedExperts):
    """``dist_moe.GroupedExperts`` with frozen weights plus per-expert ``s · B A`` on each of
    ``w_gate``, ``w_up``, ``w_down`` (``lora_a_gate (E, r, dim)``, ``lora_b_gate
    (E, hidden, r)``, ...). No dropout: the adapters are folded into the grouped GEMMs."""

    def __init__(self, experts: GroupedExperts, *, rank: int, alpha: float, seed: int) -> None:
        nn.Module.__init__(self)
        self.dim, self.hidden_dim = experts.dim, experts.hidden_dim
        self.num_experts, self.impl = experts.num_experts, experts.impl
        self.gemm, self.activation = experts.gemm, experts.activation
        self.w_gate, self.w_up, self.w_down = experts.w_gate, experts.w_up, experts.w_down
        self.b_gate, self.b_up, self.b_down = experts.b_gate, experts.b_up, experts.b_down
        self.rank, self.alpha, self.seed = rank, alpha, seed
        self.scale = alpha / rank
        for proj in _PROJECTIONS:
            w = getattr(self, f"w_{proj}")
            E, out, inp = w.shape
            like = dict(device=w.device, dtype=w.dtype)
            setattr(self, f"lora_a_{proj}", nn.Parameter(torch.empty(E, rank, inp, **like)))
            setattr(self, f"lora_b_{proj}", nn.Parameter(torch.empty(E, out, rank, **like)))

    def _weights(self) -> tuple[torch.Tensor, ...]:
        merged = tuple(
            getattr(self, f"w_{p}")
            + lora_delta(getattr(self, f"lora_a_{p}"), getattr(self, f"lora_b_{p}"), self.scale)
            for p in _PROJECTIONS
        )
        biases = (self.b_gate, self.b_up, self.b_down)
        if self.has_bias:
            return (*merged, *(b for b in biases if b is not None))  # all three with has_bias
        return merged

    def adapter_inits(self) -> dict[str, Init]:
        """``A`` ~ N(0, 1/in) per expert from the adapters' seed, ``B`` zero."""
        inits: dict[str, Init] = {}
        for proj in _PROJECTIONS:
            fan_in = self.hidden_dim if proj == "down" else self.dim
            inits[f"lora_a_{proj}"] = Normal(1.0 / math.sqrt(fan_in), seed=self.seed)
            inits[f"lora_b_{proj}"] = Constant(0.0)
        return inits

    def lora_pairs(self) -> dict[str, tuple[str, str]]:
        """Base weight name -> (A name, B name)."""
        return {f"w_{p}": (f"lora_a_{p}", f"lora_b_{p}") for p in _PROJECTIONS}

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, rank={self.rank}, alpha={self.alpha}"


def _candidates(model: nn.Module) -> dict[str, nn.Module]:
    return {
        fqn: m
        for fqn, m in model.named_modules()
        if fqn and type(m) in (nn.Linear, GroupedExperts, LoRALinear, LoRAGroupedExperts)
    }


def _check_args(rank: int, alpha: float, targets: Sequence[str], dropout: float) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"apply_lora: rank={rank!r} must be an int >= 1")
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"apply_lora: alpha={alpha!r} must be a finite number > 0")
    if not (isinstance(dropout, (int, float)) and 0.0 <= dropout < 1.0):
        raise ValueError(f"apply_lora: dropout={dropout!r} must be in [0, 1)")
    if isinstance(targets, str) or not targets or not all(isinstance(g, str) for g in targets):
        raise ValueError(
            f"apply_lora: targets={targets!r} must be a non-empty list of module globs ('*' "
            "within a segment, '**' a run of them), e.g. ['layers.*.attention.w*']"
        )


def apply_lora(
    model: nn.Module,
    *,
    rank: int,
    alpha: float,
    targets: Sequence[str],
    dropout: float = 0.0,
    seed: int = 0,
) -> list[str]:
    """Swap every linear / routed-experts module matching a glob of ``targets`` for its LoRA
    form, in place, and freeze every other parameter; returns the swapped FQNs.

    Works on a ``meta`` model (the adapters start when the model is initialised: see the
    module doc) and on a materialised one (the adapters are initialised here, on the base's
    device). ``ValueError`` before anything changes for a glob that matches no module, a
    matched module that is neither an ``nn.Linear`` nor a ``GroupedExperts``, one already
    adapted, or experts with ``dropout > 0``.
    """
    _check_args(rank, alpha, targets, dropout)
    modules = dict(model.named_modules())
    candidates = _candidates(model)
    chosen: list[str] = []
    for glob in targets:
        matched = [f for f in modules if f and fqn_matches(glob, f)]
        if not matched:
            names = [f for f in candidates if "." in f][:6]
            raise ValueError(
                f"apply_lora: targets glob {glob!r} matches no module of the model ('*' within "
                f"a segment, '**' a run of them; linears and experts: {', '.join(names)}, ...)"
            )
        hits = [f for f in matched if f in candidates]
        if len(hits) != len(matched):
            bad = next(f for f in matched if f not in candidates)
            raise ValueError(
                f"apply_lora: targets glob {glob!r} matches {bad!r} "
                f"({type(modules[bad]).__name__}); targets must name only nn.Linear or "
                "routed-experts (GroupedExperts) modules, e.g. 'layers.*.attention.wq'"
            )
        chosen += [f for f in hits if f not in chosen]
    for fqn in chosen:
        m = candidates[fqn]
        if isinstance(m, (LoRALinear, LoRAGroupedExperts)):
            raise ValueError(f"apply_lora: {fqn!r} already has LoRA adapters")
        if isinstance(m, GroupedExperts) and dropout > 0:
            raise ValueError(
                f"apply_lora: dropout={dropout} on routed experts {fqn!r} is not supported (their "
                "adapters run inside the grouped GEMMs); use dropout=0 or leave experts out of "
                "targets"
            )
    for p in model.parameters():
        p.requires_grad_(False)
    swapped: dict[str, LoRALinear | LoRAGroupedExperts] = {}
    for fqn in chosen:
        m = candidates[fqn]
        new: LoRALinear | LoRAGroupedExperts
        if isinstance(m, nn.Linear):
            new = LoRALinear(m, rank=rank, alpha=alpha, dropout=dropout, seed=seed)
        else:
            assert isinstance(m, GroupedExperts)  # the other candidates
            new = LoRAGroupedExperts(m, rank=rank, alpha=alpha, seed=seed)
        parent_fqn, _, attr = fqn.rpartition(".")
        setattr(model.get_submodule(parent_fqn), attr, new)
        swapped[fqn] = new
    state, inits = {}, {}
    for fqn, new in swapped.items():
        for name, init in new.adapter_inits().items():
            state[f"{fqn}.{name}"] = getattr(new, name)
            inits[f"{fqn}.{name}"] = init
    init_state(state, inits, seed=seed)  # meta adapters are skipped: filled by init later
    return chosen


def lora_weights(model: nn.Module) -> dict[str, tuple[str, str, float]]:
    """Every adapted base weight of ``model``: FQN -> (FQN of A, FQN of B, scale)."""
    out = {}
    for fqn, m in model.named_modules():
        if isinstance(m, (LoRALinear, LoRAGroupedExperts)):
            prefix = f"{fqn}." if fqn else ""
            for w, (a, b) in m.lora_pairs().items():
                out[prefix + w] = (prefix + a, prefix + b, m.scale)
    return out


@torch.no_grad()
def merge_lora(model: nn.Module) -> list[str]:
    """Fold every adapter into its base weight (``W += s · B A``) and swap the plain module
    back (same parameters, adapters dropped), in place: a model to export. Returns the FQNs
    merged."""
    merged = []
    for fqn, m in list(model.named_modules()):
        if not isinstance(m, (LoRALinear, LoRAGroupedExperts)):
            continue
        for w, (a, b) in m.lora_pairs().items():
            weight = getattr(m, w)
            delta = lora_delta(getattr(m, a), getattr(m, b), m.scale)
            weight.add_(delta.to(weight.dtype))
        if isinstance(m, LoRALinear):
            plain = nn.Linear.__new__(nn.Linear)
            nn.Module.__init__(plain)
            plain.in_features, plain.out_features = m.in_features, m.out_features
            plain.weight, plain.bias = m.weight, m.bias
        else:
            plain = GroupedExperts.__new__(GroupedExperts)
            nn.Module.__init__(plain)
            for attr in ("dim", "hidden_dim", "num_experts", "impl", "gemm", "activation"):
                setattr(plain, attr, getattr(m, attr))
            for attr in ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"):
                setattr(plain, attr, getattr(m, attr))
        parent_fqn, _, attr = fqn.rpartition(".")
        setattr(model.get_submodule(parent_fqn), attr, plain)
        merged.append(fqn)
    return merged
