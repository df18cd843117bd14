"""GRPO-family losses as pure functions of log-probability tensors.

Shapes: B sequences (``num_groups * group_size``), T response tokens (right-padded; ``mask``
marks the real ones). Advantages are one per sequence ``(B,)`` (GRPO) or one per token
``(B, T)`` (veRL's layout; GAE, per-token shaping). Three log-probabilities per token, all of
the sampled token:

- ``logprobs``: the trainer's current policy (carries the gradient);
- ``old_logprobs``: the trainer's policy that the PPO ratio is taken against (the proximal
  policy; with one optimizer step per batch it is ``logprobs.detach()``);
- ``rollout_logprobs``: the generator's (the behaviour policy that actually sampled the tokens).

The off-policy correction weights the loss by ``w = exp(old - rollout)``, the ratio of the
trainer's policy to the generator's: truncated (TIS, ``min(w, C)``) or masked (MIS, ``w`` where
``w <= C`` else 0), per token or per sequence (``w`` of a sequence = product over its tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
Correction = Literal["none", "tis", "mis"]
CorrectionLevel = Literal["token", "sequence"]
_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
_CORRECTIONS = ("none", "tis", "mis")
_LEVELS = ("token", "sequence")


@dataclass(frozen=True, kw_only=True, slots=True)
class LossConfig:
    """How the policy-gradient loss is clipped, corrected, regularised and averaged."""

    name: str = "grpo"
    """The policy loss by name (``titan_rl.loss_names()``: grpo, dapo, dr_grpo and any
    registered with ``register_loss``)."""
    eps_low: float = 0.2
    """Lower clip range: the ratio is clipped below at ``1 - eps_low`` (in (0, 1))."""
    eps_high: float = 0.28
    """Upper clip range: the ratio is clipped above at ``1 + eps_high`` (> 0; DAPO clip-higher)."""
    aggregation: Aggregation = "token_mean"
    """token_mean: mean over every token of the batch; seq_mean_token_mean: mean over sequences
    of each sequence's token mean; seq_mean_token_sum_norm (Dr. GRPO): each sequence's token sum
    divided by ``norm_length``, averaged over sequences."""
    norm_length: int | None = None
    """Dr. GRPO's constant divisor; ``None`` uses the padded response length ``T``."""
    kl_coef: float = 0.0
    """Weight of the k3 estimate of KL(policy ‖ reference) per token; 0 disables it."""
    correction: Correction = "none"
    """Off-policy correction of the trainer/generator mismatch: none, tis (truncate), mis (mask)."""
    correction_level: CorrectionLevel = "token"
    """Ratio per token or per sequence (product over the sequence's tokens)."""
    correction_cap: float = 2.0
    """``C``: TIS truncates the weight at C, MIS drops tokens (sequences) whose weight exceeds C."""
    clip_ratio_c: float | None = None
    """Dual-clip PPO (veRL's ``clip_ratio_c``): where the advantage is negative the per-token
    loss is at most ``clip_ratio_c · |A|`` however large the ratio; > 1; None disables it."""

    def __post_init__(self) -> None:
        from .loss_registry import get_loss

        get_loss(self.name)  # a ValueError naming the registered losses
        if not 0.0 < self.eps_low < 1.0:
            raise ValueError(f"LossConfig.eps_low={self.eps_low!r} must be in (0, 1)")
        if not self.eps_high > 0.0:
            raise ValueError(f"LossConfig.eps_high={self.eps_high!r} must be > 0")
        _check_choice("LossConfig.aggregation", self.aggregation, _AGGREGATIONS)
        _check_choice("LossConfig.correction", self.correction, _CORRECTIONS)
        _check_choice("LossConfig.correction_level", self.correction_level, _LEVELS)
        if self.norm_length is not None and self.norm_length < 1:
            raise ValueError(f"LossConfig.norm_length={self.norm_length!r} must be >= 1 or None")
        if self.kl_coef < 0:
            raise ValueError(f"LossConfig.kl_coef={self.kl_coef!r} must be >= 0")
        if not self.correction_cap >= 1.0:
            raise ValueError(f"LossConfig.correction_cap={self.correction_cap!r} must be >= 1")
        c = self.clip_ratio_c
        if c is not None and (isinstance(c, bool) or not isinstance(c, int | float) or not c > 1):
            raise ValueError(
                f"LossConfig.clip_ratio_c={c!r} must be a number > 1 (the dual-clip bound) or None"
            )


@dataclass(frozen=True, slots=True)
class LossOutput:
    """The scalar loss and what it was made of (detached)."""

    loss: torch.Tensor
    """Scalar to call ``backward()`` on."""
    clip_fraction: float
    """Fraction of real tokens where the clipped objective was the one taken."""
    kl: float
    """Mean k3 KL(policy ‖ reference) over real tokens (0 without a reference)."""
    correction_weights: torch.Tensor
    """``(B, T)`` off-policy weights applied (ones without correction)."""
    dual_clip_fraction: float = 0.0
    """Fraction of real tokens where the dual-clip bound ``clip_ratio_c · A`` was the one taken
    (veRL's ``pg_clipfrac_lower``; 0 without ``clip_ratio_c``)."""


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages: each reward minus its group's mean (divided by its std).

    ``rewards`` is ``(num_groups * group_size,)`` with each group's samples consecutive. The std
    is the unbiased one (as in DeepSeekMath's GRPO); a group with equal rewards gets zeros.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(
            f"group_size={group_size!r} must be an int >= 2 (one sample has no baseline)"
        )
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
            f"got shape {tuple(rewards.shape)}"
        )
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.flatten()


