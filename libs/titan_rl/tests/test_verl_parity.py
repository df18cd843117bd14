"""``grpo_loss`` against veRL 0.9.1's ``vanilla`` policy loss.

The reference below is veRL's formula written out from the definitions of
``compute_policy_loss_vanilla`` and ``agg_loss`` in ``verl/trainer/ppo/core_algos.py`` (0.9.1):
ratio from the log-ratio clamped to [-20, 20]; ``max(-A·r, -A·clip(r))``; for ``A < 0`` the
dual clip ``min(-A·clip_ratio_c, ·)``; rollout weights multiplied in after; then the
``loss_agg_mode``. veRL itself is not installed here (it caps transformers below the locked
version). Covered: per-token advantages, the dual clip at large ratios, every loss_agg_mode
titan has an aggregation for, and log-probs from veRL's left-padded batch layout.
"""

from __future__ import annotations

import pytest
import torch

from titan_rl import LossConfig, grpo_loss, sequence_logprobs

pytestmark = pytest.mark.usefixtures("single_thread")

# veRL's loss_agg_mode -> titan's (aggregation, norm_length); "token-sum" has no titan twin.
# seq-mean-token-sum is Dr. GRPO's sum with a divisor of 1.
AGG_MODES = {
    "token-mean": ("token_mean", None),
    "seq-mean-token-mean": ("seq_mean_token_mean", None),
    "seq-mean-token-sum-norm": ("seq_mean_token_sum_norm", None),
    "seq-mean-token-sum": ("seq_mean_token_sum_norm", 1),
}


def verl_agg_loss(loss_mat, loss_mask, mode, loss_scale_factor=None):
    """veRL's ``agg_loss`` on one data-parallel rank (dp_size 1, batch sizes from the mask)."""
    mask = loss_mask.to(loss_mat.dtype)
    masked = torch.where(loss_mask.bool(), loss_mat, 0.0) * mask  # veRL's masked_sum
    if mode == "token-mean":
        return masked.sum() / mask.sum()
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = masked.sum(-1)
        seq_mask = (mask.sum(-1) > 0).to(mask.dtype)  # fully masked sequences left out
        loss = (seq_losses * seq_mask).sum() / seq_mask.sum()
        if mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_scale_factor if loss_scale_factor is not None else mask.shape[-1])
        return loss
    assert mode == "seq-mean-token-mean", mode
    tokens = mask.sum(-1)
    seq_losses = masked.sum(-1) / (tokens + 1e-8)
    seq_mask = (tokens > 0).to(mask.dtype)
    return (seq_losses * seq_mask).sum() / seq_mask.sum()


