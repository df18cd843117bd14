"""The MoE layer: router + (shared experts) + dispatch/permute + grouped experts + combine.

Shapes: ``B`` batch, ``S`` sequence, ``T = B * S`` tokens, ``D`` model dim, ``K`` top_k,
``R`` rows of the expert buffer.

A drop-in for a dense MLP: ``MoE(config)(x)`` maps (B, S, D) or (T, D) to the same shape.
Single-device by default (``LocalDispatcher``); ``expert_parallel(moe, group)`` shards the
experts over a process group and installs an expert-parallel dispatcher, from outside.

The sequence-wise balance loss (``RouterConfig.seq_aux_loss_coef > 0``, training only) is
attached to the output the way DeepSeek-V2 does it: the forward value is unchanged and the
backward adds d(aux)/d(params) as if ``aux`` had been added to the loss with weight 1. Its
value is kept (detached) in ``moe.aux_loss`` for logging.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from dist_moe.dispatch import AllToAllDispatcher, Dispatcher, LocalDispatcher
from dist_moe.experts import (
    ExpertsImpl,
    GroupedExperts,
    GroupedGemm,
    SharedExperts,
    SwiGLU,
    check_grouped_gemm,
)
from dist_moe.permute import PermuteConfig
from dist_moe.placement import ExpertPlacement
from dist_moe.router import ExpertLoad, RouterConfig, TopKRouter
from dist_moe.symm_mem import SymmMemDispatcher
from dist_moe.token_split import TokenSplitDispatcher

__all__ = ["MoE", "MoEConfig", "expert_parallel"]


@dataclass(kw_only=True, slots=True)
class MoEConfig:
    """One MoE layer."""

    dim: int
    """Model dim D."""
    hidden_dim: int
    """Hidden dim of each routed SwiGLU expert."""
    router: RouterConfig
    """Routing (number of experts, top-k, scores, balancing)."""
    shared_hidden_dim: int = 0
    """Hidden dim of the shared SwiGLU expert(s) seen by every token (0: none). DeepSeek-V3:
    n_shared_experts * moe_intermediate_size."""
    shared_gate: bool = False
    """Sigmoid gate on the shared expert output (Qwen2-MoE)."""
    permute: PermuteConfig = field(default_factory=PermuteConfig)
    """Alignment, dropless or capacity, static shapes, kernel backend."""
    experts_impl: ExpertsImpl = "auto"
    """"grouped_mm", the per-expert "loop" reference, or "auto" (grouped GEMM when usable)."""
    activation: SwiGLU = field(default_factory=SwiGLU)
    """Gated activation of the routed and the shared experts (clamps, gain, up offset)."""
    expert_bias: bool = False
    """Per-expert biases on the routed experts' projections (gpt-oss)."""
    grouped_gemm: GroupedGemm = "torch"
    """Kernel of the routed experts' grouped GEMMs: "torch" (``torch._grouped_mm``), "triton"
    (``triton_grouped_mm``: CUDA, ragged groups) or "cute" (the CuTe DSL kernel: SM90 / SM100,
    bf16, a capacity layout); see ``GroupedExperts``."""

    def __post_init__(self) -> None:
        for name in ("dim", "hidden_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MoEConfig.{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.router, RouterConfig):
            raise ValueError(f"MoEConfig.router must be a RouterConfig, got {self.router!r}")
        if not isinstance(self.permute, PermuteConfig):
            raise ValueError(f"MoEConfig.permute must be a PermuteConfig, got {self.permute!r}")
        v = self.shared_hidden_dim
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"MoEConfig.shared_hidden_dim must be an int >= 0, got {v!r}")
        if not isinstance(self.activation, SwiGLU):
            raise ValueError(f"MoEConfig.activation must be a SwiGLU, got {self.activation!r}")
        check_grouped_gemm(self.grouped_gemm, "MoEConfig.grouped_gemm")
        if self.experts_impl not in ("auto", "grouped_mm", "loop"):
            raise ValueError(
                "MoEConfig.experts_impl must be 'auto', 'grouped_mm' or 'loop', "
                f"got {self.experts_impl!r}"
            )


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


