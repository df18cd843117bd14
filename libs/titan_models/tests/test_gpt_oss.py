"""gpt-oss reproduces transformers (logits, gradients) for several schedules, round-trips through
HF files, decodes with its (windowed) cache like the full forward, and refuses what it does not
model (MXFP4 checkpoints, unknown layer types)."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

import titan_models
from titan_models.hf_io import checkpoint_files, named_state
from titan_models.registry import family_of

transformers = pytest.importorskip("transformers")

TOL = 1e-4

CASES = [
    # Published schedule (even layers slide), window 8 over 64 tokens, top-2 of 4 experts.
    pytest.param({}, id="alternating-window8"),
    # Every layer full (no window), MHA, top-1 of 4, YaRN with truncation, no sinks' effect hidden.
    pytest.param(
        {
            "layer_types": ["full_attention", "full_attention"],
            "num_key_value_heads": 4,
            "num_experts_per_tok": 1,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10_000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 32,
                "truncate": True,
            },
        },
        id="full-mha-top1-yarn_truncate",
    ),
    # Every layer sliding over 4 tokens, 3 layers, top-3 of 6 experts, tight clamp.
    pytest.param(
        {
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention"] * 3,
            "sliding_window": 4,
            "num_local_experts": 6,
            "num_experts_per_tok": 3,
            "swiglu_limit": 0.5,
        },
        id="all_sliding-window4-top3-limit0.5",
    ),
]


def _hf_config(**overrides):
    kw = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150_000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
    )
    kw.update(overrides)
    return transformers.GptOssConfig(**kw)


@pytest.fixture
def gpt_oss_checkpoint(tmp_path):
    """``make(**config) -> (hf_model, folder)``: a random tiny gpt-oss with large sinks, random
    biases and norm weights (so none of them can hide), saved as transformers saves it."""

    def make(seed: int = 0, **overrides):
        torch.manual_seed(seed)
        hf = transformers.AutoModelForCausalLM.from_config(
            _hf_config(**overrides), attn_implementation="eager"
        )
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                elif name.endswith(("sinks", "bias")):
                    p.normal_(0, 0.5)
                elif name.endswith(("gate_up_proj", "down_proj")):
                    p.normal_(0, 0.1)
        folder = tmp_path / f"gpt-oss-{seed}-{len(list(tmp_path.iterdir()))}"
        hf.save_pretrained(folder)
        return hf, folder

    return make


def _grads_match(ours, hf, folder) -> None:
    """Every parameter's gradient equals transformers' (through the adapter's layouts)."""
    adapter = family_of(ours).hf_adapter
    hf_config = adapter.adapt_to_checkpoint(
        json.loads((folder / "config.json").read_text()), checkpoint_files(folder)
    )
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    seen = set()
    for fqn, param in ours.named_parameters():
        for ht in adapter.hf_tensors(fqn, param, hf_config):
            grad = hf_grads[ht.key]
            expected = ht.from_hf(grad) if ht.from_hf else grad
            got = param.grad if ht.ours is param else None
            assert got is not None, fqn
            diff = (got - expected.reshape(got.shape)).abs().max().item()
            assert diff <= TOL, f"{fqn}: gradient differs by {diff}"
            seen.add(ht.key)
    assert seen == set(hf_grads)


@pytest.mark.parametrize("overrides", CASES)
def test_logits_and_gradients_match_transformers(gpt_oss_checkpoint, overrides):
    hf, folder = gpt_oss_checkpoint(**overrides)
    ours = titan_models.from_hf(folder).eval()  # eval: no balance loss, as transformers
    assert type(ours).__name__ == "GptOss"
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (2, 64), generator=g)
    labels = torch.randint(0, 256, (2, 64), generator=g)
    hf_logits = hf(input_ids=tokens).logits
    our_logits = ours(tokens)
    assert (our_logits - hf_logits).abs().max().item() <= TOL
    F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(our_logits.flatten(0, 1), labels.flatten()).backward()
    _grads_match(ours, hf, folder)


def test_to_hf_then_from_pretrained_gives_the_same_logits(gpt_oss_checkpoint, tmp_path):
    hf, folder = gpt_oss_checkpoint()
    ours = titan_models.from_hf(folder)
    out = titan_models.to_hf(ours, tmp_path / "exported", max_shard_size="100KB")
    keys = checkpoint_files(out)
    assert keys.keys() == checkpoint_files(folder).keys()  # fused experts written fused
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        # Same weights, same HF code: bit-identical logits.
        assert torch.equal(reloaded(input_ids=tokens).logits, hf(input_ids=tokens).logits)
    again = titan_models.from_hf(out)
    for (name, a), (_, b) in zip(named_state(ours), named_state(again), strict=True):
        assert torch.equal(a, b), name