def verl_vanilla_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode,
    *,
    clip_ratio_low,
    clip_ratio_high,
    clip_ratio_c,
    rollout_is_weights=None,
):
    """veRL's ``compute_policy_loss_vanilla``: the aggregated loss and ``pg_clipfrac_lower``."""
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped1 = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip_ratio_c
    clipped2 = torch.minimum(loss3, clipped1)
    negative = advantages < 0
    lower = (clipped1 > loss3) & negative
    mask = response_mask.to(log_prob.dtype)
    clipfrac_lower = (lower.to(mask.dtype) * mask).sum() / (mask.sum() + 1e-8)
    pg_losses = torch.where(negative, clipped2, clipped1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return verl_agg_loss(pg_losses, response_mask, loss_agg_mode), clipfrac_lower


def batch(seed: int = 0, B: int = 6, T: int = 7, log_ratio_scale: float = 1.5):
    """Random log-probs, old log-probs up to ``±3·log_ratio_scale`` away (ratios up to
    e^4.5 ≈ 90 by default: the dual clip binds), per-token advantages of both signs, ragged
    lengths (every sequence has a token: veRL drops empty ones from a mean, titan does not)."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    log_ratio = torch.randn(B, T, generator=g, dtype=torch.float64).clamp(-3, 3) * log_ratio_scale
    old = logprobs - log_ratio
    advantages = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return logprobs, old, advantages, mask


@pytest.mark.parametrize("mode", list(AGG_MODES))
@pytest.mark.parametrize("advantage_layout", ["per_token", "per_sequence"])
def test_loss_and_gradient_match_verls_vanilla_policy_loss(mode, advantage_layout):
    logprobs, old, advantages, mask = batch(seed=1)
    if advantage_layout == "per_sequence":
        advantages = advantages[:, 0]
    aggregation, norm_length = AGG_MODES[mode]
    cfg = LossConfig(
        eps_low=0.2,
        eps_high=0.28,
        clip_ratio_c=3.0,
        aggregation=aggregation,
        norm_length=norm_length,
    )
    new = logprobs.clone().requires_grad_()
    out = grpo_loss(new, old, advantages, mask, cfg)
    (grad,) = torch.autograd.grad(out.loss, new)

    ref_new = logprobs.clone().requires_grad_()
    adv_BT = advantages if advantages.ndim == 2 else advantages[:, None].expand_as(logprobs)
    ref, clipfrac_lower = verl_vanilla_policy_loss(
        old,
        ref_new,
        adv_BT,
        mask,
        mode,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
    )
    (ref_grad,) = torch.autograd.grad(ref, ref_new)
    assert abs(out.loss.item() - ref.item()) <= 1e-6, (out.loss.item(), ref.item())
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6)
    assert out.dual_clip_fraction == pytest.approx(clipfrac_lower.item(), abs=1e-6)
    assert out.dual_clip_fraction > 0  # the batch reaches the dual-clip regime


def test_dual_clip_at_large_ratios_is_what_separates_the_two_losses():
    """The reported swap (titan's loss 46.45 against veRL's -0.257): a policy far from the old
    one, ratios e^3..e^6. Without the dual clip titan's loss grows with the ratio on negative
    advantages; with ``clip_ratio_c`` (veRL's default 3.0) it is veRL's to 1e-6."""
    logprobs, _, advantages, mask = batch(seed=2)
    g = torch.Generator().manual_seed(6)
    old = logprobs - (3 + 3 * torch.rand(logprobs.shape, generator=g, dtype=torch.float64))
    kwargs = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}
    ref, _ = verl_vanilla_policy_loss(old, logprobs, advantages, mask, "token-mean", **kwargs)
    plain = grpo_loss(logprobs, old, advantages, mask, LossConfig(eps_low=0.2, eps_high=0.2))
    dual = grpo_loss(
        logprobs, old, advantages, mask, LossConfig(eps_low=0.2, eps_high=0.2, clip_ratio_c=3.0)
    )
    # here: 40.17 without the dual clip against veRL's 0.828
    assert plain.loss.item() > ref.item() + 10.0, (plain.loss.item(), ref.item())
    assert abs(dual.loss.item() - ref.item()) <= 1e-6, (dual.loss.item(), ref.item())
    assert dual.dual_clip_fraction > 0.3


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_correction_weights_apply_after_the_dual_clip_as_in_verl(level):
    logprobs, old, advantages, mask = batch(seed=3)
    g = torch.Generator().manual_seed(4)
    rollout = old + 0.3 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    cfg = LossConfig(clip_ratio_c=3.0, correction="tis", correction_level=level)
    out = grpo_loss(logprobs, old, advantages, mask, cfg, rollout_logprobs=rollout)
    # veRL's token-level TIS weights: exp(old - rollout) truncated at the cap, off the mask 0;
    # sequence level: exp of the summed log-ratio, one weight per sequence.
    log_w = torch.where(mask, old - rollout, 0.0)
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)
    weights = torch.where(mask, log_w.exp().clamp(max=cfg.correction_cap), 0.0)
    ref, _ = verl_vanilla_policy_loss(
        old,
        logprobs,
        advantages,
        mask,
        "token-mean",
        clip_ratio_low=cfg.eps_low,
        clip_ratio_high=cfg.eps_high,
        clip_ratio_c=3.0,
        rollout_is_weights=weights,
    )
    assert abs(out.loss.item() - ref.item()) <= 1e-6, (out.loss.item(), ref.item())


def test_verl_batch_through_titans_logprobs_matches_verls_actor_and_loss():
    """veRL's batch layout end to end: left-padded ``prompts``, right-padded ``responses``,
    ``attention_mask`` over both, per-token advantages. veRL's actor runs the whole row with
    positions ``cumsum(mask) - 1``; titan repacks the rows. Same loss and same gradients on
    every weight (fp64: only rounding differs)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=48,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    ).double()
    g = torch.Generator().manual_seed(5)
    B, P, T = 6, 9, 7
    prompt_lengths = torch.randint(1, P + 1, (B,), generator=g)
    prompt_mask = (torch.arange(P)[None, :] >= (P - prompt_lengths)[:, None]).long()
    prompts = torch.randint(1, 48, (B, P), generator=g) * prompt_mask  # pad id 0
    responses = torch.randint(1, 48, (B, T), generator=g)
    response_lengths = torch.randint(1, T + 1, (B,), generator=g)
    response_mask = (torch.arange(T)[None, :] < response_lengths[:, None]).long()
    responses = responses * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    advantages = torch.randn(B, T, generator=g, dtype=torch.float64)
    temperature = 0.8

    def verl_actor_logprobs():
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        input_ids = torch.cat([prompts, responses], 1)
        logits = model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        logits = logits[:, -T - 1 : -1] / temperature
        return logits.log_softmax(-1).gather(-1, responses[..., None]).squeeze(-1)

    with torch.no_grad():
        lp = verl_actor_logprobs()
    old = lp - torch.randn(B, T, generator=g, dtype=torch.float64).clamp(-3, 3) * 1.5
    loss_kw = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}

    ref, _ = verl_vanilla_policy_loss(
        old, verl_actor_logprobs(), advantages, response_mask, "token-mean", **loss_kw
    )
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    logprobs = sequence_logprobs(
        model,
        prompts,
        responses,
        response_mask,
        prompt_mask=attention_mask[:, :P],
        temperature=temperature,
    )
    cfg = LossConfig(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)
    out = grpo_loss(logprobs, old, advantages, response_mask, cfg)
    out.loss.backward()
    assert out.dual_clip_fraction > 0
    assert abs(out.loss.item() - ref.item()) <= 1e-6, (out.loss.item(), ref.item())
    for p, want in zip(model.parameters(), ref_grads, strict=True):
        torch.testing.assert_close(p.grad, want, rtol=0, atol=1e-9)
