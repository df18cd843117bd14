"""flops_per_token agrees with the FLOPs PyTorch counts for a forward + backward."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import titan_models


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_formula_matches_counted_flops(family):
    cls, config = titan_models.get_model(family, "debug", num_layers=2)
    with torch.device("meta"):
        model = cls(config)
    B, S = 2, 128
    tokens = torch.zeros(B, S, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    counted = counter.get_total_flops()
    predicted = titan_models.flops_per_token(config, S) * B * S
    # The counter sees the matmuls and SDPA (without the causal discount, as the formula);
    # it does not see the gradient of the frozen-free embedding gather: equal up to that.
    assert counted == pytest.approx(predicted, rel=1e-3)


def test_llama3_8b_flops_per_token():
    config = titan_models.get_model("llama3", "8B")[1]
    n = titan_models.matmul_params(config)
    assert n == 8_030_261_248 - 128_256 * 4096 - (2 * 32 + 1) * 4096  # minus embedding and norms
    assert titan_models.flops_per_token(config, 8192) == 6 * n + 12 * 32 * 32 * 128 * 8192


def test_seq_len_must_be_positive():
    with pytest.raises(ValueError, match="seq_len"):
        titan_models.flops_per_token(titan_models.get_model("qwen3", "debug")[1], 0)
