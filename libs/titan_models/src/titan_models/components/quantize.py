"""Low-precision training by module swap: FP8 / MXFP8 / NVFP4 linears, FP8 routed experts.

``quantize_modules(model, linear=Float8Recipe("mxfp8"), experts=Float8Recipe("mxfp8"),
exclude=("output",))`` replaces every selected ``nn.Linear`` with a :class:`Float8Linear`
and every ``dist_moe.GroupedExperts`` with a :class:`Float8GroupedExperts`. A replacement
takes over the original module's parameters (the same ``nn.Parameter`` objects: master
weights stay in their dtype, fp32 or bf16), so FQNs, state dicts, checkpoints, HF export,
initialisation and the parallel plans see nothing new. Run it on the meta model, before
parallelisation (expert parallelism slices the swapped experts like the original ones).

Always left in high precision: MoE router gates and shared-expert gates (scores decide the
routing; their output dims are the expert count or 1). Every other choice is the caller's:
``include`` / ``exclude`` are module globs with ``titan_models.fqn_matches`` semantics (one FQN
segment per ``*``). Every check (a glob that matches no candidate, a dim that is not a
multiple of 16, or of 32 for MXFP8; NVFP4 for routed experts) runs before the first module
is swapped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import nn

from dist_moe import ExpertRun, GroupedExperts, LocalDispatcher, MoE, SharedExperts, TopKRouter

from .float8 import MX_BLOCK
from .scaled_mm import Float8Recipe, scaled_grouped_linear, scaled_linear

__all__ = ["Float8GroupedExperts", "Float8Linear", "quantize_modules"]


def _compute_inputs(x: torch.Tensor, *ws: torch.Tensor) -> list[torch.Tensor]:
    """Operands in the dtype autocast would give a linear (the custom GEMM runs outside it)."""
    dev = x.device.type
    if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        return [t.to(dtype) for t in (x, *ws)]
    return [x, *ws]


def _no_autocast(x: torch.Tensor):
    dev = x.device.type if x.device.type in ("cpu", "cuda") else "cpu"
    return torch.autocast(dev, enabled=False)


class Float8Linear(nn.Linear):
    """``nn.Linear`` whose forward and backward GEMMs run in FP8 / MXFP8 (``scaled_linear``);
    holds the replaced linear's own parameters."""

    def __init__(self, linear: nn.Linear, recipe: Float8Recipe) -> None:
        nn.Module.__init__(self)  # nn.Linear.__init__ would allocate new parameters
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.recipe = recipe

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's parameter name
        x, w = _compute_inputs(input, self.weight)
        with _no_autocast(x):
            y = scaled_linear(x, w, self.recipe)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.mode}"


class Float8GroupedExperts(GroupedExperts):
    """``dist_moe.GroupedExperts`` whose three grouped GEMMs (and their backward) run in FP8 /
    MXFP8 (``scaled_grouped_linear``); holds the replaced experts' own parameters."""

    def __init__(self, experts: GroupedExperts, recipe: Float8Recipe) -> None:
        if experts.has_bias:
            raise ValueError(
                "quantize: experts with per-expert biases (gpt-oss) are not supported in FP8; "
                "leave them out with quantize experts=None or an exclude glob"
            )
        nn.Module.__init__(self)
        self.dim, self.hidden_dim = experts.dim, experts.hidden_dim
        self.num_experts, self.impl = experts.num_experts, experts.impl
        self.gemm, self.activation = "torch", experts.activation  # the scaled GEMMs replace it
        self.w_gate, self.w_up, self.w_down = experts.w_gate, experts.w_up, experts.w_down
        self.b_gate: nn.Parameter | None = None
        self.b_up: nn.Parameter | None = None
        self.b_down: nn.Parameter | None = None
        self.recipe = recipe

    def forward(
        self,
        x_RD: torch.Tensor,
        group_ends: torch.Tensor,
        weights: tuple[torch.Tensor, ...] | ExpertRun | None = None,  # no biases
    ) -> torch.Tensor:
        x_RD, w_gate, w_up, w_down = _compute_inputs(x_RD, *self.resolve_weights(weights))
        r = self.recipe
        with _no_autocast(x_RD):
            gate = scaled_grouped_linear(x_RD, w_gate, group_ends, r)
            up = scaled_grouped_linear(x_RD, w_up, group_ends, r)
            return scaled_grouped_linear(self.activation(gate, up), w_down, group_ends, r)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, recipe={self.recipe.mode}"


def _always_high_precision(model: nn.Module, fqn: str) -> bool:
    """Router gates and shared-expert gates."""
    parent_fqn, _, name = fqn.rpartition(".")
    parent = model.get_submodule(parent_fqn)
    return isinstance(parent, TopKRouter) or (isinstance(parent, SharedExperts) and name == "gate")


