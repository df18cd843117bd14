"""Muse Spark Open with images and audio reproduces transformers'
``MuseSparkForConditionalGeneration`` (logits and every gradient, fp32) on three tiny configs:
one image, three images of different (non-square) sizes, and three images with two audio
clips of different lengths; round-trips its towers through the public layout into
transformers; decodes through the KV cache with media in the prompt; names bad tower
configs and tensors; and puts the towers in the plan's first pipeline unit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import titan_models
from titan_models.hf_io import _open_checkpoint

transformers = pytest.importorskip("transformers")
IMAGE, VIDEO, AUDIO = 250, 251, 252

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
    final_logit_softcapping=3.0,
    qk_scale_factor=2.0,
    mlp_layer_types=["sparse", "dense", "sparse"],
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
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
AUDIO_TOWER = dict(
    patch_sizes=[4, 2],
    hidden_sizes=[8, 16],
    depths=[1, 2],
    num_hidden_layers=2,
    conv_kernel_size=3,
    out_hidden_size=TEXT["hidden_size"],
)
CONFIGS = {
    # the public patterns scaled down: windows of 4 x 4 patches, a global last block
    "public-pattern": (dict(), dict(), dict(), 48),
    # an 8 x 8 table, tanh-GELU, one frame per patch; an audio MLP of ratio 2, a 5-tap
    # convolution, tanh-GELU, another eps; all-sparse text with its own layer types
    "custom-towers": (
        dict(
            mlp_layer_types=["sparse"] * 3,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
        ),
        dict(pos_emb_height=8, pos_emb_width=8, hidden_act="gelu_pytorch_tanh", patch_temporal=1),
        dict(mlp_ratio=2.0, conv_kernel_size=5, hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-5),
        32,
    ),
    # four vision heads, custom block types; three audio stages; five text layers
    "deep": (
        dict(num_hidden_layers=5, mlp_layer_types=["dense"] + ["sparse"] * 4),
        dict(
            num_attention_heads=4,
            layer_types=["full_attention", "window_attention", "full_attention"],
        ),
        dict(patch_sizes=[2, 2, 2], hidden_sizes=[8, 8, 16], depths=[1, 1, 1], num_hidden_layers=3),
        64,
    ),
}
ONE_IMAGE = [[(1, 4, 4)], []]
THREE_IMAGES = [[(1, 4, 4)], [(1, 8, 4), (1, 6, 8)]]
CLIPS = [24, 10]  # real samples of two clips (8 per token): 3 + 2 audio tokens, row 0


def hf_config(name: str):
    text, vision, audio, projector = CONFIGS[name]
    vision = {**VISION, **vision}
    return transformers.MuseSparkConfig(
        text_config={**TEXT, **text},
        vision_config=vision,
        audio_config={**AUDIO_TOWER, **audio},
        out_hidden_size=vision["hidden_size"] * 4,
        projector_hidden_size=projector,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        audio_token_id=AUDIO,
    )


@pytest.fixture
def hf_spark(tmp_path):
    """``make(name) -> (hf_model, folder)``: a random tiny HF Muse Spark in fp32 with random
    norms, gates, biases, position table and selection biases, saved by transformers."""

    def make(name: str):
        torch.manual_seed(0)
        hf = transformers.MuseSparkForConditionalGeneration(hf_config(name)).eval()
        with torch.no_grad():
            for key, p in hf.named_parameters():
                if "language_model" in key:
                    if "norm" in key or key.endswith(".gate"):
                        p.uniform_(-0.5, 0.5)  # centred / input-scaled: 1 + weight
                    elif "experts" in key or key.endswith("gate.weight"):
                        p.normal_(0, 0.1)
                elif ("norm" in key and key.endswith("weight")) or "ln_" in key:
                    p.uniform_(0.5, 1.5)
                elif key.endswith("bias"):
                    p.normal_(0, 0.1)
                elif "position_embedding" in key:
                    p.normal_(0, 0.5)
            for key, b in hf.named_buffers():
                if key.endswith("e_score_correction_bias"):
                    b.normal_(0, 0.05)
        folder = tmp_path / f"hf-{name}"
        hf.save_pretrained(folder)
        return hf, folder

    return make


def batch(images_per_row, vision: dict, clips: list[int] | None = None, seq_len: int = 40):
    """Token rows with image (and, in row 0, audio) placeholders among random text; the
    patches ``(N, T·3·P·P)``, grids, clips ``(A, 24)`` right-padded with zeros and their
    ``(A, 24)`` masks, and labels."""
    g = torch.Generator().manual_seed(0)
    rows, grids = [], []
    for r, row_images in enumerate(images_per_row):
        row: list[int] = torch.randint(3, 200, (3,), generator=g).tolist()
        for t, h, w in row_images:
            row += [IMAGE] * (t * h * w // 4) + torch.randint(3, 200, (4,), generator=g).tolist()
            grids.append((t, h, w))
        for length in clips if clips and r == 0 else []:
            row += [AUDIO] * -(-length // 8) + [7]
        row += torch.randint(3, 200, (seq_len - len(row),), generator=g).tolist()
        rows.append(row)
    width = vision["patch_temporal"] * 3 * vision["patch_size"] ** 2
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), width, generator=g)
    mask = torch.arange(24)[None, :] < torch.tensor(clips or [0])[:, None]
    waves = torch.randn(mask.shape, generator=g) * mask
    labels = torch.randint(0, 256, (len(rows), seq_len), generator=g)
    return torch.tensor(rows), pixels, grids, (waves, mask), labels


def _inputs(pixels, grids, audio, with_audio: bool):
    """transformers' keyword arguments and ours for the same media."""
    waves, mask = audio
    hf = dict(pixel_values=pixels, image_grid_thw=torch.tensor(grids))
    ours = dict(pixel_values=pixels, image_grid_thw=grids)
    if with_audio:
        hf |= dict(input_values=waves, input_values_mask=mask.long())
        ours |= dict(audio_values=waves, audio_lengths=mask.sum(-1))
    return hf, ours


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.mark.parametrize(
    ("images", "clips"),
    [(ONE_IMAGE, None), (THREE_IMAGES, None), (THREE_IMAGES, CLIPS)],
    ids=["1-image", "3-images", "3-images-2-clips"],
)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_gradients_match_transformers(hf_spark, name, images, clips):
    hf, folder = hf_spark(name)
    ours = titan_models.from_hf(folder).eval()
    tokens, pixels, grids, audio, labels = batch(images, {**VISION, **CONFIGS[name][1]}, clips)
    hf_inputs, our_inputs = _inputs(pixels, grids, audio, clips is not None)
    theirs = hf(input_ids=tokens, **hf_inputs).logits
    mine = ours(tokens, **our_inputs)
    assert _max_diff(mine, theirs) <= 1e-4
    F.cross_entropy(theirs.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(mine.flatten(0, 1), labels.flatten()).backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    assert any(n.startswith("model.vision_tower.") for n in hf_grads)
    assert any(n.startswith("model.audio_tower.") for n in hf_grads) == (clips is not None)
    _, hf_cfg, adapter, _ = _open_checkpoint(folder)
    checked = set()
    for fqn, param in ours.named_parameters():
        if param.grad is None:  # the audio tower without clips
            assert clips is None and fqn.startswith("audio."), fqn
            continue
        for ht in adapter.hf_tensors(fqn, param.grad, hf_cfg):
            expected = ht.from_hf(hf_grads[ht.key]) if ht.from_hf else hf_grads[ht.key]
            diff = _max_diff(ht.ours, expected)
            assert diff <= 1e-4, f"{fqn} <- {ht.key}: gradient differs by {diff}"
            checked.add(ht.key)
    assert checked == set(hf_grads)  # every HF gradient compared


@pytest.mark.parametrize("name", ["public-pattern", "deep"])
def test_to_hf_reloads_the_towers_in_transformers_with_equal_logits(hf_spark, tmp_path, name):
    hf, folder = hf_spark(name)
    ours = titan_models.from_hf(folder).eval()
    out = titan_models.to_hf(ours, tmp_path / "exported")
    reloaded = transformers.AutoModelForImageTextToText.from_pretrained(out).eval()
    assert type(reloaded) is type(hf)
    unread = {"dtype": None, "max_position_embeddings": None}  # not architecture
    for tower in ("audio_config", "vision_config"):
        a, b = (getattr(m.config, tower).to_dict() | unread for m in (reloaded, hf))
        assert a == b, tower
    tokens, pixels, grids, audio, _ = batch(THREE_IMAGES, {**VISION, **CONFIGS[name][1]}, CLIPS)
    hf_inputs, our_inputs = _inputs(pixels, grids, audio, True)
    with torch.no_grad():
        a = reloaded(input_ids=tokens, **hf_inputs).logits
        torch.testing.assert_close(a, hf(input_ids=tokens, **hf_inputs).logits, atol=1e-6, rtol=0)
        assert _max_diff(ours(tokens, **our_inputs), a) <= 1e-4
    state = reloaded.state_dict()
    for key, value in hf.state_dict().items():
        assert torch.equal(state[key], value), key
    again = titan_models.from_hf(out)
    assert again.config == ours.config


def _debug_model(**overrides):
    cls, config = titan_models.get_model("muse_spark", "debug", **overrides)
    with torch.device("meta"):
        model = cls(config)
    return model.init_weights(device="cpu", seed=1).eval(), config


def test_cached_decoding_with_an_image_and_a_clip_in_the_prompt_matches_the_full_forward():
    model, config = _debug_model(sliding_window=8)
    grids = [(1, 4, 6), (1, 2, 2)]
    g = torch.Generator().manual_seed(0)
    spt = config.audio.samples_per_token

    def row() -> list[int]:
        out = torch.randint(0, 200, (3,), generator=g).tolist()
        for _, h, w in grids:
            out += [config.vision_start_token_id, *[config.image_token_id] * (h * w // 4)]
            out += [config.vision_end_token_id, 7]
        return (
            out + [config.audio_token_id] * 3 + torch.randint(0, 200, (12,), generator=g).tolist()
        )

    tokens = torch.tensor([row(), row()])
    pixels = torch.randn(2 * sum(h * w for _, h, w in grids), config.vision.patch_dim, generator=g)
    media = dict(
        pixel_values=pixels,
        image_grid_thw=grids + grids,
        audio_values=torch.randn(2, 3 * spt, generator=g),
    )
    with torch.no_grad():
        full = model(tokens, **media)
        prompt = tokens.shape[1] - 10
        cache = model.new_kv_cache(2, tokens.shape[1])
        steps = [model(tokens[:, :prompt], kv_cache=cache, **media)]
        for i in range(prompt, tokens.shape[1]):
            steps.append(model(tokens[:, i : i + 1], kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_placeholders_and_media_must_agree():
    model, config = _debug_model()
    spt = config.audio.samples_per_token
    tokens = torch.tensor([[1, config.audio_token_id, config.audio_token_id, 2]])
    with pytest.raises(ValueError, match="audio placeholders and audio features disagree"):
        model(tokens, audio_values=torch.randn(1, 3 * spt))
    with pytest.raises(ValueError, match=rf"multiple of {spt}"):
        model(tokens, audio_values=torch.randn(1, 2 * spt - 1))
    with pytest.raises(ValueError, match=r"audio_lengths must be \(1,\)"):
        model(tokens, audio_values=torch.randn(1, 2 * spt), audio_lengths=torch.tensor([9, 9]))
    model(tokens, audio_values=torch.randn(1, 3 * spt), audio_lengths=torch.tensor([2 * spt]))
    tokens = torch.tensor([[1, config.image_token_id, 2]])
    with pytest.raises(ValueError, match="image placeholders and image features disagree"):
        model(
            tokens,
            pixel_values=torch.randn(32, config.vision.patch_dim),
            image_grid_thw=[(1, 4, 8)],
        )
    text_only, _ = _debug_model(vision=None, audio=None)
    assert not any(n.startswith(("visual", "audio")) for n, _ in text_only.named_parameters())
    with pytest.raises(ValueError, match="without the audio tower"):
        text_only(tokens, audio_values=torch.randn(1, spt))


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda c: c["vision_config"].update(model_type="muse_glimmer_vision"),
            r"vision_config.model_type='muse_glimmer_vision' .*expected 'muse_spark_vision'",
        ),
        (lambda c: c.update(out_hidden_size=96), r"out_hidden_size=96 .*expected .* = 128"),
        (
            lambda c: c["vision_config"].update(pos_emb_width=8),
            r"pos_emb_width=8 .*pos_emb_height=4",
        ),
        (lambda c: c.update(projector_hidden_act="silu"), r"projector_hidden_act='silu'"),
        (
            lambda c: c["audio_config"].update(out_hidden_size=32),
            r"audio_config.out_hidden_size=32 .*text_config.hidden_size=64",
        ),
        (
            lambda c: c["audio_config"].update(depths=[1, 1, 1]),
            r"audio_config.depths=\[1, 1, 1\] .*num_hidden_layers=2 entries",
        ),
        (lambda c: c["audio_config"].update(hidden_act="relu6"), r"hidden_act='relu6'"),
    ],
    ids=["vision-type", "merge-width", "table", "projector", "audio-width", "depths", "audio-act"],
)
def test_bad_tower_config_fields_are_named(edit, match):
    config = hf_config("public-pattern").to_dict()
    edit(config)
    adapter = titan_models.registry.FAMILIES["muse_spark"].hf_adapter
    with pytest.raises(ValueError, match=match):
        adapter.config_from_hf(config)


def test_bad_tower_tensor_is_named_with_file_key_and_shapes(hf_spark, from_hf_error):
    _, folder = hf_spark("public-pattern")
    key = "model.audio_tower.layers.1.conv_blocks.0.conv.weight"
    message = from_hf_error(folder, tensors=lambda s: s | {key: torch.zeros(16, 1, 5)})
    assert "model.safetensors" in message and key in message
    assert "(16, 1, 5)" in message and "(16, 1, 3)" in message
    gone = "model.vision_projection.weight"
    message = from_hf_error(folder, tensors=lambda s: {k: v for k, v in s.items() if k != gone})
    assert f"missing keys: {gone}" in message


def test_plan_puts_the_towers_with_the_embedding_and_leaves_them_unsharded(tp_styles):
    model, config = _debug_model()
    plan = titan_models.get_plan(config)
    styles = tp_styles(plan, model)
    assert not any(styles[n] for n in styles if n.startswith(("visual", "audio")))
    first = plan.pipeline_units[0]
    assert first.modules == ("tok_embeddings", "visual", "audio")
    assert first.num_params == sum(
        p.numel() for m in (model.tok_embeddings, model.visual, model.audio) for p in m.parameters()
    )
    assert "visual.blocks.*" in plan.remat_units and plan.refused == ()
