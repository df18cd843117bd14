"""Qwen3-VL and Qwen3-VL-MoE reproduce transformers' logits and gradients with images in the
batch (one image; three images of different sizes), round-trip through HF files, and decode
with images in the prompt through the KV cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import titan_models
from titan_models.hf_io import _open_checkpoint

IMAGE, START, END = 250, 251, 252
MERGE = 2

# Row 0: one image; row 1: two more of other sizes (three in the batch, 4 + 8 + 12 tokens).
ONE_IMAGE = ([(1, 4, 4)], [])
THREE_IMAGES = ([(1, 4, 4)], [(1, 8, 4), (1, 6, 8)])


def hf_config(family: str):
    import transformers

    text = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=10_000.0,
            mrope_section=[4, 2, 2],
            mrope_interleaved=True,
        ),
    )
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=4,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
        out_hidden_size=64,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0, 2],
    )
    tokens = dict(image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END)
    if family == "qwen3_vl":
        return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)
    text |= dict(
        num_hidden_layers=2, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2
    )
    return transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **tokens)


@pytest.fixture
def hf_vl_checkpoint(tmp_path):
    """``make(family, attn) -> (hf_model, folder)``: a random tiny HF Qwen3-VL(-MoE) in fp32
    with random norm weights and biases, saved with ``save_pretrained``."""
    transformers = pytest.importorskip("transformers")

    def make(family: str, attn: str = "sdpa"):
        torch.manual_seed(0)
        cls = {
            "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
            "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration,
        }[family]
        model = cls._from_config(hf_config(family), attn_implementation=attn)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name and name.endswith("weight"):
                    p.uniform_(0.5, 1.5)
                elif name.endswith("bias") or name.endswith("gate.weight"):
                    p.normal_(0, 0.1)
                elif "experts" in name:
                    p.normal_(0, 0.05)
        folder = tmp_path / f"hf-{family}-{attn}"
        model.save_pretrained(folder)
        return model, folder

    return make


def batch(images_per_row, seq_len: int = 40, seed: int = 0):
    """Token rows with ``<start> image... <end>`` runs among random text, the images'
    flattened patches and grids, and labels."""
    g = torch.Generator().manual_seed(seed)
    rows, grids = [], []
    for row_images in images_per_row:
        row: list[int] = torch.randint(0, 200, (3,), generator=g).tolist()
        for t, h, w in row_images:
            row += [START] + [IMAGE] * (t * h * w // MERGE**2) + [END]
            row += torch.randint(0, 200, (4,), generator=g).tolist()
            grids.append((t, h, w))
        row += torch.randint(0, 200, (seq_len - len(row),), generator=g).tolist()
        rows.append(row)
    tokens = torch.tensor(rows)
    patches = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(patches, 3 * 2 * 4 * 4, generator=g)
    labels = torch.randint(0, 256, tokens.shape, generator=g)
    return tokens, pixels, torch.tensor(grids), labels


def hf_forward(hf, tokens, pixels, grids):
    return hf(
        input_ids=tokens,
        pixel_values=pixels,
        image_grid_thw=grids,
        mm_token_type_ids=(tokens == IMAGE).int(),
    ).logits


def check_logits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-4
    kl = F.kl_div(
        F.log_softmax(ours, -1), F.log_softmax(theirs, -1), log_target=True, reduction="none"
    )
    assert kl.sum(-1).max().item() <= 1e-6


def hf_view_of_grads(ours, folder) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Our gradient of every HF tensor's view, and the HF gradient brought to our layout."""
    _, hf_config, adapter, _ = _open_checkpoint(folder)
    pairs = {}
    for fqn, param in ours.named_parameters():
        for ht in adapter.hf_tensors(fqn, param.grad, hf_config):
            pairs[f"{fqn} <- {ht.key}"] = (ht.ours, ht)
    return pairs