class MoE(nn.Module):
    """Mixture-of-experts SwiGLU layer (see the module docstring)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        rc = config.router
        self.router = TopKRouter(config.dim, rc)
        self.experts = GroupedExperts(
            config.dim,
            config.hidden_dim,
            rc.num_experts,
            impl=config.experts_impl,
            activation=config.activation,
            bias=config.expert_bias,
            gemm=config.grouped_gemm,
        )
        self.shared_experts = (
            SharedExperts(
                config.dim,
                config.shared_hidden_dim,
                gate=config.shared_gate,
                activation=config.activation,
            )
            if config.shared_hidden_dim
            else None
        )
        self.dispatcher: Dispatcher = LocalDispatcher(rc.num_experts, config.permute)
        self.aux_loss: torch.Tensor | None = None

    def reset_parameters(self, std: float = 0.02) -> None:
        self.router.reset_parameters(std)
        self.experts.reset_parameters(std)
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters(std)

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"MoE: x must be a tensor, got {type(x).__name__}")
        if x.dim() not in (2, 3) or x.shape[-1] != self.config.dim:
            raise ValueError(
                f"MoE: x must have shape (B, S, {self.config.dim}) or (T, {self.config.dim}), "
                f"got {tuple(x.shape)}"
            )
        if not x.is_floating_point():
            raise ValueError(f"MoE: x must be a floating-point tensor, got dtype {x.dtype}")
        # x may be narrower than the weights (under sharded mixed precision the experts'
        # weights are still the fp32 master shards here), never wider: a float64 x against
        # fp32 weights is a caller's mistake that would otherwise fail deep in a matmul.
        w_dtype = next(self.experts.parameters()).dtype
        if x.dtype.itemsize > w_dtype.itemsize:
            raise ValueError(
                f"MoE: x has dtype {x.dtype}, wider than the experts' weights ({w_dtype}); "
                f"cast x to {w_dtype} or narrower"
            )

    def forward(self, x: torch.Tensor, *, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(B, S, D) or (T, D) → the same shape. ``token_ids`` ((B, S) or (T,)): the tokens'
        ids, needed by hash routing (``RouterConfig.hash_vocab_size``), ignored otherwise."""
        self._check_input(x)
        if self.experts.gemm == "cute" and self.config.permute.capacity_factor is None:
            raise ValueError(
                "MoE: grouped_gemm='cute' runs equal per-expert groups, a capacity layout: set "
                "PermuteConfig.capacity_factor (this layer is dropless)"
            )
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        ids_T = token_ids.reshape(-1) if token_ids is not None else None
        route = self.router(x_TD, seq_len=shape[1] if x.dim() == 3 else None, token_ids=ids_T)
        out_TD = self.dispatcher.forward_experts(
            self.experts, x_TD, route.indices, route.weights, route.counts
        )
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        if route.aux_loss is not None:
            self.aux_loss = route.aux_loss.detach()
            out_TD = _AttachAuxLoss.apply(out_TD, route.aux_loss)
        return out_TD.reshape(shape)

    def load(self) -> ExpertLoad:
        """Expert load since the last bias update / reset (see ``TopKRouter.load``)."""
        return self.router.load()


def expert_parallel(
    moe: MoE,
    group: dist.ProcessGroup | None = None,
    *,
    dispatcher: Literal["all_to_all", "symm_mem"] | Dispatcher = "all_to_all",
    token_group: dist.ProcessGroup | None = None,
) -> ExpertPlacement:
    """Shard ``moe``'s routed experts over ``group`` and install an expert-parallel dispatcher.

    ``dispatcher`` is ``"all_to_all"``, ``"symm_mem"`` (``SymmMemDispatcher`` with its
    defaults) or a dispatcher built over the same group and number of experts (for options:
    ``SymmMemDispatcher(E, group, config, max_tokens=..., emulate=True)``).

    The experts must still be full (E, ...) tensors, identical on every rank (same seed or
    loaded from the same checkpoint); each rank keeps its slice. Router and shared experts
    stay replicated (their gradients are data-parallel: reduce them as usual). The expert
    parameters are replaced, so call this before building the optimizer. Checks happen before
    anything changes; no collective runs here.

    ``token_group``: a group over which the MoE's input is replicated (a tensor-parallel
    group): every rank still routes every token, but dispatches only its slice of them, and
    the routed outputs are gathered over ``token_group`` (``TokenSplitDispatcher``). Router
    and shared-expert gradients are then whole and equal on every rank of it.
    """
    if not isinstance(moe, MoE):
        raise ValueError(f"expert_parallel: moe must be a MoE, got {type(moe).__name__}")
    num_experts = moe.config.router.num_experts
    if isinstance(dispatcher, Dispatcher):
        if isinstance(dispatcher, LocalDispatcher) or dispatcher.num_experts != num_experts:
            raise ValueError(
                "expert_parallel: dispatcher must be an expert-parallel dispatcher over "
                f"num_experts={num_experts}, got {type(dispatcher).__name__} over "
                f"{dispatcher.num_experts}"
            )
    elif dispatcher not in ("all_to_all", "symm_mem"):
        raise ValueError(
            "expert_parallel: dispatcher must be 'all_to_all', 'symm_mem' or a Dispatcher, "
            f"got {dispatcher!r}"
        )
    if moe.experts.num_experts != num_experts:
        raise ValueError("expert_parallel: the experts of this MoE are already sharded")
    placement = ExpertPlacement.from_group(num_experts, group)
    if isinstance(dispatcher, Dispatcher):
        new_dispatcher = dispatcher
    else:
        cls = AllToAllDispatcher if dispatcher == "all_to_all" else SymmMemDispatcher
        new_dispatcher = cls(num_experts, group, moe.config.permute)
    experts = moe.experts
    for name, full in list(experts.named_parameters(recurse=False)):  # weights and biases
        shard = nn.Parameter(
            placement.shard(full.detach()).clone(), requires_grad=full.requires_grad
        )
        setattr(experts, name, shard)
    experts.num_experts = placement.num_local_experts
    if token_group is not None:
        new_dispatcher = TokenSplitDispatcher(new_dispatcher, token_group)
    moe.dispatcher = new_dispatcher
    return placement
