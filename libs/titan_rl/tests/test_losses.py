"""Losses against values computed by hand for tiny tensors, one test per mode."""

from __future__ import annotations

import math

import pytest
import torch

from titan_rl import LossConfig, aggregate, correction_weights, group_advantages, grpo_loss

# Two sequences, three token slots; the second sequence has two real tokens.
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])  # 100 sits under the mask


def test_group_advantages_mean_and_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])  # groups of 3: [1,0,0], [1,1,1]
    adv = group_advantages(rewards, 3, normalize_std=False)
    assert torch.allclose(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]))
    adv = group_advantages(rewards, 3, eps=0.0 + 1e-12)
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # unbiased std of [1, 0, 0]
    expected = torch.tensor([(2 / 3) / std, -(1 / 3) / std, -(1 / 3) / std, 0.0, 0.0, 0.0])
    assert torch.allclose(adv, expected, atol=1e-6)


@pytest.mark.parametrize("group_size", [1, 0, True, 2.0])
def test_group_size_below_two_is_refused(group_size):
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(4), group_size)


def test_rewards_not_a_multiple_of_group_size_is_refused():
    with pytest.raises(ValueError, match="multiple of group_size=3"):
        group_advantages(torch.zeros(4), 3)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"eps_low": 0.0}, "eps_low"),
        ({"eps_low": 1.0}, "eps_low"),
        ({"eps_high": -0.1}, "eps_high"),
        ({"aggregation": "mean"}, "aggregation"),
        ({"correction": "is"}, "correction"),
        ({"correction_level": "batch"}, "correction_level"),
        ({"correction_cap": 0.5}, "correction_cap"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"norm_length": 0}, "norm_length"),
        ({"clip_ratio_c": 1.0}, "clip_ratio_c"),
        ({"clip_ratio_c": 0.5}, "clip_ratio_c"),
        ({"clip_ratio_c": float("nan")}, "clip_ratio_c"),
        ({"clip_ratio_c": True}, "clip_ratio_c"),
        ({"clip_ratio_c": "3"}, "clip_ratio_c"),
    ],
)
def test_bad_loss_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"LossConfig.{field}="):
        LossConfig(**kwargs)


def test_aggregation_token_mean():
    # (1 + 2 + 3 + 4 + 5) / 5 tokens
    assert aggregate(PER_TOKEN, MASK, LossConfig(aggregation="token_mean")).item() == 3.0


def test_aggregation_seq_mean_token_mean():
    # mean(6 / 3, 9 / 2) = mean(2, 4.5)
    out = aggregate(PER_TOKEN, MASK, LossConfig(aggregation="seq_mean_token_mean"))
    assert out.item() == pytest.approx(3.25)


def test_aggregation_dr_grpo_divides_by_a_constant():
    cfg = LossConfig(aggregation="seq_mean_token_sum_norm")
    assert aggregate(PER_TOKEN, MASK, cfg).item() == pytest.approx((6 / 3 + 9 / 3) / 2)
    cfg = LossConfig(aggregation="seq_mean_token_sum_norm", norm_length=10)
    assert aggregate(PER_TOKEN, MASK, cfg).item() == pytest.approx((6 / 10 + 9 / 10) / 2)


def test_clipped_objective_by_hand():
    # Advantage +1 for row 0, -1 for row 1; ratios chosen on both sides of the clip range.
    ratio = torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.5, 1.0]])
    old = torch.zeros(2, 3)
    new = ratio.log().requires_grad_()
    cfg = LossConfig(eps_low=0.2, eps_high=0.3)
    out = grpo_loss(new, old, torch.tensor([1.0, -1.0]), MASK, cfg)
    # A=+1: min(r, clip(r)) = [1.3, 0.5, 1.0]; A=-1: min(-r, -clip(r)) = [-1.5, -0.8, (masked)]
    per_token = -torch.tensor([[1.3, 0.5, 1.0], [-1.5, -0.8, 0.0]])
    assert out.loss.item() == pytest.approx(float(per_token[MASK].mean()), abs=1e-6)
    # Clipped objective taken at (0,0) [1.3 < 1.5] and (1,1) [-0.8 < -0.5]: 2 of 5 tokens.
    assert out.clip_fraction == pytest.approx(2 / 5)
    out.loss.backward()
    # Gradient flows only where the unclipped term is taken: d(-r·A)/d(log r) = -r·A / 5.
    expected = torch.tensor([[0.0, -0.5 / 5, -1.0 / 5], [1.5 / 5, 0.0, 0.0]])
    assert torch.allclose(new.grad, expected, atol=1e-6)