FAMILIES = ["qwen3_vl", "qwen3_vl_moe"]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("images", [ONE_IMAGE, THREE_IMAGES], ids=["1-image", "3-images"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_gradients_match_transformers(hf_vl_checkpoint, family, images, attn):
    hf, folder = hf_vl_checkpoint(family, attn)
    ours = titan_models.from_hf(folder).eval()  # eval: no balance loss, as transformers
    assert type(ours).__name__ == {"qwen3_vl": "Qwen3VL", "qwen3_vl_moe": "Qwen3VLMoe"}[family]
    tokens, pixels, grids, labels = batch(images)
    theirs = hf_forward(hf, tokens, pixels, grids)
    mine = ours(tokens, pixel_values=pixels, image_grid_thw=grids)
    check_logits(mine, theirs)
    F.cross_entropy(theirs.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(mine.flatten(0, 1), labels.flatten()).backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    checked = set()
    for name, (our_grad, ht) in hf_view_of_grads(ours, folder).items():
        theirs_grad = hf_grads[ht.key]
        expected = ht.from_hf(theirs_grad) if ht.from_hf else theirs_grad
        diff = (our_grad - expected).abs().max().item()
        assert diff <= 1e-4, f"{name}: gradient differs by {diff}"
        checked.add(ht.key)
    assert checked == set(hf_grads)  # every HF parameter compared (tied head aside)
    # the vision tower took part: its first block has a gradient
    assert ours.visual.blocks[0].attention.wqkv.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_to_hf_round_trip_gives_identical_transformers_logits(hf_vl_checkpoint, tmp_path, family):
    transformers = pytest.importorskip("transformers")
    hf, folder = hf_vl_checkpoint(family)
    ours = titan_models.from_hf(folder)
    out = titan_models.to_hf(ours, tmp_path / "exported")
    reloaded = transformers.AutoModelForImageTextToText.from_pretrained(out)
    assert type(reloaded) is type(hf)
    tokens, pixels, grids, _ = batch(THREE_IMAGES)
    with torch.no_grad():
        assert torch.equal(
            hf_forward(reloaded, tokens, pixels, grids), hf_forward(hf, tokens, pixels, grids)
        )
    again = titan_models.from_hf(out)
    assert again.config == ours.config
    for (name, a), (_, b) in zip(
        ours.state_dict().items(), again.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c["vision_config"].update(hidden_act="relu6"), r"hidden_act='relu6'"),
        (
            lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[4, 2, 1]),
            r"mrope_section=\(4, 2, 1\) must be three counts .* summing to head_dim / 2 = 8",
        ),
        (lambda c: c["vision_config"].update(out_hidden_size=32), r"out_hidden_size=32"),
        (lambda c: c["vision_config"].pop("depth"), r"depth"),
        (lambda c: c["vision_config"].update(num_position_embeddings=15), r"must be a square"),
        (lambda c: c.update(image_token_id=999), r"image_token_id=999"),
    ],
    ids=["activation", "mrope-section", "out-width", "missing-depth", "position-grid", "token"],
)
def test_bad_hf_config_fields_are_named(edit, match):
    pytest.importorskip("transformers")
    config = hf_config("qwen3_vl").to_dict()
    edit(config)
    adapter = titan_models.registry.FAMILIES["qwen3_vl"].hf_adapter
    with pytest.raises(ValueError, match=match):
        adapter.config_from_hf(config)


def _debug_model(family: str = "qwen3_vl", **overrides):
    cls, config = titan_models.get_model(family, "debug", **overrides)
    with torch.device("meta"):
        model = cls(config)
    return model.init_weights(device="cpu", seed=1).eval(), config


def _vl_prompt(config, grids, text_before: int = 3, text_after: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    row = torch.randint(0, 200, (text_before,), generator=g).tolist()
    m = config.vision.spatial_merge_size
    for t, h, w in grids:
        row += [config.vision_start_token_id]
        row += [config.image_token_id] * (t * h * w // m**2) + [config.vision_end_token_id]
    row += torch.randint(0, 200, (text_after,), generator=g).tolist()
    patches = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(patches, config.vision.patch_dim, generator=g)
    return torch.tensor([row]), pixels


def test_placeholders_and_images_must_agree():
    model, config = _debug_model()
    tokens, pixels = _vl_prompt(config, [(1, 4, 4)])
    with pytest.raises(ValueError, match=r"placeholders and image features disagree|disagree"):
        model(tokens[:, 2:-6], pixel_values=pixels, image_grid_thw=[(1, 4, 4)])
    with pytest.raises(ValueError, match=r"pixel_values hold 16 patches"):
        model(tokens, pixel_values=pixels, image_grid_thw=[(1, 4, 8)])


def test_cached_decoding_with_an_image_in_the_prompt_matches_the_full_forward():
    model, config = _debug_model()
    grids = [(1, 4, 6)]
    tokens, pixels = _vl_prompt(config, grids, text_after=6)
    full = model(tokens, pixel_values=pixels, image_grid_thw=grids)
    prompt = tokens.shape[1] - 4
    cache = model.new_kv_cache(1, tokens.shape[1])
    steps = [model(tokens[:, :prompt], pixel_values=pixels, image_grid_thw=grids, kv_cache=cache)]
    for i in range(prompt, tokens.shape[1]):
        steps.append(model(tokens[:, i : i + 1], kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_plan_replicates_the_tower_and_puts_it_on_the_first_pipeline_stage(tp_styles):
    model, config = _debug_model()
    plan = titan_models.get_plan(config)
    styles = tp_styles(plan, model)
    assert not any(name.startswith("visual") for name in styles if styles[name])
    first = plan.pipeline_units[0]
    assert "visual" in first.modules and "tok_embeddings" in first.modules
    owned = [m for u in plan.pipeline_units for m in u.modules]
    assert len(owned) == len(set(owned))
    assert "visual.blocks.*" in plan.remat_units


def test_vision_flops_match_counted_flops_for_one_image():
    from torch.utils.flop_counter import FlopCounterMode

    model, config = _debug_model()
    grid = (1, 8, 6)
    pixels = torch.randn(48, config.vision.patch_dim)
    with FlopCounterMode(display=False) as counter:
        features, deepstack = model.visual(pixels, [grid], backend="sdpa")
        (features.sum() + sum(d.sum() for d in deepstack)).backward()
    # Exact up to two known terms: the pixels need no gradient (the formula's 6·N·P·D patch
    # embedding is 4·N·P·D here), and the counter charges SDPA's backward a recomputation of
    # the scores (2·n²·D per layer) that the formula, like flops_per_token, leaves out.
    v, n = config.vision, 48
    expected = titan_models.vision_flops(config, [grid]) - 2 * n * v.patch_dim * v.dim
    expected += v.num_layers * 2 * n * n * v.dim
    assert counter.get_total_flops() == expected
    with pytest.raises(ValueError, match="has no vision tower"):
        titan_models.vision_flops(titan_models.get_model("qwen3", "debug")[1], [grid])
