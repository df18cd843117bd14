"""Policy losses by name: the built-in GRPO family and your own.

A policy loss is a function with ``grpo_loss``'s signature::

    fn(logprobs, old_logprobs, advantages, mask, config, *, rollout_logprobs, ref_logprobs)
        -> LossOutput

``LossConfig.name`` picks one for ``GRPOLearner`` (and ``titan-train rl --loss.name``);
``register_loss`` adds yours under a new name. Built in:

- ``grpo``: ``grpo_loss`` with the ``LossConfig`` as given (defaults: token mean, clip-higher
  ``eps_high=0.28``, advantages normalised by the group's std);
- ``dapo``: DAPO's token-level loss: ``grpo_loss`` with ``aggregation="token_mean"`` whatever
  the config says (with ``eps_high`` its clip-higher);
- ``dr_grpo``: Dr. GRPO: each sequence's token sum over a constant length
  (``aggregation="seq_mean_token_sum_norm"``, ``norm_length`` or the padded length), and
  advantages not divided by the group's std.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .losses import LossConfig, LossOutput, grpo_loss

__all__ = ["PolicyLoss", "get_loss", "loss_names", "register_loss"]

LossFunction = Callable[..., LossOutput]


@dataclass(frozen=True, slots=True)
class PolicyLoss:
    """A registered policy loss."""

    name: str
    fn: LossFunction
    """``grpo_loss``'s signature (see the module doc)."""
    normalize_std: bool | None = None
    """Whether group advantages are divided by the group's std; None: the trainer's own
    setting (``GRPOConfig.normalize_std``)."""
    summary: str = ""


_LOSSES: dict[str, PolicyLoss] = {}


def register_loss(
    name: str,
    fn: LossFunction,
    *,
    normalize_std: bool | None = None,
    summary: str = "",
    replace: bool = False,
) -> PolicyLoss:
    """Register ``fn`` as the policy loss ``name`` (``replace=True`` to redefine one)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"loss name {name!r} must be an identifier (letters, digits, _)")
    if not callable(fn):
        raise TypeError(f"loss {name!r}: fn must be callable, got {type(fn).__name__}")
    if name in _LOSSES and not replace:
        raise ValueError(f"loss {name!r} is registered already (pass replace=True to redefine)")
    _LOSSES[name] = PolicyLoss(name, fn, normalize_std, summary)
    return _LOSSES[name]


def get_loss(name: str) -> PolicyLoss:
    """The policy loss ``name`` (a ``ValueError`` naming the registered ones otherwise)."""
    if name not in _LOSSES:
        raise ValueError(
            f"LossConfig.name={name!r} is not a registered loss; known: {loss_names()}"
        )
    return _LOSSES[name]


def loss_names() -> list[str]:
    """The registered loss names."""
    return sorted(_LOSSES)


def _with(**changes: Any) -> LossFunction:
    def fn(
        logprobs: Any, old_logprobs: Any, advantages: Any, mask: Any, config: LossConfig, **kw: Any
    ) -> LossOutput:
        config = dataclasses.replace(config, **changes)
        return grpo_loss(logprobs, old_logprobs, advantages, mask, config, **kw)

    return fn


register_loss("grpo", grpo_loss, summary="clipped objective with the LossConfig as given")
register_loss(
    "dapo", _with(aggregation="token_mean"), summary="token-level mean, clip-higher (eps_high)"
)
register_loss(
    "dr_grpo",
    _with(aggregation="seq_mean_token_sum_norm"),
    normalize_std=False,
    summary="sequence sums over a constant length; advantages not divided by the std",
)
