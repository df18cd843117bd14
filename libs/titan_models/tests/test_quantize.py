"""quantize_modules: FP8 / MXFP8 module swap on the model zoo (meta build, then trained)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import titan_models
from titan_models import Float8Recipe, quantize_modules
from titan_models.components import Float8GroupedExperts, Float8Linear


def _meta(family: str, **overrides):
    cls, cfg = titan_models.get_model(family, "debug", vocab_size=256, **overrides)
    with torch.device("meta"):
        return cls(cfg)


def test_swap_keeps_parameters_fqns_and_leaves_gates_and_excluded_modules():
    model = _meta("qwen3_moe")
    before = dict(model.named_parameters())
    r = Float8Recipe("mxfp8")
    swapped = quantize_modules(model, linear=r, experts=r, exclude=("output",))
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[n] is p for n, p in before.items())  # the same Parameter objects
    assert type(model.output) is nn.Linear
    gates = [f for f, m in model.named_modules() if f.endswith("router.gate")]
    assert gates and all(type(model.get_submodule(f)) is nn.Linear for f in gates)
    assert all(f not in swapped for f in gates)
    experts = [f for f, m in model.named_modules() if isinstance(m, Float8GroupedExperts)]
    assert experts and all(swapped[f] == "mxfp8" for f in experts)
    assert isinstance(model.layers["0"].attention.wq, Float8Linear)
    for f in experts:  # MX weight-gradient blocks must not straddle two experts
        moe = model.get_submodule(f.rpartition(".")[0])
        assert moe.config.permute.alignment % 32 == 0
        assert moe.dispatcher.config.alignment % 32 == 0


def test_bad_filters_and_untileable_dims_fail_before_any_swap():
    model = _meta("llama3")
    r = Float8Recipe("fp8_rowwise")
    with pytest.raises(ValueError, match=r"exclude glob 'layers\.\*\.wq'"):
        quantize_modules(model, linear=r, exclude=("layers.*.wq",))  # one segment per '*'
    with pytest.raises(ValueError, match="include glob 'head'"):
        quantize_modules(model, linear=r, include=("head",))
    assert not any(isinstance(m, Float8Linear) for m in model.modules())
    odd = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 48))
    with pytest.raises(ValueError, match="out_features=48, not a multiple of 32"):
        quantize_modules(odd, linear=Float8Recipe("mxfp8"))
    assert quantize_modules(odd, linear=Float8Recipe("mxfp8"), exclude=("1",)) == {"0": "mxfp8"}
    with pytest.raises(ValueError, match="nothing is quantised"):
        quantize_modules(model, exclude=("output",))


def test_linear_under_bf16_autocast_computes_in_bf16_outside_it():
    """Output in autocast's dtype; each element within the quantisation bound of the bf16
    linear: e4m3 rounds x and w by <= 2^-4 relatively each (the subnormal term is below 2^-10
    of the scale), bf16 operands and outputs add a few 2^-8, so |y - ref| <= 0.15 (|x| @ |w|.T)
    + 0.02."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=True)
    q = Float8Linear(lin, Float8Recipe("fp8_tensorwise"))
    x = torch.randn(4, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = q(x)
        ref = lin(x)
    assert y.dtype == torch.bfloat16 == ref.dtype
    bound = 0.15 * (x.detach().abs() @ lin.weight.detach().abs().T) + 0.02
    assert ((y.float() - ref.float()).abs() <= bound).all()
    assert not torch.equal(y, ref)  # it really ran in fp8
    y.float().sum().backward()
    assert x.grad is not None and lin.weight.grad is not None and lin.bias.grad is not None


def test_moe_model_trains_with_quantised_linears_and_experts():
    mode = "mxfp8"
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (4, 33))
    losses = {}
    for q in (None, mode):
        model = _meta("qwen3_moe")
        if q is not None:
            r = Float8Recipe(q, grad_dtype="e5m2")
            quantize_modules(model, linear=r, experts=r, exclude=("output",))
        model.init_weights(device="cpu", seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(2):
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses[q] = loss.item()
    assert abs(losses[mode] - losses[None]) <= 0.03 * losses[None], losses
    assert losses[mode] != losses[None]  # the quantised model really ran in FP8
