"""Our models reproduce transformers' logits and gradients, and round-trip through HF files."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import titan_models
from titan_models.hf_adapter import DENSE_KEY_MAP

CASES = [
    # (family, HF config overrides): Llama with GQA + llama3 rope scaling + untied head;
    # Qwen3 with QK-norm, tied and untied.
    pytest.param("llama3", {}, id="llama3-gqa-rope_scaling-untied"),
    pytest.param("qwen3", {"tie_word_embeddings": True}, id="qwen3-qknorm-tied"),
    pytest.param("qwen3", {"tie_word_embeddings": False}, id="qwen3-qknorm-untied"),
]


def _hf_name(fqn: str) -> str:
    for ours, hf in DENSE_KEY_MAP:
        parts = ours.split("{}")
        if len(parts) == 1 and fqn == ours:
            return hf
        if len(parts) == 2 and fqn.startswith(parts[0]) and fqn.endswith(parts[1]):
            index = fqn[len(parts[0]) : len(fqn) - len(parts[1])]
            if index.isdigit():
                return hf.format(index)
    raise KeyError(fqn)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(("family", "overrides"), CASES)
def test_logits_and_gradients_match_transformers(
    hf_checkpoint, backward_both, family, overrides, attn
):
    hf, folder = hf_checkpoint(family, attn=attn, **overrides)
    ours = titan_models.from_hf(folder)
    assert type(ours).__name__ == {"llama3": "Llama3", "qwen3": "Qwen3"}[family]
    backward_both(ours, hf)
    hf_params = dict(hf.named_parameters())
    checked = 0
    for fqn, param in ours.named_parameters():
        hf_grad = hf_params[_hf_name(fqn)].grad
        diff = (param.grad - hf_grad).abs().max().item()
        assert diff <= 1e-4, f"{fqn}: gradient differs by {diff}"
        checked += 1
    assert checked == len(hf_params)


WINDOW_CASES = [
    # Qwen3 with layer 1 of 2 sliding over 8 tokens (seq 64); Mistral: every layer over 8.
    pytest.param(
        "qwen3",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
        (8, (1,)),
        id="qwen3-window8-layer1",
    ),
    pytest.param("mistral", {"sliding_window": 8}, (8, None), id="mistral-window8"),
]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(("family", "overrides", "windows"), WINDOW_CASES)
def test_sliding_window_models_match_transformers(
    hf_checkpoint, backward_both, family, overrides, windows, attn
):
    hf, folder = hf_checkpoint(family, attn=attn, **overrides)
    ours = titan_models.from_hf(folder)
    assert (ours.config.sliding_window, ours.config.sliding_window_layers) == windows
    backward_both(ours, hf)
    hf_params = dict(hf.named_parameters())
    for fqn, param in ours.named_parameters():
        diff = (param.grad - hf_params[_hf_name(fqn)].grad).abs().max().item()
        assert diff <= 1e-4, f"{fqn}: gradient differs by {diff}"


@pytest.mark.parametrize(("family", "overrides", "windows"), WINDOW_CASES)
def test_sliding_window_models_round_trip_through_hf_files(
    token_batch, hf_checkpoint, tmp_path, family, overrides, windows
):
    transformers = pytest.importorskip("transformers")
    hf, folder = hf_checkpoint(family, **overrides)
    out = titan_models.to_hf(titan_models.from_hf(folder), tmp_path / "exported")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(reloaded) is type(hf)
    assert titan_models.from_hf(out).config.sliding_window_layers == windows[1]
    tokens, _ = token_batch(hf.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=tokens).logits, hf(input_ids=tokens).logits)


@pytest.mark.parametrize(("family", "overrides"), CASES)
def test_to_hf_then_from_pretrained_gives_the_same_logits(
    token_batch, hf_checkpoint, tmp_path, family, overrides
):
    transformers = pytest.importorskip("transformers")
    hf, folder = hf_checkpoint(family, **overrides)
    ours = titan_models.from_hf(folder)
    out = titan_models.to_hf(ours, tmp_path / "exported", max_shard_size="40KB")

    files = sorted(p.name for p in out.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert ("lm_head.weight" in index["weight_map"]) == (not ours.config.tie_embeddings)

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.config.tie_word_embeddings == ours.config.tie_embeddings
    tokens, _ = token_batch(ours.config.vocab_size)
    with torch.no_grad():
        # Same weights, same HF code: bit-identical logits.
        assert torch.equal(reloaded(input_ids=tokens).logits, hf(input_ids=tokens).logits)
    again = titan_models.from_hf(out)
    for (name, a), (_, b) in zip(
        ours.state_dict().items(), again.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_sharded_hf_checkpoint_loads(token_batch, hf_checkpoint):
    hf, folder = hf_checkpoint("llama3", shard="30KB")
    assert (folder / "model.safetensors.index.json").is_file()
    ours = titan_models.from_hf(folder)
    tokens, _ = token_batch(hf.config.vocab_size)
    with torch.no_grad():
        assert (ours(tokens) - hf(input_ids=tokens).logits).abs().max().item() <= 1e-4


def test_from_hf_converts_dtype_and_places_on_device(hf_checkpoint):
    _, folder = hf_checkpoint("qwen3", tie_word_embeddings=True)
    ours = titan_models.from_hf(folder, dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    assert ours.output.weight is ours.tok_embeddings.weight  # still tied after loading


def test_bf16_model_tracks_transformers_bf16(token_batch, hf_checkpoint):
    hf, folder = hf_checkpoint("qwen3", tie_word_embeddings=False)
    ours = titan_models.from_hf(folder, dtype=torch.bfloat16)
    hf = hf.to(torch.bfloat16)
    tokens, _ = token_batch(hf.config.vocab_size)
    with torch.no_grad():
        a, b = ours(tokens).float(), hf(input_ids=tokens).logits.float()
    # bf16 rounds each op; the kernels differ slightly (fused norm / rotary), so compare the
    # distributions loosely rather than to the fp32 tolerance.
    kl = F.kl_div(F.log_softmax(a, -1), F.log_softmax(b, -1), log_target=True, reduction="none")
    assert kl.sum(-1).mean().item() < 1e-3
