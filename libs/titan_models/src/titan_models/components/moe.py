"""The mixture-of-experts feed-forward of the MoE families: ``dist_moe.MoE`` plus our init.

Routing, permutation, grouped experts, shared experts, the balance loss and aux-loss-free bias
balancing are dist_moe's; this module only adds the ``param_init`` every block
of a ``Transformer`` has, and the config validation the MoE families share. Expert parallelism
is applied from outside (``dist_moe.expert_parallel`` on each module the plan lists in
``ModelPlan.experts``).
"""

from __future__ import annotations

from typing import Any

import torch

from dist_moe import MoE, MoEConfig, RouterConfig, SwiGLU

from .init import Constant, HashRoutes, Init, Normal

__all__ = ["MoEFeedForward", "check_moe_fields"]


class MoEFeedForward(MoE):
    """``dist_moe.MoE`` (router → routed SwiGLU experts [+ shared experts]) with our init."""

    def __init__(
        self,
        *,
        dim: int,
        hidden_dim: int,
        router: RouterConfig,
        shared_hidden_dim: int = 0,
        shared_gate: bool = False,
        activation: SwiGLU | None = None,
        expert_bias: bool = False,
    ) -> None:
        """``shared_gate``: a per-token sigmoid gate on the shared expert (Qwen3.5-MoE);
        ``activation``: the experts' gated activation (plain SwiGLU by default);
        ``expert_bias``: per-expert biases (gpt-oss)."""
        super().__init__(
            MoEConfig(
                dim=dim,
                hidden_dim=hidden_dim,
                router=router,
                shared_hidden_dim=shared_hidden_dim,
                shared_gate=shared_gate,
                activation=activation or SwiGLU(),
                expert_bias=expert_bias,
            )
        )

    def _apply(self, fn, recurse=True):
        # Casting the model (``model.to(torch.bfloat16)``) keeps the selection bias in fp32, as
        # transformers does: bias updates of 1e-3 would round away in bf16.
        super()._apply(fn, recurse)
        bias = self.router.expert_bias
        if bias.is_floating_point() and bias.dtype != torch.float32:
            self.router.expert_bias = bias.float()
        return self

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        """N(0, std²) for the router gate (and its bias) and every input projection,
        N(0, out_std²) for the down projections into the residual stream (as
        ``FeedForward``); expert biases zero; a hash-routing table random (``HashRoutes``);
        balancing state zero (the model's buffer rule)."""
        inputs = ["router.gate.weight", "experts.w_gate", "experts.w_up"]
        outputs = ["experts.w_down"]
        if self.router.gate.bias is not None:
            inputs.append("router.gate.bias")
        if self.shared_experts is not None:
            inputs += ["shared_experts.w_gate.weight", "shared_experts.w_up.weight"]
            if self.shared_experts.gate is not None:
                inputs.append("shared_experts.gate.weight")
            outputs.append("shared_experts.w_down.weight")
        inits: dict[str, Init] = {n: Normal(std) for n in inputs}
        inits |= {n: Normal(out_std) for n in outputs}
        if self.experts.has_bias:
            inits |= {f"experts.{n}": Constant(0.0) for n in ("b_gate", "b_up", "b_down")}
        return inits

    def buffer_inits(self) -> dict[str, Init]:
        """Buffers that do not start at zero: a hash-routing table."""
        if self.router.is_hash:
            return {"router.expert_table": HashRoutes(self.config.router.num_experts)}
        return {}


def check_moe_fields(config: Any) -> None:
    """``ValueError`` naming the first MoE field of a family config that is out of range."""
    name = type(config).__name__
    for field in ("num_experts", "num_experts_per_tok", "moe_hidden_dim"):
        value = getattr(config, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}.{field} must be an int >= 1, got {value!r}")
    if config.num_experts_per_tok > config.num_experts:
        raise ValueError(
            f"{name}.num_experts_per_tok={config.num_experts_per_tok} must be <= "
            f"num_experts={config.num_experts}"
        )
    if not config.aux_loss_coef >= 0:
        raise ValueError(f"{name}.aux_loss_coef must be >= 0, got {config.aux_loss_coef!r}")