def correction_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
) -> torch.Tensor:
    """Off-policy weights ``(B, T)`` for the trainer/generator ratio (see module docstring)."""
    mask = mask.bool()
    if config.correction == "none":
        return mask.to(old_logprobs.dtype)
    log_w = (old_logprobs - rollout_logprobs).masked_fill(~mask, 0.0)
    if config.correction_level == "sequence":
        log_w = log_w.sum(dim=1, keepdim=True).expand_as(log_w)
    w = log_w.exp()
    if config.correction == "tis":
        w = w.clamp(max=config.correction_cap)
    else:
        w = w * (w <= config.correction_cap)
    return w.masked_fill(~mask, 0.0)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, config: LossConfig) -> torch.Tensor:
    """Reduce a ``(B, T)`` per-token loss to a scalar with ``config.aggregation``.

    The sequence means divide by ``B``: a sequence with no real token counts as a zero (as in
    TRL), where veRL leaves it out of the mean.
    """
    mask = mask.bool()
    maskf = mask.to(per_token.dtype)
    # masked_fill, not a product: a NaN or inf under the mask (a host's padding) stays out.
    summed_B = per_token.masked_fill(~mask, 0.0).sum(dim=1)
    if config.aggregation == "token_mean":
        return summed_B.sum() / maskf.sum().clamp(min=1.0)
    if config.aggregation == "seq_mean_token_mean":
        return (summed_B / maskf.sum(dim=1).clamp(min=1.0)).mean()
    norm = config.norm_length if config.norm_length is not None else per_token.shape[1]
    return (summed_B / norm).mean()


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    *,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> LossOutput:
    """Clipped policy-gradient loss with optional off-policy correction and KL penalty.

    Per token: ``-w · min(r·A, clip(r, 1 - eps_low, 1 + eps_high)·A) + kl_coef · k3``, with
    ``r = exp(logprobs - old_logprobs)``, ``A`` the sequence's advantage (``(B,)``) or the
    token's (``(B, T)``), ``w`` the off-policy weight (needs ``rollout_logprobs`` unless
    ``correction="none"``), then aggregated. With ``clip_ratio_c`` the objective of a token
    with ``A < 0`` is raised to at least ``clip_ratio_c · A`` (dual clip) before ``w``.
    """
    shape = tuple(logprobs.shape)
    if logprobs.ndim != 2:
        raise ValueError(f"logprobs must be (B, T), got shape {shape}")
    for name, t in (
        ("old_logprobs", old_logprobs),
        ("mask", mask),
        ("rollout_logprobs", rollout_logprobs),
        ("ref_logprobs", ref_logprobs),
    ):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(
                f"{name} must have the shape of logprobs {shape}, got {tuple(t.shape)}"
            )
    if tuple(advantages.shape) not in (shape[:1], shape):
        raise ValueError(
            f"advantages must be (B,) = ({shape[0]},) (one per sequence) or (B, T) = {shape} "
            f"(one per token), got {tuple(advantages.shape)}"
        )
    if config.correction != "none" and rollout_logprobs is None:
        raise ValueError(f"LossConfig.correction={config.correction!r} needs rollout_logprobs")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"LossConfig.kl_coef={config.kl_coef} needs ref_logprobs")
    mask = mask.bool()

    ratio = torch.exp(logprobs - old_logprobs)
    adv = (advantages[:, None] if advantages.ndim == 1 else advantages).to(logprobs.dtype)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - config.eps_low, 1.0 + config.eps_high) * adv
    objective = torch.minimum(unclipped, clipped)
    dual_clip_fraction = 0.0
    if config.clip_ratio_c is not None:
        # Dual clip (Ye et al., 2020): with A < 0, min(r·A, clip(r)·A) falls without bound as
        # r grows; a token far off-policy would dominate the batch. Its bound is a constant, so
        # such a token gets no gradient.
        floor = config.clip_ratio_c * adv
        dual = (adv < 0) & (objective < floor)
        objective = torch.where(dual, floor, objective)
        dual_clip_fraction = float(_masked_mean(dual.to(logprobs.dtype), mask))
    if rollout_logprobs is not None:
        weights = correction_weights(old_logprobs.detach(), rollout_logprobs, mask, config)
    else:
        weights = mask.to(logprobs.dtype)
    per_token = -objective * weights

    kl_value = 0.0
    if ref_logprobs is not None:
        kl_t = _k3(logprobs, ref_logprobs)
        kl_value = float(_masked_mean(kl_t.detach(), mask))
        if config.kl_coef > 0:
            per_token = per_token + config.kl_coef * kl_t

    clip_fraction = float(_masked_mean((clipped < unclipped).to(logprobs.dtype).detach(), mask))
    return LossOutput(
        loss=aggregate(per_token, mask, config),
        clip_fraction=clip_fraction,
        kl=kl_value,
        correction_weights=weights.detach(),
        dual_clip_fraction=dual_clip_fraction,
    )


def _k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    # Schulman's k3 estimator of KL(policy ‖ ref) from samples of the policy: unbiased, >= 0.
    log_r = ref_logprobs - logprobs
    return torch.exp(log_r) - log_r - 1.0


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    maskf = mask.to(values.dtype)
    return (values * maskf).sum() / maskf.sum().clamp(min=1.0)


def _check_choice(field: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{field}={value!r} is not one of {', '.join(allowed)}")
