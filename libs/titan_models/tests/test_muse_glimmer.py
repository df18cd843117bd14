"""Muse Glimmer reproduces transformers' ``MuseGlimmerForConditionalGeneration`` (logits and
every gradient, fp32) on text, with one image and with three images of different (also
non-square) sizes, on three tiny configs; round-trips through the public checkpoint layout
into transformers; decodes through the KV cache (sliding and NoPE layers, an image in the
prompt) as the full forward; names bad configs and tensors; and its full-size flavour has
the public model's parameter count."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import titan_models
from titan_models.hf_io import _open_checkpoint

transformers = pytest.importorskip("transformers")
IMAGE, VIDEO = 250, 251

TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=6,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
VISION = dict(
    patch_size=4,
    pos_emb_height=4,
    pos_emb_width=4,
    num_attention_heads=2,
    num_hidden_layers=3,
    hidden_size=32,
    intermediate_size=48,
    patch_temporal=2,
    merge_size=2,
)
CONFIGS = {
    # the public pattern scaled down: NoPE + global on layers 0 and 4, windows of 6 between;
    # 4 x 4 windows of patches; a 48-wide adapter
    "public-pattern": (dict(), dict(), 48, False),
    # tied head, hand-written layer types (NoPE on 1 and 3, global on 2 only), other query
    # scale / multiplier / cap / post-norm eps, an 8 x 8 table, tanh-GELU, one frame per patch
    "tied-custom-layers": (
        dict(
            layer_types=["sliding_attention", "sliding_attention", "full_attention"]
            + ["sliding_attention"] * 2,
            layer_rope_theta=[10_000.0, 0, 10_000.0, 0, 10_000.0],
            sliding_window=4,
            qk_scale_factor=2.5,
            output_multiplier=0.7,
            final_logit_softcapping=5.0,
            post_norm_eps=1e-6,
        ),
        dict(pos_emb_height=8, pos_emb_width=8, hidden_act="gelu_pytorch_tanh", patch_temporal=1),
        32,
        True,
    ),
    # multi-head attention with YaRN, four vision heads, all vision blocks global but one
    "mha-yarn": (
        dict(
            num_key_value_heads=4,
            num_hidden_layers=4,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=50_000.0,
                factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
        dict(
            num_attention_heads=4,
            layer_types=["full_attention", "window_attention", "full_attention"],
        ),
        64,
        False,
    ),
}
ONE_IMAGE = [[(1, 4, 4)], []]
THREE_IMAGES = [[(1, 4, 4)], [(1, 8, 4), (1, 6, 8)]]


def hf_config(name: str):
    text, vision, projector, tie = CONFIGS[name]
    return transformers.MuseGlimmerConfig(
        text_config={**TEXT, **text},
        vision_config={**VISION, **vision},
        out_hidden_size={**VISION, **vision}["hidden_size"] * 4,
        projector_hidden_size=projector,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        tie_word_embeddings=tie,  # read at the top level only
    )


@pytest.fixture
def hf_glimmer(tmp_path):
    """``make(name) -> (hf_model, folder)``: a random tiny HF Muse Glimmer in fp32 with random
    norms, biases and position table, saved by transformers (its names are the public ones)."""

    def make(name: str):
        torch.manual_seed(0)
        hf = transformers.MuseGlimmerForConditionalGeneration._from_config(hf_config(name)).eval()
        with torch.no_grad():
            for key, p in hf.named_parameters():
                if "language_model.layers" in key and "layernorm" in key:
                    p.uniform_(-0.5, 0.5)  # centred: the scale is 1 + weight
                elif ("norm" in key and key.endswith("weight")) or "ln_" in key:
                    p.uniform_(0.5, 1.5)
                elif key.endswith("bias"):
                    p.normal_(0, 0.1)
                elif "position_embedding" in key:
                    p.normal_(0, 0.5)
        folder = tmp_path / f"hf-{name}"
        hf.save_pretrained(folder)
        return hf, folder

    return make


def batch(images_per_row, vision: dict, seq_len: int = 40, seed: int = 0):
    """Token rows with an image's placeholders among random text, the images' patches
    ``(N, T·3·P·P)``, their grids and labels."""
    g = torch.Generator().manual_seed(seed)
    rows, grids = [], []
    for row_images in images_per_row:
        row: list[int] = torch.randint(3, 200, (3,), generator=g).tolist()
        for t, h, w in row_images:
            row += [IMAGE] * (t * h * w // 4) + torch.randint(3, 200, (4,), generator=g).tolist()
            grids.append((t, h, w))
        row += torch.randint(3, 200, (seq_len - len(row),), generator=g).tolist()
        rows.append(row)
    patches = sum(t * h * w for t, h, w in grids)
    width = vision["patch_temporal"] * 3 * vision["patch_size"] ** 2
    pixels = torch.randn(patches, width, generator=g)
    labels = torch.randint(0, 256, (len(rows), seq_len), generator=g)
    return torch.tensor(rows), pixels, grids, labels


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.mark.parametrize(
    "images", [None, ONE_IMAGE, THREE_IMAGES], ids=["text", "1-image", "3-images"]
)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_gradients_match_transformers(hf_glimmer, name, images):
    hf, folder = hf_glimmer(name)
    ours = titan_models.from_hf(folder).eval()
    assert type(ours).__name__ == "MuseGlimmer"
    vision = {**VISION, **CONFIGS[name][1]}
    tokens, pixels, grids, labels = batch(images or [[], []], vision)
    if images is None:
        theirs, mine = hf(input_ids=tokens).logits, ours(tokens)
    else:
        theirs = hf(
            input_ids=tokens, pixel_values=pixels, image_grid_thw=torch.tensor(grids)
        ).logits
        mine = ours(tokens, pixel_values=pixels, image_grid_thw=grids)
    assert _max_diff(mine, theirs) <= 1e-4
    F.cross_entropy(theirs.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(mine.flatten(0, 1), labels.flatten()).backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    _, hf_config, adapter, _ = _open_checkpoint(folder)
    checked = set()
    for fqn, param in ours.named_parameters():
        if param.grad is None:  # the tower on a text batch
            assert images is None and fqn.startswith("visual."), fqn
            continue
        for ht in adapter.hf_tensors(fqn, param.grad, hf_config):
            diff = _max_diff(ht.ours, hf_grads[ht.key])
            assert diff <= 1e-4, f"{fqn} <- {ht.key}: gradient differs by {diff}"
            checked.add(ht.key)
    assert checked == set(hf_grads)  # every HF gradient compared
    if images is not None:
        assert ours.visual.pos_embed.grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["public-pattern", "tied-custom-layers"])
def test_to_hf_reloads_in_transformers_with_equal_logits(hf_glimmer, tmp_path, name):
    hf, folder = hf_glimmer(name)
    ours = titan_models.from_hf(folder).eval()
    out = titan_models.to_hf(ours, tmp_path / "exported")
    reloaded = transformers.AutoModelForImageTextToText.from_pretrained(out).eval()
    assert type(reloaded) is type(hf)
    tokens, pixels, grids, _ = batch(THREE_IMAGES, {**VISION, **CONFIGS[name][1]})
    inputs = dict(input_ids=tokens, pixel_values=pixels, image_grid_thw=torch.tensor(grids))
    with torch.no_grad():
        a, b = reloaded(**inputs).logits, hf(**inputs).logits
        assert torch.equal(a, b)
        assert _max_diff(ours(tokens, pixel_values=pixels, image_grid_thw=grids), a) <= 1e-4
    again = titan_models.from_hf(out)
    assert again.config == ours.config
    for (key, x), (_, y) in zip(ours.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(x, y), key


def _debug_model(**overrides):
    cls, config = titan_models.get_model("muse_glimmer", "debug", **overrides)
    with torch.device("meta"):
        model = cls(config)
    return model.init_weights(device="cpu", seed=1).eval(), config


def test_cached_decoding_with_an_image_in_the_prompt_matches_the_full_forward():
    """Windows of 8 (shorter than the sequence) on layers 1 and 2, NoPE + global on 0 and 3."""
    model, config = _debug_model(sliding_window=8)
    with torch.no_grad():  # random norms, so every norm and the post-norms matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    grids = [(1, 4, 6), (1, 2, 2)]
    g = torch.Generator().manual_seed(0)

    def row() -> list[int]:  # text, then each image between its start and end tokens
        out = torch.randint(0, 200, (3,), generator=g).tolist()
        for _, h, w in grids:
            out += [config.vision_start_token_id, *[config.image_token_id] * (h * w // 4)]
            out += [config.vision_end_token_id, 7]
        return out + torch.randint(0, 200, (14,), generator=g).tolist()

    tokens = torch.tensor([row(), row()])
    patches = sum(h * w for _, h, w in grids)
    pixels = torch.randn(2 * patches, config.vision.patch_dim, generator=g)
    grids = grids + grids
    with torch.no_grad():
        full = model(tokens, pixel_values=pixels, image_grid_thw=grids)
        prompt = tokens.shape[1] - 12
        assert tokens[:, prompt:].ne(config.image_token_id).all()
        cache = model.new_kv_cache(2, tokens.shape[1])
        steps = [
            model(tokens[:, :prompt], pixel_values=pixels, image_grid_thw=grids, kv_cache=cache)
        ]
        for i in range(prompt, tokens.shape[1]):
            steps.append(model(tokens[:, i : i + 1], kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_placeholders_and_images_must_agree():
    model, config = _debug_model()
    tokens = torch.tensor([[1, config.image_token_id, config.image_token_id, 2]])
    pixels = torch.randn(16, config.vision.patch_dim)
    with pytest.raises(ValueError, match="placeholders and image features disagree"):
        model(tokens, pixel_values=pixels, image_grid_thw=[(1, 4, 4)])
    with pytest.raises(ValueError, match=r"pixel_values hold 16 patches"):
        model(tokens, pixel_values=pixels, image_grid_thw=[(1, 4, 8)])
    with pytest.raises(ValueError, match=r"not divisible by spatial_merge_size=2"):
        model(
            tokens,
            pixel_values=torch.randn(15, config.vision.patch_dim),
            image_grid_thw=[(1, 3, 5)],
        )


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda c: c["text_config"].update(hidden_activation="gelu"),
            r"text_config.hidden_activation='gelu' is not supported \(expected 'silu'\)",
        ),
        (
            lambda c: c["text_config"].update(layer_rope_theta=[1e4, 0, 5e5, 0, 1e4]),
            r"text_config.layer_rope_theta\[2\]=500000.0 .*expected 0 \(NoPE\) or rope_theta=10000.0",
        ),
        (
            lambda c: c["text_config"].update(layer_types=["chunked_attention"] * 5),
            r"text_config.layer_types=.*expected 5 entries of 'full_attention' / 'sliding_attention'",
        ),
        (lambda c: c.update(out_hidden_size=96), r"out_hidden_size=96 .*expected .* = 128"),
        (
            lambda c: c["vision_config"].update(pos_emb_width=8),
            r"pos_emb_width=8 .*pos_emb_height=4",
        ),
        (lambda c: c["vision_config"].update(hidden_act="relu6"), r"hidden_act='relu6'"),
        (lambda c: c.update(projector_hidden_act="silu"), r"projector_hidden_act='silu'"),
        (lambda c: c["text_config"].update(attention_bias=True), r"attention_bias=True"),
        (lambda c: c["text_config"].pop("hidden_size"), r"hidden_size is missing"),
        (lambda c: c.update(image_token_id=999), r"image_token_id=999"),
        (
            lambda c: c.update(quantization_config={"quant_method": "fp8"}),
            r"quantization_config=.*expected None",
        ),
    ],
    ids=[
        "activation",
        "nope-theta",
        "layer-types",
        "merge-width",
        "table",
        "vit-act",
        "projector",
        "bias",
        "width",
        "token",
        "quantized",
    ],
)
def test_bad_hf_config_fields_are_named(edit, match):
    config = hf_config("public-pattern").to_dict()
    edit(config)
    adapter = titan_models.registry.FAMILIES["muse_glimmer"].hf_adapter
    with pytest.raises(ValueError, match=match):
        adapter.config_from_hf(config)


def test_bad_tensor_is_named_with_file_key_and_shapes(hf_glimmer, from_hf_error):
    _, folder = hf_glimmer("public-pattern")
    key = "model.language_model.layers.2.self_attn.gate_proj.weight"
    message = from_hf_error(folder, tensors=lambda state: state | {key: torch.zeros(60, 64)})
    assert "model.safetensors" in message and key in message
    assert "(60, 64)" in message and "(64, 64)" in message
    gone = "model.vision_tower.patch_embedder.position_embedding_table.weight"
    message = from_hf_error(
        folder, tensors=lambda state: {k: v for k, v in state.items() if k != gone}
    )
    assert f"missing keys: {gone}" in message


def test_plan_shards_heads_gate_and_mlp_and_puts_the_tower_first(tp_styles):
    model, config = _debug_model()
    plan = titan_models.get_plan(config)
    styles = tp_styles(plan, model)
    assert not any(name.startswith("visual") for name in styles if styles[name])
    for name in ("wq", "wk", "wv", "wg", "wo"):
        assert styles[f"layers.3.attention.{name}"], name
    for norm in ("attention_norm", "post_attention_norm", "ffn_norm", "post_ffn_norm"):
        assert styles[f"layers.0.{norm}"] == ["sequence_parallel"], norm
    first = plan.pipeline_units[0]
    assert first.modules == ("tok_embeddings", "visual")
    assert first.num_params == sum(
        p.numel() for m in (model.tok_embeddings, model.visual) for p in m.parameters()
    )
    assert plan.refusal("ep") == "the model has no MoE layers"
    assert plan.refusal("tp") is None and plan.refusal("pp") is None and plan.refusal("cp") is None
    assert "visual.blocks.*" in plan.remat_units
    tied = titan_models.get_plan(dataclasses.replace(config, tie_embeddings=True))
    assert "tied" in (tied.refusal("tp") or "") and "tied" in (tied.refusal("pp") or "")


def test_the_head_soft_caps_and_a_recomputed_chunk_sees_the_same_logits():
    model, config = _debug_model()
    h = torch.randn(3, 5, config.dim) * 30
    logits = model.output(h)
    assert logits.abs().max() < config.logit_softcap
    raw = F.linear(h, model.output.weight)
    torch.testing.assert_close(logits, model.output.soft_cap(raw))
    expected = config.logit_softcap * torch.tanh(
        raw * config.output_multiplier / config.logit_softcap
    )
    torch.testing.assert_close(logits, expected)


def test_full_size_flavour_has_the_public_parameter_count():
    """Muse-Glimmer-30B: transformers' model of the public config, built on meta."""
    with torch.device("meta"):
        hf = transformers.MuseGlimmerForConditionalGeneration(transformers.MuseGlimmerConfig())
        cls, config = titan_models.get_model("muse_glimmer", "30B")
        ours = cls(config)
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in hf.parameters()) == 29_776_626_688
    adapter = titan_models.registry.FAMILIES["muse_glimmer"].hf_adapter
    read = adapter.config_from_hf(transformers.MuseGlimmerConfig().to_dict())
    assert (
        dataclasses.replace(read, vision_start_token_id=200_080, vision_end_token_id=200_081)
        == config
    )


def test_tower_tokens_of_multi_frame_grids_match_transformers(hf_glimmer):
    """Grids of t > 1 frames (each frame its own document and windows, merged on its own)
    beside a still image: the tower's normed tokens equal transformers' image features."""
    hf, folder = hf_glimmer("public-pattern")
    ours = titan_models.from_hf(folder).eval()
    grids = [(3, 4, 4), (1, 4, 6), (2, 8, 4)]
    g = torch.Generator().manual_seed(3)
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 2 * 3 * 16, generator=g)
    with torch.no_grad():
        theirs = torch.cat(hf.model.get_image_features(pixels, torch.tensor(grids)).pooler_output)
        mine = ours.visual(pixels, grids)
    assert mine.shape == theirs.shape == ((48 + 24 + 64) // 4, 64)
    assert _max_diff(mine, theirs) <= 1e-4
