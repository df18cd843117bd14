"""HF Qwen3-MoE with its sparse blocks swapped for dist_moe: same logits, same router logits
and aux loss through HF's ``output_router_logits`` (fp32, 1e-5: HF sums the experts of a token
in expert order, dist_moe in top-k order)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dist_moe import HFSparseMoeBlock, moe_from_hf_block, swap_hf_moe_blocks

transformers = pytest.importorskip("transformers")


def _tiny_qwen3_moe(norm_topk_prob: bool) -> nn.Module:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        router_aux_loss_coef=0.01,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # HF initialises the router to zeros: make routing non-trivial
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(std=0.5)
    return model.eval()


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_swapped_model_matches_hf_logits_router_logits_and_aux_loss(norm_topk_prob):
    hf = _tiny_qwen3_moe(norm_topk_prob)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    want = hf(ids, labels=ids, output_router_logits=True)  # installs HF's capture hooks
    ours = copy.deepcopy(hf)
    names = swap_hf_moe_blocks(ours)
    assert names == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(isinstance(ours.get_submodule(n), HFSparseMoeBlock) for n in names)
    got = ours(ids, labels=ids, output_router_logits=True)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-5)
    assert len(got.router_logits) == len(want.router_logits) == 2
    for a, b in zip(got.router_logits, want.router_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=1e-5)
    got.loss.backward()  # gradients reach the swapped router and experts
    block = ours.get_submodule(names[0])
    assert block.router.gate.weight.grad.abs().sum() > 0
    assert block.experts.w_gate.grad.abs().sum() > 0


def test_router_logits_collected_when_hf_hooks_are_installed_after_the_swap():
    hf = _tiny_qwen3_moe(True)
    ours = copy.deepcopy(hf)
    swap_hf_moe_blocks(ours)  # before any forward: HF installs its hooks on first use
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(2))
    got, want = ours(ids, output_router_logits=True), hf(ids, output_router_logits=True)
    assert len(got.router_logits) == 2
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=0, atol=1e-6)


def test_weights_map_to_dist_moe_names():
    block = _tiny_qwen3_moe(True).model.layers[0].mlp
    moe = moe_from_hf_block(block)
    gate_up, i = block.experts.gate_up_proj, 16
    assert torch.equal(moe.router.gate.weight, block.gate.weight)
    assert torch.equal(moe.experts.w_gate, gate_up[:, :i])
    assert torch.equal(moe.experts.w_up, gate_up[:, i:])
    assert torch.equal(moe.experts.w_down, block.experts.down_proj)
    assert sum(p.numel() for p in moe.gate.parameters()) == 0  # the logits tap holds nothing


def test_swap_rejects_what_it_cannot_map():
    with pytest.raises(ValueError, match="SparseMoeBlock"):
        swap_hf_moe_blocks(nn.Sequential(nn.Linear(4, 4)))
    block = _tiny_qwen3_moe(True).model.layers[0].mlp
    block.shared_expert = nn.Linear(32, 32)
    with pytest.raises(ValueError, match="shared_expert"):
        moe_from_hf_block(block)
    with pytest.raises(ValueError, match="gate.weight"):
        moe_from_hf_block(nn.Linear(4, 4))
