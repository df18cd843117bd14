"""The model protocol: titan_rl trains and samples any causal LM that gives logits for ids.

A policy is a ``torch.nn.Module`` called as ``model(input_ids)`` on right-padded ``(B, S)``
token ids that returns the next-token logits ``(B, S, V)``: a tensor, or an output object
with a ``.logits`` tensor (transformers' ``CausalLMOutputWithPast``). Position ``s`` must
depend on positions ``<= s`` only (causal), so right padding changes no real position's
logits and no attention mask is passed. A model with another call signature fits through a
wrapper module (``forward(self, input_ids): return self.inner(ids=input_ids)[0]``).

titan_models' ``Transformer`` is the fast path: ``TorchGenerator`` decodes it through its
own forward with a static KV cache (one token per step, optionally compiled); any other
causal LM is decoded by recomputing the whole sequence each step.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class CausalLM(Protocol):
    """``model(input_ids)`` → logits ``(B, S, V)`` or an object with ``.logits`` (see the
    module docstring); a ``torch.nn.Module`` (parameters, ``state_dict``)."""

    def __call__(self, input_ids: torch.Tensor) -> Any:
        """Next-token logits for every position of ``input_ids``."""
        ...


def causal_lm_logits(model: CausalLM, input_ids: torch.Tensor, **inputs: Any) -> torch.Tensor:
    """``model(input_ids, **inputs)``'s logits ``(B, S, V)``, from a tensor or an output's
    ``.logits`` (``inputs``: e.g. a vision-language model's images)."""
    out = model(input_ids, **inputs)
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"{type(model).__name__}(input_ids) returned {type(out).__name__}: a causal LM for "
            "titan_rl returns logits (B, S, V) or an object with a .logits tensor "
            "(see titan_rl.CausalLM)"
        )
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(input_ids.shape):
        raise ValueError(
            f"{type(model).__name__} returned logits of shape {tuple(logits.shape)} for "
            f"input_ids {tuple(input_ids.shape)}; expected (B, S, V) = "
            f"{(*input_ids.shape, 'V')}"
        )
    return logits
