"""Muse Glimmer in the app: its soft-capped head keeps the cap under the chunked loss, the
image-text data path hands its tower raster patches flattened frame-major, and the debug
recipe trains on images."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import titan_models
from titan_train.cli import parse_config
from titan_train.components import apply_overrides, loss_head
from titan_train.data.image_text import ImageProcessor
from titan_train.data.shapes import shapes_sample
from titan_train.trainer import train


def _debug_model():
    cls, config = titan_models.get_model("muse_glimmer", "debug")
    with torch.device("meta"):
        model = cls(config)
    return model.init_weights(device="cpu", seed=3), config


def test_chunked_cross_entropy_of_a_soft_capped_head_is_the_loss_of_the_capped_logits():
    reference, config = _debug_model()
    chunked, _ = _debug_model()
    with torch.no_grad():  # logits far past the cap: a head that forgot it would differ
        for model in (reference, chunked):
            model.output.weight.mul_(40)
    assert apply_overrides(chunked, ("output=chunked_cross_entropy",)) == {
        "output": "chunked_cross_entropy"
    }
    head = loss_head(chunked)
    assert head is not None
    head.chunk_rows = 7  # several chunks and a ragged last one
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 200, (2, 24), generator=g)
    labels = torch.randint(0, config.vocab_size, (2, 24), generator=g)
    labels[:, :3] = -100
    logits = reference(tokens)
    assert logits.abs().max() <= config.logit_softcap
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    with head.targets(labels):
        loss = chunked(tokens)
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-5)
    expected.backward()
    loss.backward()
    # Gradients reach ~2e3 (the x40 head); summed in another order (7-row chunks, and a
    # thread count that changes BLAS blocking), elements near 0 move by ~1e-3. So compare each
    # gradient as a whole: measured relative error 9e-8 on 1 thread, 9e-7 on 2.
    grads = dict(reference.named_parameters())
    for name, p in chunked.named_parameters():
        want = grads[name].grad
        if want is None:  # the vision tower: no image in this batch
            assert p.grad is None, name
            continue
        assert (p.grad - want).norm() <= 1e-5 * want.norm(), name
    torch.testing.assert_close(chunked(tokens), logits)  # no targets: the capped logits


def test_image_text_path_hands_muse_glimmer_raster_patches_frame_major():
    pytest.importorskip("transformers")
    vision = titan_models.get_model("muse_glimmer", "debug")[1].vision
    processor = ImageProcessor(vision, min_pixels=1024, max_pixels=4096)
    image = shapes_sample(0, 3, unit=vision.patch_size * vision.spatial_merge_size).image
    pixels, (t, h, w) = processor(image, name="sample")
    P, T = vision.patch_size, vision.temporal_patch_size
    assert t == 1 and pixels.shape == (h * w, vision.patch_dim)
    patches = pixels.reshape(h, w, T, 3, P, P)
    assert torch.equal(patches[:, :, 0], patches[:, :, 1])  # a still image: two equal frames
    picture = patches[:, :, 0].permute(2, 0, 3, 1, 4).reshape(3, h * P, w * P)
    array = torch.tensor(np.asarray(image.convert("RGB")), dtype=torch.float32)
    expected = (array.permute(2, 0, 1) / 255 - 0.5) / 0.5
    torch.testing.assert_close(picture, expected, atol=1e-5, rtol=0)


def test_muse_glimmer_debug_recipe_trains_on_images(tmp_path):
    """Two steps of the recipe through the app (images, packed samples, chunk-free head); the
    recipe's own 60 steps take the loss from ~5.6 to ~0.3 (see the family README)."""
    pytest.importorskip("transformers")
    cfg = parse_config(
        [
            "--output-dir", str(tmp_path), "--training.steps", "2", "--metrics.log-every", "1",
            "--metrics.validate-every", "0", "--checkpoint.interval", "0",
            "--metrics.no-tensorboard",
        ],
        recipe="muse_glimmer_debug",
    )  # fmt: skip
    out = train(cfg)
    assert len(out["losses"]) == 2 and all(np.isfinite(out["losses"]))


TEXT_RUN = [
    "--model.family", "muse_glimmer", "--model.flavor", "debug", "--data.source", "arithmetic",
    "--training.steps", "3", "--training.batch-size", "2", "--training.seq-len", "64",
    "--metrics.validate-every", "0", "--metrics.no-tensorboard", "--metrics.log-every", "1",
    "--checkpoint.interval", "0", "--training.max-grad-norm", "0",
]  # fmt: skip
LAYOUTS = {  # read the data of one process
    "cp2": ["--parallel.cp", "2", "--parallel.dp-shard", "1"],
    "tp2": ["--parallel.tp", "2", "--parallel.dp-shard", "1"],
}


def _train_layouts(out: str) -> dict[str, list[float]]:
    return {
        name: train(parse_config(["--output-dir", out, "--name", name, *TEXT_RUN, *argv]))["losses"]
        for name, argv in LAYOUTS.items()
    }


@pytest.mark.slow  # ~2 minutes on the shared 2-core machine
@pytest.mark.extended  # the app's generic CP / TP paths, on Muse Glimmer
def test_context_and_tensor_parallel_train_like_one_process(tmp_path):
    """CP 2 (zig-zag shards through the sliding and NoPE layers) and TP 2 (heads, gate and
    MLP split; the soft-capped head column-wise) follow one process step for step on text;
    measured within 1e-6 in fp32."""
    from titan_testing import run_distributed

    got = run_distributed(_train_layouts, 2, str(tmp_path / "w2"), timeout=600)[0]
    one = train(parse_config(["--output-dir", str(tmp_path), "--name", "one", *TEXT_RUN]))
    for name, losses in got.items():
        assert len(losses) == 3
        assert max(abs(a - b) for a, b in zip(losses, one["losses"], strict=True)) <= 1e-5, name