def _selected(
    candidates: list[str], include: Sequence[str], exclude: Sequence[str], what: str
) -> list[str]:
    from ..fqn import fqn_matches

    for field, globs in (("include", include), ("exclude", exclude)):
        for g in globs:
            if not any(fqn_matches(g, f) for f in candidates):
                raise ValueError(
                    f"quantize {field} glob {g!r} matches no {what} ('*' within a segment, "
                    "'**' a run of them; "
                    f"candidates: {', '.join(candidates[:6])}{', ...' if len(candidates) > 6 else ''})"
                )
    keep = [f for f in candidates if not include or any(fqn_matches(g, f) for g in include)]
    return [f for f in keep if not any(fqn_matches(g, f) for g in exclude)]


def _check_dims(fqn: str, dims: dict[str, int], recipe: Float8Recipe) -> None:
    m = recipe.multiple
    for name, v in dims.items():
        if v % m:
            why = {"mxfp8": f"MXFP8 blocks of {MX_BLOCK}", "nvfp4": "NVFP4 blocks of 16"}.get(
                recipe.mode, "the fp8 GEMM kernels"
            )
            raise ValueError(
                f"quantize {recipe.mode}: {fqn} has {name}={v}, not a multiple of {m} ({why}); "
                f"leave it in high precision with an exclude glob"
            )


def quantize_modules(
    model: nn.Module,
    *,
    linear: Float8Recipe | None = None,
    experts: Float8Recipe | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
) -> dict[str, str]:
    """Swap ``model``'s linears (``linear``) and routed experts (``experts``) for FP8 / MXFP8
    ones, in place; returns FQN -> recipe mode of every swapped module.

    ``include``: globs of the modules to quantise (empty: all candidates); ``exclude``: globs
    left in high precision. Each glob must match at least one candidate (a linear, or a routed
    experts module). ``ValueError`` before any swap for a glob that matches nothing or a dim
    the recipe cannot tile. MXFP8 experts get their MoE's row alignment raised to a multiple
    of 32 (blocks of a weight gradient must not straddle two experts).
    """
    if experts is not None and experts.mode == "nvfp4":
        raise ValueError(
            "quantize experts: nvfp4 has no grouped GEMM (routed experts); use an fp8 recipe "
            "for the experts, or none"
        )
    modules = dict(model.named_modules())
    lin = [
        f
        for f, m in modules.items()
        if type(m) is nn.Linear and not _always_high_precision(model, f)
    ]
    exp = [f for f, m in modules.items() if type(m) is GroupedExperts]
    kinds = []
    if linear is not None:
        kinds.append("linear")
    if experts is not None:
        kinds.append("routed experts")
    candidates = (lin if linear is not None else []) + (exp if experts is not None else [])
    if not candidates:
        if include or exclude:
            raise ValueError("quantize include/exclude globs given but nothing is quantised")
        return {}
    chosen = _selected(candidates, include, exclude, " or ".join(kinds) + " module")
    plan: dict[str, Float8Linear | Float8GroupedExperts] = {}
    for fqn in chosen:
        m = modules[fqn]
        if isinstance(m, nn.Linear):
            assert linear is not None  # a candidate only with a linear recipe
            _check_dims(fqn, {"in_features": m.in_features, "out_features": m.out_features}, linear)
            plan[fqn] = Float8Linear(m, linear)
        else:
            assert isinstance(m, GroupedExperts) and experts is not None  # the other candidates
            _check_dims(fqn, {"dim": m.dim, "hidden_dim": m.hidden_dim}, experts)
            plan[fqn] = Float8GroupedExperts(m, experts)
    for fqn, new in plan.items():
        parent_fqn, _, attr = fqn.rpartition(".")
        parent = model.get_submodule(parent_fqn)
        setattr(parent, attr, new)
        if isinstance(new, Float8GroupedExperts) and new.recipe.mode == "mxfp8":
            _align_rows(parent, MX_BLOCK)
    return {fqn: new.recipe.mode for fqn, new in plan.items()}


def _align_rows(moe: nn.Module, multiple: int) -> None:
    """Pad each expert's row group of ``moe`` to a multiple of ``multiple``."""
    if not isinstance(moe, MoE) or not isinstance(moe.dispatcher, LocalDispatcher):
        raise ValueError(
            f"quantize mxfp8 experts: the experts' parent must be a dist_moe.MoE with its local dispatcher (quantise before expert parallelism), got {type(moe).__name__}"
        )
    permute = moe.config.permute
    if permute.alignment % multiple == 0:
        return
    permute = dataclasses.replace(permute, alignment=math.lcm(permute.alignment, multiple))
    moe.config = dataclasses.replace(moe.config, permute=permute)
    moe.dispatcher = LocalDispatcher(moe.config.router.num_experts, permute)
