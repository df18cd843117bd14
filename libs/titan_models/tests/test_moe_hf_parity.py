"""Qwen3-MoE and DeepSeek-V3 reproduce transformers' logits and gradients and round-trip
through HF files (per-expert keys on disk, fused experts in transformers' memory)."""

from __future__ import annotations

import json

import pytest
import torch

import titan_models
from titan_models.hf_io import checkpoint_files, named_state
from titan_models.registry import family_of

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10_000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    # mscale != mscale_all_dim: both the cos/sin factor and the softmax scale are exercised.
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}

CASES = [
    pytest.param("qwen3_moe", {}, id="qwen3_moe-norm_topk"),
    pytest.param("qwen3_moe", {"norm_topk_prob": False}, id="qwen3_moe-no_norm_topk"),
    pytest.param("deepseek_v3", {}, id="deepseek_v3-q_lora"),
    pytest.param("deepseek_v3", {"q_lora_rank": None}, id="deepseek_v3-no_q_lora"),
    pytest.param("deepseek_v3", {"rope_parameters": YARN}, id="deepseek_v3-yarn"),
    pytest.param(
        "deepseek_v3",
        {"rope_interleave": False, "q_lora_rank": None},
        id="deepseek_v3-no_interleave",
    ),
]


def _hf_grads(hf) -> dict[str, torch.Tensor]:
    """transformers' gradients under the on-disk key names: fused experts split per expert."""
    grads = {}
    for name, p in hf.named_parameters():
        prefix = name.rsplit(".", 1)[0]
        if name.endswith("experts.gate_up_proj"):
            gate, up = p.grad.chunk(2, dim=1)
            for e in range(p.shape[0]):
                grads[f"{prefix}.{e}.gate_proj.weight"] = gate[e]
                grads[f"{prefix}.{e}.up_proj.weight"] = up[e]
        elif name.endswith("experts.down_proj"):
            for e in range(p.shape[0]):
                grads[f"{prefix}.{e}.down_proj.weight"] = p.grad[e]
        else:
            grads[name] = p.grad
    return grads


@pytest.mark.parametrize(("family", "overrides"), CASES)
def test_logits_and_gradients_match_transformers(hf_checkpoint, backward_both, family, overrides):
    hf, folder = hf_checkpoint(family, **overrides)
    ours = titan_models.from_hf(folder).eval()  # eval: no balance loss, as transformers
    assert family_of(ours).name == family
    backward_both(ours, hf)
    hf_grads = _hf_grads(hf)
    adapter = family_of(ours).hf_adapter
    hf_config = adapter.adapt_to_checkpoint(
        json.loads((folder / "config.json").read_text()), checkpoint_files(folder)
    )
    seen = set()
    for fqn, param in ours.named_parameters():
        expected = torch.zeros_like(param)
        for ht in adapter.hf_tensors(fqn, expected, hf_config):
            grad = hf_grads[ht.key]
            ht.ours.copy_(ht.from_hf(grad) if ht.from_hf else grad)
            seen.add(ht.key)
        diff = (param.grad - expected).abs().max().item()
        assert diff <= 1e-4, f"{fqn}: gradient differs by {diff}"
    assert seen == set(hf_grads)


@pytest.mark.parametrize(("family", "overrides"), CASES[::2])
def test_to_hf_then_from_pretrained_gives_the_same_logits(
    token_batch, hf_checkpoint, tmp_path, family, overrides
):
    transformers = pytest.importorskip("transformers")
    hf, folder = hf_checkpoint(family, **overrides)
    ours = titan_models.from_hf(folder)
    out = titan_models.to_hf(ours, tmp_path / "exported", max_shard_size="100KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in index["weight_map"]

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokens, _ = token_batch(ours.config.vocab_size)
    with torch.no_grad():
        # Same weights, same HF code: bit-identical logits.
        assert torch.equal(reloaded(input_ids=tokens).logits, hf(input_ids=tokens).logits)
    again = titan_models.from_hf(out)
    for (name, a), (_, b) in zip(named_state(ours), named_state(again), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_checkpoint_with_fused_experts_loads_like_the_per_expert_one(
    token_batch, hf_checkpoint, family
):
    hf, per_expert = hf_checkpoint(family)
    _, fused = hf_checkpoint(family, fused=True)
    keys = checkpoint_files(fused)
    assert "model.layers.1.mlp.experts.gate_up_proj" in keys
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" not in keys
    a, b = titan_models.from_hf(per_expert), titan_models.from_hf(fused)
    for (name, x), (_, y) in zip(named_state(a), named_state(b), strict=True):
        assert torch.equal(x, y), name
    tokens, _ = token_batch(hf.config.vocab_size)
    with torch.no_grad():
        assert (b(tokens) - hf(input_ids=tokens).logits).abs().max().item() <= 1e-4