def _rollout_logprobs() -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.zeros(2, 3)
    # Token weights w = exp(old - rollout) = [[0.5, 3, 1], [2, 1.5, (masked)]]
    w = torch.tensor([[0.5, 3.0, 1.0], [2.0, 1.5, 7.0]])
    return old, -w.log()


def test_token_level_tis_truncates():
    old, rollout = _rollout_logprobs()
    cfg = LossConfig(correction="tis", correction_level="token", correction_cap=2.0)
    w = correction_weights(old, rollout, MASK, cfg)
    assert torch.allclose(w, torch.tensor([[0.5, 2.0, 1.0], [2.0, 1.5, 0.0]]))


def test_token_level_mis_masks():
    old, rollout = _rollout_logprobs()
    cfg = LossConfig(correction="mis", correction_level="token", correction_cap=2.0)
    w = correction_weights(old, rollout, MASK, cfg)
    assert torch.allclose(w, torch.tensor([[0.5, 0.0, 1.0], [2.0, 1.5, 0.0]]))


def test_sequence_level_tis_and_mis():
    old, rollout = _rollout_logprobs()
    # Sequence weights: 0.5 * 3 * 1 = 1.5 and 2 * 1.5 = 3 (the masked 7 is ignored).
    tis = LossConfig(correction="tis", correction_level="sequence", correction_cap=2.0)
    w = correction_weights(old, rollout, MASK, tis)
    assert torch.allclose(w, torch.tensor([[1.5, 1.5, 1.5], [2.0, 2.0, 0.0]]))
    mis = LossConfig(correction="mis", correction_level="sequence", correction_cap=2.0)
    w = correction_weights(old, rollout, MASK, mis)
    assert torch.allclose(w, torch.tensor([[1.5, 1.5, 1.5], [0.0, 0.0, 0.0]]))


def test_correction_weights_scale_the_loss():
    old, rollout = _rollout_logprobs()
    new = old.clone().requires_grad_()  # ratio 1 everywhere: per-token objective = A
    cfg = LossConfig(correction="tis", correction_cap=2.0)
    out = grpo_loss(new, old, torch.tensor([1.0, 2.0]), MASK, cfg, rollout_logprobs=rollout)
    # -(1*[0.5 + 2 + 1] + 2*[2 + 1.5]) / 5
    assert out.loss.item() == pytest.approx(-(3.5 + 7.0) / 5)


def test_kl_penalty_is_k3_by_hand():
    new = torch.zeros(2, 3)
    ref = torch.full((2, 3), math.log(2.0))  # log r = log 2: k3 = 2 - log 2 - 1
    cfg = LossConfig(kl_coef=0.5)
    out = grpo_loss(new, new, torch.zeros(2), MASK, cfg, ref_logprobs=ref)
    k3 = 2.0 - math.log(2.0) - 1.0
    assert out.kl == pytest.approx(k3)
    assert out.loss.item() == pytest.approx(0.5 * k3)


def test_missing_inputs_and_bad_shapes_are_refused():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="needs rollout_logprobs"):
        grpo_loss(lp, lp, torch.zeros(2), MASK, LossConfig(correction="tis"))
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        grpo_loss(lp, lp, torch.zeros(2), MASK, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="old_logprobs must have the shape"):
        grpo_loss(lp, torch.zeros(2, 4), torch.zeros(2), MASK, LossConfig())
    with pytest.raises(ValueError, match="advantages must be"):
        grpo_loss(lp, lp, torch.zeros(3), MASK, LossConfig())


@pytest.mark.parametrize("shape", [(3,), (2, 1), (2, 4), (3, 3), (2, 3, 1), ()])
def test_advantages_of_another_shape_are_refused_naming_both_layouts(shape):
    # Guards against broadcasting: (2, 1) or (2, 3, 1) would silently broadcast in the product.
    lp = torch.zeros(2, 3)
    with pytest.raises(
        ValueError, match=r"advantages must be \(B,\) = \(2,\) .* \(B, T\) = \(2, 3\)"
    ):
        grpo_loss(lp, lp, torch.zeros(shape), MASK, LossConfig())


