"""LoRA adapters: parameter counts, initialisation on meta, the adapted forward, merging."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import titan_models
from dist_moe import GroupedExperts
from titan_models import LoRAGroupedExperts, LoRALinear, apply_lora, merge_lora

ATTENTION = ["layers.*.attention.w*"]
DENSE = [*ATTENTION, "layers.*.feed_forward.w*"]
MOE = [*ATTENTION, "layers.*.feed_forward.experts"]


def _model(family: str, *, meta: bool = False, seed: int = 0) -> nn.Module:
    cls, config = titan_models.get_model(family, "debug", attention_backend="sdpa")
    with torch.device("meta"):
        model = cls(config)
    return model if meta else model.init_weights(device="cpu", seed=seed)


def _trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _formula(model: nn.Module, rank: int) -> int:
    """r·(in + out) per adapted linear, E·r·(in + out) per adapted expert projection."""
    total = 0
    for m in model.modules():
        if isinstance(m, LoRALinear):
            total += rank * (m.in_features + m.out_features)
        elif isinstance(m, LoRAGroupedExperts):
            total += 3 * m.num_experts * rank * (m.dim + m.hidden_dim)
    return total


@pytest.mark.parametrize(
    ("family", "targets", "adapted"), [("llama3", DENSE, 28), ("qwen3_moe", MOE, 10)]
)
def test_trainable_parameters_are_exactly_the_adapters(family, targets, adapted):
    model = _model(family)
    rank = 4
    swapped = apply_lora(model, rank=rank, alpha=8.0, targets=targets)
    assert len(swapped) == adapted  # layers x (4 attention + 3 feed-forward, or 1 experts)
    assert _trainable(model) == _formula(model, rank) > 0
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(titan_models.is_lora_param(n) for n in trainable)
    if family == "qwen3_moe":  # 8 experts, dim 128, hidden 64: 3 * 8 * 4 * 192 per layer
        experts = model.get_submodule("layers.0.feed_forward.experts")
        assert experts.lora_a_gate.shape == (8, rank, 128)
        assert experts.lora_b_down.shape == (8, 128, rank)


@pytest.mark.parametrize(("family", "targets"), [("llama3", DENSE), ("qwen3_moe", MOE)])
def test_adapters_built_on_meta_start_as_on_a_materialised_model(family, targets):
    eager = _model(family, seed=3)
    apply_lora(eager, rank=4, alpha=8.0, targets=targets, seed=11)
    meta = _model(family, meta=True)
    apply_lora(meta, rank=4, alpha=8.0, targets=targets, seed=11)
    meta.init_weights(device="cpu", seed=3)
    got, want = dict(meta.named_parameters()), dict(eager.named_parameters())
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
        assert got[name].requires_grad == value.requires_grad, name
    # The adapters depend on their own seed, not on the base's.
    other = _model(family, seed=5)
    apply_lora(other, rank=4, alpha=8.0, targets=targets, seed=11)
    a = "layers.1.attention.wq.lora_a"
    assert torch.equal(other.get_parameter(a), eager.get_parameter(a))
    assert not torch.equal(other.get_parameter(a), _lora_a(family, seed=12))
    fan_in = eager.get_submodule("layers.1.attention.wq").in_features
    assert eager.get_parameter(a).std().item() == pytest.approx(fan_in**-0.5, rel=0.1)


def _lora_a(family: str, *, seed: int) -> torch.Tensor:
    model = _model(family, meta=True)
    apply_lora(model, rank=4, alpha=8.0, targets=ATTENTION, seed=seed)
    return model.init_weights(device="cpu").get_parameter("layers.1.attention.wq.lora_a")


def _randomise_b(model: nn.Module) -> None:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rpartition(".")[2].startswith("lora_b"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


@pytest.mark.parametrize(("family", "targets"), [("llama3", DENSE), ("qwen3_moe", MOE)])
def test_merge_folds_the_adapters_into_plain_modules_with_the_same_logits(family, targets):
    base = _model(family)
    tokens = torch.arange(64).reshape(2, 32) % 200
    with torch.no_grad():
        base_logits = base(tokens)
    apply_lora(base, rank=4, alpha=16.0, targets=targets)
    with torch.no_grad():  # B starts at zero: the adapted model is its base
        assert torch.equal(base(tokens), base_logits)
    _randomise_b(base)
    with torch.no_grad():
        adapted = base(tokens)
    assert (adapted - base_logits).abs().max() > 1e-3
    merged = merge_lora(base)
    assert len(merged) == (28 if family == "llama3" else 10)
    assert not any(isinstance(m, (LoRALinear, LoRAGroupedExperts)) for m in base.modules())
    assert not any(titan_models.is_lora_param(n) for n, _ in base.named_parameters())
    assert type(base.get_submodule("layers.0.attention.wq")) is nn.Linear
    if family == "qwen3_moe":
        assert type(base.get_submodule("layers.0.feed_forward.experts")) is GroupedExperts
    with torch.no_grad():
        torch.testing.assert_close(base(tokens), adapted, rtol=0, atol=1e-5)


def test_only_the_adapters_receive_gradients():
    model = _model("qwen3_moe")
    apply_lora(model, rank=2, alpha=4.0, targets=MOE, dropout=0.0)
    _randomise_b(model)
    tokens = torch.arange(64).reshape(2, 32) % 200
    model(tokens).float().square().mean().backward()
    for name, p in model.named_parameters():
        if titan_models.is_lora_param(name):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def test_dropout_applies_to_the_adapter_input_in_training_only():
    linear = nn.Linear(16, 8)
    lora = LoRALinear(linear, rank=2, alpha=2.0, dropout=0.5, seed=0)
    with torch.no_grad():
        lora.lora_a.normal_()
        lora.lora_b.normal_()
    x = torch.randn(4, 16)
    lora.eval()
    want = linear(x) + (x @ lora.lora_a.T) @ lora.lora_b.T
    torch.testing.assert_close(lora(x), want)
    lora.train()
    assert not torch.allclose(lora(x), want)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(targets=["layers.*.attention.wz"]), "matches no module"),
        (dict(targets=["layers.*.attention"]), "'layers.0.attention' (Attention)"),
        (dict(targets=["**.experts"], dropout=0.1), "dropout=0.1 on routed experts"),
        (dict(targets=[]), "targets=[] must be a non-empty list"),
        (dict(targets=ATTENTION, rank=0), "rank=0 must be an int >= 1"),
        (dict(targets=ATTENTION, alpha=0.0), "alpha=0.0 must be a finite number > 0"),
        (dict(targets=ATTENTION, dropout=1.0), "dropout=1.0 must be in [0, 1)"),
    ],
)
def test_bad_arguments_are_rejected_before_anything_changes(kwargs, message):
    model = _model("qwen3_moe", meta=True)
    args = dict(rank=4, alpha=8.0) | kwargs
    with pytest.raises(ValueError, match=re.escape(message)):
        apply_lora(model, **args)
    assert all(p.requires_grad for p in model.parameters())
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
