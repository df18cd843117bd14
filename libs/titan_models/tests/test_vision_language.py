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
