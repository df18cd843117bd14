"""Swap a Hugging Face Qwen3-MoE model's sparse MoE blocks for dist_moe's ``MoE``.

``transformers`` keeps each Qwen3-MoE layer's experts fused in memory (``Qwen3MoeExperts``)::

    mlp.gate.weight                (E, H)       router logits = x @ W^T
    mlp.experts.gate_up_proj       (E, 2I, H)   rows [:I] gate, rows [I:] up
    mlp.experts.down_proj          (E, H, I)

and dist_moe names the same numbers ``router.gate.weight`` (E, D), ``experts.w_gate`` /
``experts.w_up`` (E, I, D) and ``experts.w_down`` (E, D, I). Routing is HF's: softmax over
all experts in fp32 from logits in the model's dtype, top-k, optional renormalisation
(``RouterConfig(score_func="softmax", norm_topk_prob=..., logits_dtype=None)``).

The replacement, ``HFSparseMoeBlock``, is a ``MoE`` (so ``expert_parallel`` applies to it)
that also keeps a parameter-free ``gate`` module of HF's router class which receives the
router logits of each forward. HF collects ``output_router_logits`` with forward hooks on
modules of that class, so the auxiliary loss keeps working after the swap; hooks HF had
already installed on the old router move to the new one. Nothing here imports
``transformers``: the model is inspected by its attributes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dist_moe.experts import ExpertsImpl
from dist_moe.moe import MoE, MoEConfig
from dist_moe.permute import PermuteConfig
from dist_moe.router import RouterConfig, RouterOutput

__all__ = ["HFSparseMoeBlock", "moe_from_hf_block", "swap_hf_moe_blocks"]

_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


class _RouterLogitsTap(nn.Module):
    """Identity on the router logits, returned as HF routers return them: ``(logits, ...)``."""

    def __init__(self) -> None:
        nn.Module.__init__(self)  # not the HF router's __init__: the tap has no weights

    def forward(self, logits_TE: torch.Tensor) -> tuple[torch.Tensor]:
        return (logits_TE,)


_TAP_CLASSES: dict[type, type] = {}


def _logits_tap(hf_router: nn.Module) -> nn.Module:
    """A parameter-free module that is an instance of ``type(hf_router)`` (for HF's hooks)."""
    cls = type(hf_router)
    if cls not in _TAP_CLASSES:
        _TAP_CLASSES[cls] = type(
            f"{cls.__name__}LogitsTap", (_RouterLogitsTap, cls), {"__module__": __name__}
        )
    tap = _TAP_CLASSES[cls]()
    for name in _HOOK_DICTS:
        getattr(tap, name).update(getattr(hf_router, name, {}))
    return tap


class HFSparseMoeBlock(MoE):
    """dist_moe ``MoE`` standing in for an HF sparse MoE block (see the module docstring).

    ``gate`` is the logits tap (no parameters); the router weight is ``router.gate.weight``.
    """

    def __init__(self, config: MoEConfig, gate: nn.Module) -> None:
        super().__init__(config)
        self.gate = gate
        self.router.register_forward_hook(self._emit_router_logits)

    def _emit_router_logits(self, router: nn.Module, args, out: RouterOutput) -> None:
        self.gate(out.logits)


def _hf_block_shapes(block: nn.Module, where: str) -> tuple[int, int, int, int]:
    # an HF block: duck-typed, checked field by field below
    gate: Any = getattr(block, "gate", None)
    experts: Any = getattr(block, "experts", None)
    fields = ("gate.weight", "gate.top_k", "experts.gate_up_proj", "experts.down_proj")
    ok = (
        isinstance(getattr(gate, "weight", None), torch.Tensor)
        and isinstance(getattr(gate, "top_k", None), int)
        and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(experts, "down_proj", None), torch.Tensor)
    )
    if not ok:
        raise ValueError(
            f"{where}: expected a Qwen3-MoE sparse block with {', '.join(fields)}, got "
            f"{type(block).__name__}"
        )
    for extra in ("shared_expert", "shared_experts"):
        if getattr(block, extra, None) is not None:
            raise ValueError(
                f"{where}: {type(block).__name__} has a {extra}; only Qwen3-MoE-style blocks "
                "(router + routed experts) are supported"
            )
    num_experts, hidden = gate.weight.shape
    _, two_i, h2 = experts.gate_up_proj.shape
    if (
        experts.gate_up_proj.shape[0] != num_experts
        or h2 != hidden
        or two_i % 2
        or tuple(experts.down_proj.shape) != (num_experts, hidden, two_i // 2)
    ):
        raise ValueError(
            f"{where}: inconsistent shapes gate.weight {tuple(gate.weight.shape)}, "
            f"experts.gate_up_proj {tuple(experts.gate_up_proj.shape)}, experts.down_proj "
            f"{tuple(experts.down_proj.shape)}; expected (E, H), (E, 2I, H), (E, H, I)"
        )
    act = getattr(experts, "act_fn", None)
    probe = torch.linspace(-4.0, 4.0, 17)
    if act is None or not torch.allclose(act(probe), F.silu(probe)):
        raise ValueError(f"{where}: experts.act_fn must be SiLU (SwiGLU experts), got {act!r}")
    return num_experts, gate.top_k, hidden, two_i // 2


def moe_from_hf_block(
    block: nn.Module,
    *,
    permute: PermuteConfig | None = None,
    experts_impl: ExpertsImpl = "auto",
) -> HFSparseMoeBlock:
    """A ``HFSparseMoeBlock`` holding a copy of ``block``'s weights (same device and dtype).

    ``block`` is an HF Qwen3-MoE ``Qwen3MoeSparseMoeBlock`` (router ``gate`` + fused
    ``experts``); the result computes the same function (up to summation order).
    """
    num_experts, top_k, hidden, inter = _hf_block_shapes(block, "moe_from_hf_block")
    hf: Any = block  # its fields checked by _hf_block_shapes
    gate_w = hf.gate.weight
    config = MoEConfig(
        dim=hidden,
        hidden_dim=inter,
        router=RouterConfig(
            num_experts=num_experts,
            top_k=top_k,
            score_func="softmax",
            norm_topk_prob=bool(getattr(hf.gate, "norm_topk_prob", False)),
            logits_dtype=None,
        ),
        permute=permute if permute is not None else PermuteConfig(),
        experts_impl=experts_impl,
    )
    with torch.device("meta"):
        moe = HFSparseMoeBlock(config, _logits_tap(hf.gate))
    moe.to_empty(device=gate_w.device)
    moe.to(gate_w.dtype)
    gate_up = hf.experts.gate_up_proj.detach()
    with torch.no_grad():
        moe.router.gate.weight.copy_(gate_w)
        moe.experts.w_gate.copy_(gate_up[:, :inter])
        moe.experts.w_up.copy_(gate_up[:, inter:])
        moe.experts.w_down.copy_(hf.experts.down_proj)
        moe.router.expert_bias.zero_()
        moe.router.tokens_per_expert.zero_()
    moe.train(block.training)
    return moe


def swap_hf_moe_blocks(
    model: nn.Module,
    *,
    permute: PermuteConfig | None = None,
    experts_impl: ExpertsImpl = "auto",
) -> list[str]:
    """Replace every Qwen3-MoE sparse block inside ``model`` by ``moe_from_hf_block(block)``.

    Blocks are found by class name (``...SparseMoeBlock``); returns their qualified names.
    Call it before building the optimizer (the parameters are new objects), then
    ``expert_parallel(model.get_submodule(name), group)`` for each name to shard the experts.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"swap_hf_moe_blocks: model must be an nn.Module, got {type(model)}")
    names = [
        n
        for n, m in model.named_modules()
        if type(m).__name__.endswith("SparseMoeBlock") and not isinstance(m, MoE)
    ]
    if not names:
        raise ValueError(
            "swap_hf_moe_blocks: found no module whose class name ends with 'SparseMoeBlock' "
            f"in {type(model).__name__}"
        )
    new = {
        n: moe_from_hf_block(model.get_submodule(n), permute=permute, experts_impl=experts_impl)
        for n in names
    }
    for name, moe in new.items():
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, moe)
    return names