def test_per_token_advantages_by_hand():
    # Ratio 1.5 everywhere; A per token, signs mixed. eps 0.2 / 0.3: clip(1.5) = 1.3.
    new = torch.full((2, 3), math.log(1.5)).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 2.0], [-2.0, 0.5, 9.0]])  # 9.0 sits under the mask
    out = grpo_loss(new, torch.zeros(2, 3), adv, MASK, LossConfig(eps_low=0.2, eps_high=0.3))
    # A > 0: min(1.5 A, 1.3 A) = 1.3 A (clipped); A < 0: min(-1.5|A|, -1.3|A|) = 1.5 A
    objective = torch.tensor([[1.3, -1.5, 2.6], [-3.0, 0.65, 0.0]])
    assert out.loss.item() == pytest.approx(float(-objective[MASK].mean()), abs=1e-6)
    assert out.clip_fraction == pytest.approx(3 / 5)
    # (B,) advantages are the (B, T) case with each row's value repeated.
    per_seq = grpo_loss(new, torch.zeros(2, 3), torch.tensor([1.0, -2.0]), MASK, LossConfig())
    per_tok = grpo_loss(
        new, torch.zeros(2, 3), torch.tensor([[1.0] * 3, [-2.0] * 3]), MASK, LossConfig()
    )
    assert torch.equal(per_seq.loss, per_tok.loss)


def test_dual_clip_bounds_the_loss_of_a_negative_advantage_by_hand():
    # Ratios 10 and 2 with A = -1 and ratio 10 with A = +1; c = 3. Without the dual clip
    # min(r·A, clip(r)·A) = -10 and -2 (loss 10 and 2); with it max(-10, -3) = -3 and
    # max(-2, -3) = -2. A > 0 is never dual-clipped (clip(10)·1 = 1.28).
    new = torch.tensor([[math.log(10.0), math.log(2.0), math.log(10.0)]]).requires_grad_()
    old, mask = torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    plain = grpo_loss(new, old, adv, mask, LossConfig())
    assert plain.loss.item() == pytest.approx((10 + 2 - 1.28) / 3, abs=1e-6)
    assert plain.dual_clip_fraction == 0.0
    out = grpo_loss(new, old, adv, mask, LossConfig(clip_ratio_c=3.0))
    assert out.loss.item() == pytest.approx((3 + 2 - 1.28) / 3, abs=1e-6)
    assert out.dual_clip_fraction == pytest.approx(1 / 3)
    out.loss.backward()
    # The bound is a constant: no gradient there; the ratio-2 token keeps -r·A / 3 = 2/3.
    assert torch.allclose(new.grad, torch.tensor([[0.0, 2 / 3, 0.0]]), atol=1e-6)


def test_nan_under_the_mask_stays_out_of_the_loss():
    # A host's padded positions may hold anything; the aggregate must not see them.
    lp = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, float("nan")]])
    out = grpo_loss(lp, torch.zeros(2, 3), torch.tensor([1.0, 1.0]), MASK, LossConfig())
    assert math.isfinite(out.loss.item())


def test_the_named_losses_are_grpo_loss_with_their_aggregation():
    import titan_rl

    torch.manual_seed(0)
    lp, old = torch.randn(4, 6), torch.randn(4, 6)
    adv, mask = torch.randn(4), torch.rand(4, 6) > 0.3
    seq = LossConfig(aggregation="seq_mean_token_mean")
    assert titan_rl.loss_names()[:3] == ["dapo", "dr_grpo", "grpo"]
    dapo = titan_rl.get_loss("dapo").fn(lp, old, adv, mask, seq).loss
    assert torch.equal(dapo, grpo_loss(lp, old, adv, mask, LossConfig()).loss)
    dr = titan_rl.get_loss("dr_grpo")
    want = grpo_loss(lp, old, adv, mask, LossConfig(aggregation="seq_mean_token_sum_norm")).loss
    assert torch.equal(dr.fn(lp, old, adv, mask, seq).loss, want)
    assert dr.normalize_std is False and titan_rl.get_loss("grpo").normalize_std is None
    with pytest.raises(ValueError, match="must be an identifier"):
        titan_rl.register_loss("my loss", grpo_loss)
