"""Shared components against reference formulas and transformers' RoPE tables."""

from __future__ import annotations

import math

import pytest
import torch

from titan_models.components import (
    Llama3RopeScaling,
    RMSNorm,
    RopeConfig,
    RotaryEmbedding,
    YarnRopeScaling,
    apply_rotary,
    rope_frequencies,
)


def _hf_rope(head_dim: int, rope_parameters: dict, max_pos: int = 4096):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=rope_parameters,
    )
    kind = rope_parameters["rope_type"]
    if kind == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[kind](config, "cpu")


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (RopeConfig(theta=10_000.0), {"rope_type": "default", "rope_theta": 10_000.0}),
        (
            RopeConfig(theta=500_000.0, scaling=Llama3RopeScaling(factor=8.0)),
            {
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        (
            RopeConfig(
                theta=10_000.0, scaling=YarnRopeScaling(factor=4.0, original_max_seq_len=1024)
            ),
            {
                "rope_type": "yarn",
                "rope_theta": 10_000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
        ),
        (
            RopeConfig(
                theta=10_000.0,
                scaling=YarnRopeScaling(
                    factor=40.0, original_max_seq_len=4096, mscale=1.0, mscale_all_dim=0.707
                ),
            ),
            {
                "rope_type": "yarn",
                "rope_theta": 10_000.0,
                "factor": 40.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.707,
                "original_max_position_embeddings": 4096,
            },
        ),
    ],
    ids=["plain", "llama3", "yarn", "yarn-deepseek-mscale"],
)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_frequencies_equal_transformers_bit_for_bit(ours, theirs, head_dim):
    inv_freq, scale = rope_frequencies(ours, head_dim)
    ref_freq, ref_scale = _hf_rope(head_dim, theirs)
    assert torch.equal(inv_freq, ref_freq.float())
    assert scale == pytest.approx(ref_scale, rel=1e-12)


def _reference_rotary(x, positions, rope):
    inv_freq, scale = rope_frequencies(rope, x.shape[-1])
    freqs = positions[..., None].double() * inv_freq.double()
    emb = torch.cat([freqs, freqs], -1)[:, :, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * emb.cos() * scale + rotated * emb.sin() * scale


def test_rotary_matches_rotate_half_formula_and_its_gradient():
    rope = RopeConfig(theta=10_000.0, scaling=YarnRopeScaling(factor=4.0, original_max_seq_len=16))
    positions = torch.arange(12).expand(2, 12)
    x = torch.randn(2, 12, 3, 16, dtype=torch.float64, requires_grad=True)
    cos_sin = RotaryEmbedding(rope, 16)(positions, torch.float64)
    ours = apply_rotary(x, cos_sin)
    assert torch.allclose(ours, _reference_rotary(x, positions, rope), atol=1e-6)
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, cos_sin), (x,))


def test_rotary_preserves_norms_and_relative_angles():
    rope = RotaryEmbedding(RopeConfig(theta=10_000.0), 8)
    q, k = torch.randn(1, 1, 1, 8).expand(1, 2, 1, 8), torch.randn(1, 1, 1, 8).expand(1, 2, 1, 8)
    a = rope(torch.tensor([[3, 10]]), torch.float32)
    b = rope(torch.tensor([[13, 20]]), torch.float32)
    qa, ka, qb, kb = apply_rotary(q, a), apply_rotary(k, a), apply_rotary(q, b), apply_rotary(k, b)
    assert torch.allclose(qa.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    # <q_m, k_n> depends on m - n only.
    assert torch.allclose((qa[:, 1] * ka[:, 0]).sum(), (qb[:, 1] * kb[:, 0]).sum(), atol=1e-5)


def test_rmsnorm_matches_formula_and_gradients_in_double():
    norm = RMSNorm(16, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    expected = norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(norm(x), expected, atol=1e-12)
    assert torch.autograd.gradcheck(norm, (x,))


def test_rmsnorm_bf16_keeps_statistics_in_fp32():
    norm = RMSNorm(64, eps=1e-5).to(torch.bfloat16)
    x = (torch.randn(4, 64) * 1e3).to(torch.bfloat16)
    x32 = x.float()
    expected = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert torch.equal(norm(x), expected)


def test_rope_config_validates():
    with pytest.raises(ValueError, match="theta must be > 0"):
        RopeConfig(theta=0.0)
    with pytest.raises(ValueError, match="scaling must be"):
        RopeConfig(theta=1.0, scaling={"rope_type": "llama3"})
    assert math.isclose(
        rope_frequencies(RopeConfig(theta=10_000.0), 4)[0][1].item(), 0.01, rel_tol=1e-6
    )
