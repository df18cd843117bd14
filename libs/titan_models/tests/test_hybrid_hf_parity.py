"""Qwen3.5, Qwen3.5-MoE and Kimi Linear reproduce transformers' logits and gradients (three tiny
configs each: head counts, key/value head widths, conv taps, layer patterns, MoE on/off) and
round-trip through HF files, the published composite Qwen3.5 layout included."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import titan_models
from titan_models.hf_io import named_state
from titan_models.registry import family_of

SEQ = 100  # two chunks of 64, the second padded

CASES = [
    pytest.param("qwen3_5", {}, id="qwen3_5-2k4v-heads-lin-full"),
    pytest.param(
        "qwen3_5",
        {
            "num_hidden_layers": 3,
            "layer_types": ["full_attention", "linear_attention", "linear_attention"],
            "linear_num_key_heads": 4,
            "linear_key_head_dim": 16,
            "linear_conv_kernel_dim": 2,
            "tie_word_embeddings": True,
        },
        id="qwen3_5-4k4v-conv2-full-lin-lin-tied",
    ),
    pytest.param(
        "qwen3_5",
        {
            "linear_num_key_heads": 1,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 8,
            "linear_conv_kernel_dim": 3,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e6,
                "partial_rotary_factor": 0.5,
            },
        },
        id="qwen3_5-1k4v-k16v8-conv3-rope_half",
    ),
    pytest.param("qwen3_5_moe", {}, id="qwen3_5_moe-4experts-top2"),
    pytest.param(
        "qwen3_5_moe",
        {
            "layer_types": ["full_attention", "linear_attention"],
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 4,
            "linear_conv_kernel_dim": 2,
            "num_experts": 8,
            "num_experts_per_tok": 1,
        },
        id="qwen3_5_moe-full-lin-8experts-top1",
    ),
    pytest.param(
        "qwen3_5_moe",
        {
            "num_hidden_layers": 3,
            "layer_types": ["linear_attention", "linear_attention", "full_attention"],
            "linear_num_key_heads": 1,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 8,
            "num_experts_per_tok": 3,
        },
        id="qwen3_5_moe-lin-lin-full-k16v8-top3",
    ),
    pytest.param("kimi_linear", {}, id="kimi_linear-kda-mla-kda-dense_first"),
    pytest.param(
        "kimi_linear",
        {
            "num_hidden_layers": 2,
            "layer_types": ["full_attention", "linear_attention"],
            "mlp_layer_types": ["sparse", "sparse"],
            "q_lora_rank": 32,
            "linear_num_heads": 2,
            "linear_head_dim": 32,
            "linear_conv_kernel_dim": 2,
        },
        id="kimi_linear-mla_qlora-kda2x32-conv2-all_moe",
    ),
    pytest.param(
        "kimi_linear",
        {
            "layer_types": ["linear_attention", "linear_attention", "full_attention"],
            "mlp_layer_types": ["sparse", "dense", "sparse"],
            "num_local_experts": 8,
            "n_group": 2,
            "topk_group": 1,
            "linear_head_dim": 8,
            "linear_conv_kernel_dim": 3,
        },
        id="kimi_linear-kda-kda-mla-sparse_dense_sparse-grouped_routing-conv3",
    ),
]


def _grads_as_weights(hf, tmp_path) -> torch.nn.Module:
    """Our model holding transformers' gradients as its weights: HF saves them under its
    on-disk names (undoing its own fused in-memory layouts) and ``from_hf`` maps them to ours."""
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.grad)
    hf.save_pretrained(tmp_path / "grads")
    return titan_models.from_hf(tmp_path / "grads")


@pytest.mark.parametrize(("family", "overrides"), CASES)
def test_logits_and_gradients_match_transformers(
    hf_checkpoint, assert_logits_match, tmp_path, family, overrides
):
    hf, folder = hf_checkpoint(family, **overrides)
    ours = titan_models.from_hf(folder).eval()  # eval: no balance loss, as transformers
    assert family_of(ours).name == family
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, hf.config.vocab_size, (2, SEQ), generator=g)
    labels = torch.randint(0, hf.config.vocab_size, (2, SEQ), generator=g)
    hf_logits, our_logits = hf(input_ids=tokens).logits, ours(tokens)
    assert_logits_match(our_logits, hf_logits)
    F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(our_logits.flatten(0, 1), labels.flatten()).backward()

    expected = dict(_grads_as_weights(hf, tmp_path).named_parameters())
    checked = 0
    for name, param in ours.named_parameters():
        diff = (param.grad - expected[name]).abs().max().item()
        assert diff <= 1e-4, f"{name}: gradient differs by {diff}"
        checked += 1
    assert checked == len(expected)


@pytest.mark.parametrize(("family", "overrides"), [*CASES[1::3], CASES[8]])
def test_to_hf_then_from_pretrained_gives_the_same_logits(
    hf_checkpoint, tmp_path, family, overrides
):
    transformers = pytest.importorskip("transformers")
    hf, folder = hf_checkpoint(family, **overrides)
    ours = titan_models.from_hf(folder)
    out = titan_models.to_hf(ours, tmp_path / "exported", max_shard_size="60KB")
    assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) > 1

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(reloaded) is type(hf)
    tokens = torch.randint(0, hf.config.vocab_size, (2, SEQ), generator=torch.Generator())
    with torch.no_grad():
        # Same weights, same HF code: bit-identical logits.
        assert torch.equal(reloaded(input_ids=tokens).logits, hf(input_ids=tokens).logits)
    again = titan_models.from_hf(out)
    for (name, a), (_, b) in zip(named_state(ours), named_state(again), strict=True):
        assert torch.equal(a, b), name


def test_published_composite_qwen3_5_checkpoint_loads_its_text_decoder(
    tmp_path, assert_logits_match
):
    """Qwen/Qwen3.5-* on the Hub: ``model_type: qwen3_5`` (vision-language), the text config
    under ``text_config`` and its weights under ``model.language_model.``; the vision tower is
    skipped."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    text = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 16,
        "layer_types": ["linear_attention", "full_attention"],
    }
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "num_heads": 2,
        "intermediate_size": 64,
        "out_hidden_size": 64,
        "patch_size": 8,
        "num_position_embeddings": 16,
    }
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    hf = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    hf.save_pretrained(tmp_path / "vl")
    ours = titan_models.from_hf(tmp_path / "vl")
    assert isinstance(ours, titan_models.Qwen3_5)
    tokens = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_logits_match(ours(tokens), hf(input_ids=tokens).logits)
    # Written back as the text-only type AutoModelForCausalLM builds.
    out = titan_models.to_hf(ours, tmp_path / "text")
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_5_text"
