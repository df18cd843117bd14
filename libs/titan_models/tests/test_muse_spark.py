"""Muse Spark Open reproduces transformers' ``MuseSparkForConditionalGeneration`` on text
(logits and every gradient, fp32) on three tiny configs (sparse/dense MLPs in any order,
sliding and full layers, NoPE every 4th from the last); round-trips through the public layout
(towers included) into transformers; decodes through the KV cache; names bad configs and
tensors; splits its experts over two ranks with the single-process result; counts the
released model's parameters as transformers does. Images and audio:
``test_muse_spark_media.py``."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import titan_models
from titan_models import fqn_matches
from titan_models.hf_io import _open_checkpoint
from titan_testing import run_distributed

transformers = pytest.importorskip("transformers")

TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=32,
    moe_hidden_size=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=5,
    output_multiplier=0.5,
    final_logit_softcapping=3.0,  # low, so the cap bends the logits
    qk_scale_factor=2.0,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
CONFIGS = {
    # dense between sparse layers; default NoPE/sliding pattern (NoPE at layer 2)
    "sparse-dense-sparse": dict(mlp_layer_types=["sparse", "dense", "sparse"]),
    # five layers: NoPE at 0 and 4, a dense first layer, a routed scale, another theta
    "dense-first-5": dict(
        num_hidden_layers=5,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"],
        routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        num_experts_per_tok=3,
    ),
    # every layer sparse, MHA, explicit layer types (full attention on a RoPE layer too)
    "all-sparse-explicit": dict(
        num_key_value_heads=4,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        residual_gate_temperature=0.7,
        post_norm_eps=1e-6,
    ),
}


def hf_config(name: str, **text):
    return transformers.MuseSparkConfig(
        text_config={**TEXT, **CONFIGS[name], **text},
        vision_config=dict(
            num_hidden_layers=1, hidden_size=16, intermediate_size=16, num_attention_heads=2
        ),
        audio_config=dict(
            hidden_sizes=[8, 8, 8, 8],
            depths=[1, 1, 1, 1],
            out_hidden_size=TEXT["hidden_size"],
        ),
        out_hidden_size=64,
        projector_hidden_size=16,
    )


@pytest.fixture
def hf_spark(tmp_path):
    """``make(name) -> (hf_model, folder)``: a random tiny HF Muse Spark in fp32 with random
    norms, gates and selection biases, saved by transformers (the public layout)."""

    def make(name: str):
        torch.manual_seed(0)
        hf = transformers.MuseSparkForConditionalGeneration(hf_config(name)).eval()
        with torch.no_grad():
            for key, p in hf.named_parameters():
                if "language_model" not in key:
                    continue
                if "norm" in key or key.endswith(".gate"):
                    p.uniform_(-0.5, 0.5)
                elif "experts" in key or key.endswith("gate.weight"):
                    p.normal_(0, 0.1)
            for key, b in hf.named_buffers():
                if key.endswith("e_score_correction_bias"):
                    b.normal_(0, 0.05)
        folder = tmp_path / f"hf-{name}"
        hf.save_pretrained(folder)
        return hf, folder

    return make


def tokens_and_labels(rows: int = 2, seq: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, seq), generator=g), torch.randint(
        0, 256, (rows, seq), generator=g
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_gradients_match_transformers(hf_spark, name):
    hf, folder = hf_spark(name)
    ours = titan_models.from_hf(folder).eval()
    assert type(ours).__name__ == "MuseSpark"
    tokens, labels = tokens_and_labels()
    theirs = hf(input_ids=tokens).logits
    mine = ours(tokens)
    assert mine.shape == theirs.shape
    assert (mine - theirs).abs().max().item() <= 1e-4
    assert theirs.abs().max() < hf.config.text_config.final_logit_softcapping  # capped
    F.cross_entropy(theirs.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(mine.flatten(0, 1), labels.flatten()).backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters() if "language_model" in n}
    hf_grads["lm_head.weight"] = hf.lm_head.weight.grad
    _, hf_cfg, adapter, _ = _open_checkpoint(folder)
    checked = set()
    for fqn, param in ours.named_parameters():
        if param.grad is None:  # the towers on a text batch
            assert fqn.startswith(("visual.", "audio.")), fqn
            continue
        for ht in adapter.hf_tensors(fqn, param.grad, hf_cfg):
            expected = ht.from_hf(hf_grads[ht.key]) if ht.from_hf else hf_grads[ht.key]
            diff = (ht.ours - expected).abs().max().item()
            assert diff <= 1e-4, f"{fqn} <- {ht.key}: gradient differs by {diff}"
            checked.add(ht.key)
    assert checked == set(hf_grads)  # every text parameter of transformers compared


def test_per_layer_types_follow_the_hf_config(hf_spark):
    _, folder = hf_spark("dense-first-5")
    model = titan_models.from_hf(folder)
    c = model.config
    assert [c.rope_theta(i) for i in range(5)] == [0.0, 10_000.0, 10_000.0, 10_000.0, 0.0]
    assert [c.layer_window(i) for i in range(5)] == [None, 5, 5, 5, None]
    assert [type(model.layers[str(i)].feed_forward).__name__ for i in range(5)] == [
        "FeedForward",
        *["PooledMoE"] * 4,
    ]
    _, folder = hf_spark("all-sparse-explicit")
    c = titan_models.from_hf(folder).config
    assert [c.layer_window(i) for i in range(3)] == [None, 5, None]
    assert [c.rope_theta(i) for i in range(3)] == [500_000.0, 500_000.0, 0.0]


@pytest.mark.parametrize("name", ["sparse-dense-sparse", "all-sparse-explicit"])
def test_to_hf_reloads_in_transformers_with_equal_logits(hf_spark, tmp_path, name):
    hf, folder = hf_spark(name)
    ours = titan_models.from_hf(folder).eval()
    out = titan_models.to_hf(ours, tmp_path / "exported")
    reloaded = transformers.MuseSparkForConditionalGeneration.from_pretrained(out).eval()
    tokens, _ = tokens_and_labels()
    with torch.no_grad():
        a = reloaded(input_ids=tokens).logits
        torch.testing.assert_close(a, hf(input_ids=tokens).logits, atol=1e-6, rtol=0)
        assert (ours(tokens) - a).abs().max().item() <= 1e-4
    state = reloaded.state_dict()
    assert state.keys() == hf.state_dict().keys()
    for key, value in hf.state_dict().items():  # the towers too
        assert torch.equal(state[key], value), key
    again = titan_models.from_hf(out)
    assert again.config == ours.config
    for (key, x), (_, y) in zip(ours.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(x, y), key


def _debug_model(**overrides):
    cls, config = titan_models.get_model("muse_spark", "debug", **overrides)
    with torch.device("meta"):
        model = cls(config)
    return model.init_weights(device="cpu", seed=1).eval(), config


def test_cached_decoding_matches_the_full_forward():
    # A window of 4 so the cached sliding layers drop keys during the decode.
    model, config = _debug_model(sliding_window=4)
    tokens = torch.randint(
        0, config.vocab_size, (2, 14), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_kv_cache(2, tokens.shape[1])
        steps = [model(tokens[:, :6], kv_cache=cache)]
        for i in range(6, tokens.shape[1]):
            steps.append(model(tokens[:, i : i + 1], kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_a_layer_with_its_own_rope_base_rotates_by_it():
    model, config = _debug_model()
    tokens = torch.randint(
        0, config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2)
    )
    other = dataclasses.replace(config, layer_rope_theta=(500_000.0, 500_000.0, 1_000.0, 0.0))
    moved = type(model)(other)
    moved.load_state_dict(model.state_dict())
    assert moved.layers["2"].attention.own_rope is not None
    assert model.layers["2"].attention.own_rope is None
    with torch.no_grad():
        assert not torch.allclose(moved.eval()(tokens), model(tokens))
        same = dataclasses.replace(config, layer_rope_theta=(500_000.0, 500_000.0, 500_000.0, 0.0))
        again = type(model)(same)
        again.load_state_dict(model.state_dict())
        assert torch.equal(again.eval()(tokens), model(tokens))


def test_soft_cap_and_multiplier_apply_to_the_head():
    model, config = _debug_model()
    h = torch.randn(3, config.dim) * 50
    raw = h @ model.output.weight.T
    expected = config.logit_softcap * torch.tanh(raw * config.output_multiplier / 20.0)
    torch.testing.assert_close(model.output(h), expected)
    assert model.output(h).abs().max() <= config.logit_softcap


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda t: t.update(mlp_layer_types=["sparse", "moe", "dense"]),
            r"mlp_layer_types=\['sparse', 'moe', 'dense'\] is not supported",
        ),
        (
            lambda t: t.update(layer_types=["full_attention", "chunked", "full_attention"]),
            r"layer_types=.*'chunked'.* is not supported",
        ),
        (
            lambda t: t.update(layer_rope_theta=[10.0, 500_000.0, 0]),
            r"layer_rope_theta\[0\]=10.0 is not supported \(supported: 0 for NoPE or "
            r"rope_theta=500000.0",
        ),
        (lambda t: t.update(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
        (lambda t: t.update(attention_bias=True), r"attention_bias=True is not supported"),
        (lambda t: t.pop("moe_hidden_size"), r"moe_hidden_size is missing"),
        (lambda t: t.update(model_type="llama"), r"model_type='llama' is not supported"),
        (lambda t: t.update(tie_word_embeddings=True), r"tie_word_embeddings=True"),
    ],
    ids=["mlp-type", "layer-type", "theta", "act", "bias", "missing", "text-type", "tied"],
)
def test_bad_hf_config_fields_are_named(hf_spark, from_hf_error, edit, match):
    _, folder = hf_spark("sparse-dense-sparse")
    config = json.loads((folder / "config.json").read_text())
    edit(config["text_config"])
    message = from_hf_error(folder, config={"text_config": config["text_config"]})
    assert __import__("re").search(match, message), message


def test_bad_tensor_is_named_with_file_key_and_shapes(hf_spark, from_hf_error):
    _, folder = hf_spark("sparse-dense-sparse")
    key = "model.language_model.layers.2.mlp.experts.gate_up_proj"
    message = from_hf_error(folder, tensors=lambda s: s | {key: torch.zeros(8, 63, 32)})
    assert "model.safetensors" in message and key in message
    assert "(8, 63, 32)" in message and "(8, 64, 32)" in message
    missing = "model.language_model.layers.1.post_feedforward_residual_gate.gate"
    message = from_hf_error(folder, tensors=lambda s: {k: v for k, v in s.items() if k != missing})
    assert f"1 missing keys: {missing}" in message


def test_plan_covers_the_attention_and_puts_every_moe_under_ep(tp_styles):
    model, config = _debug_model()
    plan = titan_models.get_plan(config)
    styles = tp_styles(plan, model)
    for n in ("wq", "wk", "wv", "w_gate"):
        assert styles[f"layers.0.attention.{n}"] == ["colwise"]
    assert styles["layers.3.attention.wo"] == ["rowwise"]
    assert styles["layers.1.feed_forward.w1"] == ["colwise"]
    assert styles["output"] == ["colwise"] and styles["tok_embeddings"] == ["rowwise"]
    assert plan.experts == (
        "layers.0.feed_forward",
        "layers.2.feed_forward",
        "layers.3.feed_forward",
    )
    assert not styles.get("layers.0.feed_forward.pool")  # inside the MoE: not TP
    assert plan.refused == () and plan.num_experts == 8 and plan.context_parallel
    assert [u.name for u in plan.pipeline_units][-1] == "head"


def test_released_flavor_counts_transformers_parameters():
    """The 816B flavour against transformers' model of the public config, both on meta: the
    whole model (text, vision tower and adapter, audio tower) and each tower equal; the
    flavour is what ``from_hf`` reads of the public config (and the tokenizer's ids)."""
    _, config = titan_models.get_model("muse_spark", "816B")
    with torch.device("meta"):
        ours = titan_models.MuseSpark(config)
        hf = transformers.MuseSparkForConditionalGeneration(transformers.MuseSparkConfig())

    def count(module, *prefixes):
        return sum(p.numel() for n, p in module.named_parameters() if n.startswith(prefixes or ""))

    assert count(ours) == count(hf) == 822_036_513_792
    assert count(ours, "visual.") == count(
        hf, "model.vision_tower.", "model.vision_adapter.", "model.vision_projection."
    )
    assert count(ours, "audio.") == count(hf, "model.audio_tower.")
    assert count(ours) - count(ours, "visual.", "audio.") == 819_990_536_192  # the text model
    adapter = titan_models.registry.FAMILIES["muse_spark"].hf_adapter
    read = adapter.config_from_hf(transformers.MuseSparkConfig().to_dict())
    ids = dict(vision_start_token_id=200_080, vision_end_token_id=200_081)
    assert dataclasses.replace(read, **ids) == config


def _ep_check() -> dict:
    rank = dist.get_rank()
    tokens, labels = tokens_and_labels(rows=2, seq=16, seed=3)
    _, config = titan_models.get_model("muse_spark", "debug")

    def build():
        with torch.device("meta"):
            model = titan_models.MuseSpark(config)
        return model.init_weights(device="cpu", seed=0)

    def loss(model, t, y):
        return F.cross_entropy(model(t).flatten(0, 1), y.flatten(), reduction="sum")

    ref = build()
    loss(ref, tokens, labels).backward()
    model = build()
    placed = {}
    for name, module in model.named_modules():
        if any(fqn_matches(p, name) for p in titan_models.get_plan(config).experts):
            from dist_moe import expert_parallel

            placed[name] = expert_parallel(module)
    row = slice(rank, rank + 1)
    logits = model(tokens[row])
    F.cross_entropy(logits.flatten(0, 1), labels[row].flatten(), reduction="sum").backward()
    out = {"logits": (logits - ref(tokens[row])).abs().max().item()}
    ref_params = dict(ref.named_parameters())
    worst_expert = worst_other = 0.0
    for name, p in model.named_parameters():
        owner = name.rsplit(".experts.", 1)[0]
        if ".experts." in name and owner in placed:
            expected = placed[owner].shard(ref_params[name].grad)
            worst_expert = max(worst_expert, (p.grad - expected).abs().max().item())
        elif p.grad is None:  # a media tower on text-only input: no gradient either way
            assert ref_params[name].grad is None, name
        else:
            grad = p.grad.clone()
            dist.all_reduce(grad)
            worst_other = max(worst_other, (grad - ref_params[name].grad).abs().max().item())
    out["expert_grads"], out["other_grads"], out["placed"] = (
        worst_expert,
        worst_other,
        sorted(placed),
    )
    return out


@pytest.mark.slow
@pytest.mark.extended  # EP 2 of the MoE families: test_expert_parallel.py
def test_ep2_matches_one_process():
    for out in run_distributed(_ep_check, 2, timeout=240):
        assert out["placed"] == [f"layers.{i}.feed_forward" for i in (0, 2, 3)]
        for key in ("logits", "expert_grads", "other_grads"):
            assert out[key] <= 1e-5, (key, out[key])


def test_to_hf_refuses_a_rope_base_transformers_would_not_use(tmp_path):
    model, _ = _debug_model(layer_rope_theta=(500_000.0, 1_000.0, 500_000.0, 0.0))
    with pytest.raises(ValueError, match=r"layer_rope_theta\[1\]=1000.0 cannot be written"):
        titan_models.to_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
