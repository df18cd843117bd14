"""Kimi K2.5 reproduces transformers' ``Kimi_K25ForConditionalGeneration`` (logits and every
gradient, fp32) with one image and with three images of different sizes, on three tiny
configs; round-trips through the public checkpoint layout into transformers; decodes through
the KV cache with an image in the prompt; and names bad configs and tensors.

transformers' ``save_pretrained`` of this model does not write the public layout (it mixes
its in-memory names into the original ones), so the tests write the public checkpoint from
transformers' in-memory weights themselves (``public_state``)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

import titan_models
from titan_models.hf_io import _open_checkpoint

transformers = pytest.importorskip("transformers")
IMAGE, START, END, VIDEO = 250, 251, 252, 253

TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.827,
    rms_norm_eps=1e-5,
    num_nextn_predict_layers=0,
)
VISION = dict(
    patch_size=4,
    pos_emb_height=4,
    pos_emb_width=4,
    pos_emb_time=4,
    num_attention_heads=2,
    num_hidden_layers=2,
    hidden_size=32,
    intermediate_size=48,
)
CONFIGS = {
    # query LoRA, untied head, flat routing, a 4 x 4 grid resampled to every image
    "lora-untied": (dict(), dict(), False),
    # no query LoRA, grouped routing, two dense blocks, YaRN; tied head; an 8 x 8 grid (transformers reads square grids only)
    "grouped-tied": (
        dict(
            q_lora_rank=None,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=2,
            max_position_embeddings=256,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=50_000.0,
                factor=4.0,
                original_max_position_embeddings=64,
                beta_fast=1.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
        ),
        dict(pos_emb_height=8, pos_emb_width=8),
        True,
    ),
    # four vision heads, a 3-layer tower, quick-GELU, one shared expert of 2
    "wide-tower": (
        dict(n_shared_experts=2, num_hidden_layers=2),
        dict(num_attention_heads=4, num_hidden_layers=3, hidden_act="quick_gelu"),
        False,
    ),
}
ONE_IMAGE = ([(1, 4, 4)], [])
THREE_IMAGES = ([(1, 4, 4)], [(1, 8, 4), (1, 6, 8)])


def hf_config(name: str):
    text, vision, tie = CONFIGS[name]
    return transformers.Kimi_K25Config(
        text_config={**TEXT, **text},
        vision_config={**VISION, **vision},
        projection_hidden_size=32,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
        tie_word_embeddings=tie,
    )


def public_state(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """transformers' in-memory names and layout → the public checkpoint's (experts stay
    fused, which the adapter reads too)."""
    heads = config.vision_config.num_attention_heads
    out, qkv = {}, {}
    renames = {
        "norm1": "norm0",
        "norm2": "norm1",
        "attn.proj": "wo",
        "mlp.fc1": "mlp.fc0",
        "mlp.fc2": "mlp.fc1",
    }
    for key, value in state.items():
        if key.startswith("model.language_model."):
            out["language_model.model." + key.removeprefix("model.language_model.")] = value
        elif key == "lm_head.weight":
            out["language_model.lm_head.weight"] = value
        elif key.startswith("model.vision_tower.layers."):
            i, rest = key.removeprefix("model.vision_tower.layers.").split(".", 1)
            part, leaf = rest.rsplit(".", 1)
            if part in ("attn.q_proj", "attn.k_proj", "attn.v_proj"):
                if part != "attn.v_proj":  # rotate-half rows back to interleaved pairs
                    shape = value.shape
                    value = value.reshape(heads, 2, -1, *shape[1:]).transpose(1, 2).reshape(shape)
                qkv[(i, leaf, part)] = value
                continue
            out[f"vision_tower.encoder.blocks.{i}.{renames[part]}.{leaf}"] = value
        elif key.startswith("model.vision_tower.final_layernorm."):
            out["vision_tower.encoder." + key.removeprefix("model.vision_tower.")] = value
        elif key == "model.vision_tower.patch_embed.pos_emb.position_embeddings":
            out["vision_tower.patch_embed.pos_emb.weight"] = value
        elif key.startswith("model.vision_tower.patch_embed.proj."):
            out[key.removeprefix("model.")] = value
        elif key.startswith("model.mm_projector."):
            rest = key.removeprefix("model.mm_projector.")
            rest = rest.replace("in_proj", "proj.0").replace("out_proj", "proj.2")
            out["mm_projector." + rest] = value
        else:
            raise AssertionError(f"unexpected transformers key {key}")
    for i, leaf in {(i, leaf) for i, leaf, _ in qkv}:
        parts = [qkv[(i, leaf, f"attn.{p}_proj")] for p in "qkv"]
        out[f"vision_tower.encoder.blocks.{i}.wqkv.{leaf}"] = torch.cat(parts)
    return out


def write_public(folder, hf) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(public_state(state, hf.config), folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(hf.config.to_dict()))


@pytest.fixture
def hf_kimi(tmp_path):
    """``make(name) -> (hf_model, folder)``: a random tiny HF Kimi K2.5 in fp32 with random
    norms, biases, router and position grid, written in the public layout."""

    def make(name: str):
        torch.manual_seed(0)
        hf = transformers.Kimi_K25ForConditionalGeneration._from_config(hf_config(name)).eval()
        with torch.no_grad():
            for key, p in hf.named_parameters():
                if "norm" in key and key.endswith("weight"):
                    p.uniform_(0.5, 1.5)
                elif key.endswith("bias") or key.endswith("gate.weight"):
                    p.normal_(0, 0.1)
                elif "experts" in key:
                    p.normal_(0, 0.05)
                elif "position_embeddings" in key:
                    p.normal_(0, 0.5)
        folder = tmp_path / f"hf-{name}"
        write_public(folder, hf)
        return hf, folder

    return make


def batch(images_per_row, patch: int = 4, seq_len: int = 40, seed: int = 0):
    """Token rows with ``<start> image... <end>`` runs among random text, the images' patches
    ``(N, 3, P, P)``, their grids and labels."""
    g = torch.Generator().manual_seed(seed)
    rows, grids = [], []
    for row_images in images_per_row:
        row: list[int] = torch.randint(0, 200, (3,), generator=g).tolist()
        for t, h, w in row_images:
            row += [START] + [IMAGE] * (h * w // 4) + [END]
            row += torch.randint(0, 200, (4,), generator=g).tolist()
            grids.append((t, h, w))
        row += torch.randint(0, 200, (seq_len - len(row),), generator=g).tolist()
        rows.append(row)
    patches = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(patches, 3, patch, patch, generator=g)
    labels = torch.randint(0, 256, (len(rows), seq_len), generator=g)
    return torch.tensor(rows), pixels, torch.tensor(grids), labels


def check_logits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-4


@pytest.mark.parametrize("images", [ONE_IMAGE, THREE_IMAGES], ids=["1-image", "3-images"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_gradients_match_transformers(hf_kimi, name, images):
    hf, folder = hf_kimi(name)
    ours = titan_models.from_hf(folder).eval()  # eval: no balance loss, as transformers
    assert type(ours).__name__ == "KimiK25"
    tokens, pixels, grids, labels = batch(images)
    theirs = hf(input_ids=tokens, pixel_values=pixels, image_grid_thw=grids).logits
    mine = ours(tokens, pixel_values=pixels, image_grid_thw=grids)
    check_logits(mine, theirs)
    F.cross_entropy(theirs.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(mine.flatten(0, 1), labels.flatten()).backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    public = public_state(hf_grads, hf.config)
    _, hf_config, adapter, _ = _open_checkpoint(folder)
    checked = set()
    for fqn, param in ours.named_parameters():
        for ht in adapter.hf_tensors(fqn, param.grad, hf_config):
            expected = ht.from_hf(public[ht.key]) if ht.from_hf else public[ht.key]
            diff = (ht.ours - expected).abs().max().item()
            assert diff <= 1e-4, f"{fqn} <- {ht.key}: gradient differs by {diff}"
            checked.add(ht.key)
    assert checked == set(public)  # every HF parameter compared
    assert ours.visual.blocks[0].attention.wqkv.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["lora-untied", "grouped-tied"])
def test_to_hf_reloads_in_transformers_with_equal_logits(hf_kimi, tmp_path, name):
    hf, folder = hf_kimi(name)
    ours = titan_models.from_hf(folder).eval()
    out = titan_models.to_hf(ours, tmp_path / "exported")
    reloaded = transformers.AutoModelForImageTextToText.from_pretrained(out).eval()
    assert type(reloaded) is type(hf)
    tokens, pixels, grids, _ = batch(THREE_IMAGES)
    with torch.no_grad():
        a = reloaded(input_ids=tokens, pixel_values=pixels, image_grid_thw=grids).logits
        b = hf(input_ids=tokens, pixel_values=pixels, image_grid_thw=grids).logits
        assert torch.equal(a, b)
        check_logits(ours(tokens, pixel_values=pixels, image_grid_thw=grids), a)
    again = titan_models.from_hf(out)
    assert again.config == ours.config
    for (key, x), (_, y) in zip(ours.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(x, y), key


def _debug_model(**overrides):
    cls, config = titan_models.get_model("kimi_k25", "debug", **overrides)
    with torch.device("meta"):
        model = cls(config)
    return model.init_weights(device="cpu", seed=1).eval(), config


def test_cached_decoding_with_images_in_the_prompt_matches_the_full_forward():
    model, config = _debug_model()
    grids = [(1, 4, 6), (1, 2, 2)]
    g = torch.Generator().manual_seed(0)
    row = torch.randint(0, 200, (3,), generator=g).tolist()
    for _, h, w in grids:
        row += [config.vision_start_token_id, *[config.image_token_id] * (h * w // 4)]
        row += [config.vision_end_token_id, 7]
    row += torch.randint(0, 200, (6,), generator=g).tolist()
    tokens = torch.tensor([row])
    pixels = torch.randn(sum(h * w for _, h, w in grids), config.vision.patch_dim, generator=g)
    full = model(tokens, pixel_values=pixels, image_grid_thw=grids)
    prompt = tokens.shape[1] - 5
    cache = model.new_kv_cache(1, tokens.shape[1])
    steps = [model(tokens[:, :prompt], pixel_values=pixels, image_grid_thw=grids, kv_cache=cache)]
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
    with pytest.raises(ValueError, match=r"t=5 frames exceeds vision pos_emb_time=4"):
        model.visual(torch.randn(80, config.vision.patch_dim), [(5, 4, 4)])


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c["vision_config"].update(hidden_act="relu6"), r"hidden_act='relu6'"),
        (lambda c: c["vision_config"].pop("hidden_size"), r"vision_config field hidden_size"),
        (lambda c: c["vision_config"].update(merge_kernel_size=[2, 1]), r"merge_kernel_size"),
        (lambda c: c.update(projection_hidden_size=48), r"projection_hidden_size=48"),
        (lambda c: c["text_config"].update(scoring_func="softmax"), r"scoring_func='softmax'"),
        (lambda c: c.update(image_token_id=999), r"image_token_id=999"),
        (
            lambda c: c["text_config"].update(quantization_config={"quant_method": "int4"}),
            r"quantization_config",
        ),
        (
            lambda c: c["vision_config"].update(mm_projector_type="patchmergerv2"),
            r"mm_projector_type='patchmergerv2' is not supported \(supported: 'patchmerger'\)",
        ),
    ],
    ids=["activation", "width", "kernel", "projection", "routing", "token", "int4", "projector"],
)
def test_bad_hf_config_fields_are_named(edit, match):
    config = hf_config("lora-untied").to_dict()
    edit(config)
    adapter = titan_models.registry.FAMILIES["kimi_k25"].hf_adapter
    with pytest.raises(ValueError, match=match):
        adapter.config_from_hf(config)


def test_the_original_vision_config_spelling_reads_the_same():
    adapter = titan_models.registry.FAMILIES["kimi_k25"].hf_adapter
    config = hf_config("lora-untied").to_dict()
    ours = adapter.config_from_hf(config)
    v = config["vision_config"]
    config["vision_config"] = {
        "vt_hidden_size": v["hidden_size"],
        "vt_num_hidden_layers": v["num_hidden_layers"],
        "vt_num_attention_heads": v["num_attention_heads"],
        "vt_intermediate_size": v["intermediate_size"],
        "patch_size": v["patch_size"],
        "init_pos_emb_height": v["pos_emb_height"],
        "init_pos_emb_width": v["pos_emb_width"],
        "init_pos_emb_time": v["pos_emb_time"],
        "merge_kernel_size": v["merge_kernel_size"],
        "pos_emb_type": "divided_fixed",
        "mm_projector_type": "patchmerger",
        "mm_hidden_size": v["hidden_size"],
        "projector_ln_eps": config.pop("projection_layer_norm_eps"),
        "media_placeholder_token_id": config.pop("image_token_id"),
    }
    del config["projection_hidden_size"]
    config["text_config"]["model_type"] = "kimi_k2"
    assert adapter.config_from_hf(config) == ours


def test_bad_tensor_is_named_with_file_key_and_shapes(hf_kimi, from_hf_error):
    _, folder = hf_kimi("lora-untied")
    key = "vision_tower.encoder.blocks.1.wqkv.weight"
    message = from_hf_error(folder, tensors=lambda state: state | {key: torch.zeros(95, 32)})
    assert "model.safetensors" in message and key in message
    assert "(96, 32)" in message and "(95, 32)" in message


TP_VISION = dataclasses.replace(
    titan_models.get_model("kimi_k25", "debug")[1].vision, tensor_parallel=True
)


def test_plan_is_deepseek_v3_with_the_tower_on_the_first_stage(tp_styles):
    model, config = _debug_model()
    plan = titan_models.get_plan(config)
    styles = tp_styles(plan, model)
    assert not any(name.startswith("visual") for name in styles if styles[name])
    assert styles["layers.1.attention.wq_b"] and styles["layers.0.feed_forward.w1"]
    first = plan.pipeline_units[0]
    assert first.modules == ("tok_embeddings", "visual")
    owned = [m for u in plan.pipeline_units for m in u.modules]
    assert len(owned) == len(set(owned)) and "layers.2" in owned
    assert first.num_params == sum(
        p.numel() for m in (model.tok_embeddings, model.visual) for p in m.parameters()
    )
    assert plan.experts == ("layers.1.feed_forward", "layers.2.feed_forward")
    assert "visual.blocks.*" in plan.remat_units and plan.context_parallel
    sharded = titan_models.get_plan(dataclasses.replace(config, vision=TP_VISION))
    assert "visual.blocks.*.attention.wqkv" in sharded.tensor_parallel.colwise


def test_video_clips_pool_frames_as_transformers(hf_kimi):
    """A clip of t > 1 frames (one attention document, a sinusoid per frame, the mean over
    frames before the merge) beside a still image: the tower's tokens equal transformers'."""
    hf, folder = hf_kimi("lora-untied")
    ours = titan_models.from_hf(folder).eval()
    grids = [(3, 4, 4), (1, 4, 6), (2, 8, 4)]
    g = torch.Generator().manual_seed(3)
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3, 4, 4, generator=g)
    with torch.no_grad():
        theirs = torch.cat(hf.model.get_image_features(pixels, torch.tensor(grids)).pooler_output)
        mine = ours.visual(pixels, grids)
    assert mine.shape == theirs.shape == (4 + 6 + 8, 64)
    assert (mine - theirs).abs().max().item() <= 1e-4