def test_fresh_model_exports_and_transformers_agrees():
    cls, config = titan_models.get_model(
        "gpt_oss", "debug", vocab_size=256, num_layers=2, sliding_window_layers=(0,)
    )
    with torch.device("meta"):
        model = cls(config)
    model.init_weights(device="cpu", seed=0).eval()
    assert model.layers["0"].attention.window == 16 and model.layers["1"].attention.window is None
    assert model.layers["0"].attention.sinks.weight.abs().sum() > 0  # sinks are learned
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = titan_models.to_hf(model, f"{tmp}/hf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
        tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            diff = (hf(input_ids=tokens).logits - model(tokens)).abs().max().item()
    assert diff <= TOL


def test_cached_decoding_matches_full_forward_for_sliding_and_full_layers():
    cls, config = titan_models.get_model(
        "gpt_oss", "debug", vocab_size=512, num_layers=2, sliding_window=6,
        sliding_window_layers=(0,),
    )  # fmt: skip
    with torch.device("meta"):
        model = cls(config)
    model.init_weights(device="cpu", seed=3).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 13, 9)]
    new_tokens, step_logits = titan_models.greedy_generate(model, prompts, max_new_tokens=8)
    cache = model.new_kv_cache(1, 8)
    assert cache.layers[0].ring == 5 and cache.layers[1].ring is None  # window 6: a ring of 5
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            full = model(torch.tensor(prompt + new_tokens[row].tolist())[None])[0]
            expected = full[len(prompt) - 1 : len(prompt) - 1 + 8]
            diff = (step_logits[row] - expected).abs().max().item()
            assert diff <= 1e-5, f"row {row}: cached decoding differs by {diff}"


def test_mxfp4_checkpoint_is_refused_with_how_to_dequantise(gpt_oss_checkpoint):
    _, folder = gpt_oss_checkpoint()
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization_config.*mxfp4.*dequantize=True"):
        titan_models.from_hf(folder)


def test_unknown_layer_type_is_refused(gpt_oss_checkpoint):
    _, folder = gpt_oss_checkpoint()
    config = json.loads((folder / "config.json").read_text())
    config["layer_types"] = ["chunked_attention", "full_attention"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="layer_types"):
        titan_models.from_hf(folder)


def test_plan_shards_attention_and_sinks_by_heads_and_lists_every_moe():
    _, config = titan_models.get_model("gpt_oss", "debug")
    plan = titan_models.get_plan(config)
    assert "layers.*.attention.sinks" in plan.tensor_parallel.colwise
    assert plan.experts == ("layers.*.feed_forward",)
    assert [u.name for u in plan.pipeline_units][:2] == ["tok_embeddings", "layers.0"]


def test_flops_count_windowed_layers_as_executed():
    _, config = titan_models.get_model("gpt_oss", "120B")
    T = 8192
    per_key = 12 * 64 * 64
    # 18 sliding layers see 128 keys, 18 full layers T keys.
    assert config.attention_flops(T) == per_key * (18 * 128 + 18 * T)
    active = titan_models.matmul_params(config)
    assert 5.0e9 < active < 5.3e9  # the model card's 5.1B active parameters


def test_sinks_survive_selective_activation_checkpointing_that_saves_matmuls():
    # A policy that keeps every matmul's output (as torch_remat's "selective" does) must not
    # see the sinks' product mutated afterwards; gradients equal the plain backward.
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    def save_matmuls(ctx, op, *args, **kwargs):
        if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    sinks = titan_models.components.AttentionSinks(4)
    x = torch.randn(3, 4)

    def loss(x):
        return (torch.softmax(x + sinks(x), dim=-1) * x).sum()

    loss(x).backward()
    plain = sinks.weight.grad.clone()
    sinks.zero_grad()
    contexts = lambda: create_selective_checkpoint_contexts(save_matmuls)  # noqa: E731
    checkpoint(loss, x, use_reentrant=False, context_fn=contexts).backward()
    assert torch.equal(sinks.weight.grad, plain)


BAD_GPT_OSS_FIELDS = [
    ({"attention_bias": False}, r"attention_bias=False is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ({"layer_types": ["sliding_attention"]}, r"layer_types=\['sliding_attention'\]"),
    (
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
        r"rope_type='dynamic' is not supported",
    ),
    ({"num_local_experts": None, "num_experts": None}, r"num_experts is missing"),
]


def test_unsupported_config_fields_and_tensor_dtypes_are_named(gpt_oss_checkpoint, from_hf_error):
    _, folder = gpt_oss_checkpoint()
    for edit, match in BAD_GPT_OSS_FIELDS:
        message = from_hf_error(folder, config=edit)
        assert re.search(match, message), (edit, message)
    # MXFP4 storage without its quantization_config: the blocks' dtype and the missing weight
    # are both named.
    expert = next(k for k in from_hf_error.keys(folder) if k.endswith("experts.gate_up_proj"))

    def mxfp4_blocks(t):
        t[expert + "_blocks"] = t.pop(expert).to(torch.uint8)
        return t

    def uint8_weight(t):
        t[expert] = t[expert].to(torch.uint8)
        return t

    message = from_hf_error(folder, tensors=uint8_weight)
    assert f"{expert}: dtype U8 is not a floating dtype" in message, message
    message = from_hf_error(folder, tensors=mxfp4_blocks)
    assert "missing keys" in message and expert in message, message
    assert f"{expert}_blocks" in message, message
    titan_models.from_hf(folder)  # restored: loads
