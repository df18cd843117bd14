"""The built-in shapes corpus, image-text packing (vision tokens counted, attention never
crossing samples), exact resume, answer accuracy, and bad image-text input."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

import titan_models
from titan_train.build import resolve
from titan_train.cli import parse_config
from titan_train.data.image_text import ImageProcessor, ImageTextLoader, ShapesSource
from titan_train.data.packing import IGNORE_INDEX
from titan_train.data.shapes import ANSWERS, CHANCE_ACCURACY, COLOURS, shapes_sample
from titan_train.data.tokenizers import ByteTokenizer
from titan_train.evaluation import answers_right
from titan_train.trainer import ConfigError, train

pytest.importorskip("transformers")
CONFIG = titan_models.get_model("qwen3_vl", "debug")[1]
MERGE = CONFIG.vision.spatial_merge_size


def _loader(*, seq_len=128, batch_size=2, max_pixels=4096, split="train", **kw):
    processor = ImageProcessor(CONFIG.vision, min_pixels=1024, max_pixels=max_pixels)
    return ImageTextLoader(
        ShapesSource(split=split, unit=16),
        ByteTokenizer(),
        processor,
        seq_len=seq_len,
        batch_size=batch_size,
        image_token_id=CONFIG.image_token_id,
        vision_start_id=CONFIG.vision_start_token_id,
        vision_end_id=CONFIG.vision_end_token_id,
        **kw,
    )


def test_shapes_answers_can_be_read_off_the_pixels():
    kinds = set()
    for i in range(60):
        s = shapes_sample(0, i)
        assert shapes_sample(0, i) == s  # a pure function of (seed, index)
        pixels = np.asarray(s.image)
        H, W, _ = pixels.shape
        assert H in (32, 48, 64) and W in (32, 48, 64)
        fg = (pixels != 30).any(-1)
        assert s.answer in ANSWERS[s.kind]
        kinds.add(s.kind)
        if s.kind == "count":  # every shape sits in its own 16 x 16 cell
            cells = fg.reshape(H // 16, 16, W // 16, 16).any(axis=(1, 3))
            assert int(cells.sum()) == int(s.answer)
        elif s.kind == "colour":
            colours = {tuple(c) for c in pixels[fg]}
            assert colours == {COLOURS[s.answer]}
        else:
            x = np.nonzero(fg)[1]
            assert (x.max() < W / 2) if s.answer == "left" else (x.min() >= W / 2)
    assert kinds == {"count", "colour", "side"}
    assert pytest.approx((1 / 4 + 1 / 4 + 1 / 2) / 3) == CHANCE_ACCURACY


def test_packed_rows_hold_whole_samples_with_their_vision_tokens_counted():
    loader = _loader()
    batch = next(loader)
    B, S = batch.input_ids.shape
    ids, docs, images = batch.input_ids, batch.document_ids, batch.images
    assert (B, S) == (2, 128) and sum(images.row_images) == len(images.grids)
    assert images.pixel_values.shape[0] == sum(t * h * w for t, h, w in images.grids)
    assert torch.equal(images.index, (ids.flatten() == CONFIG.image_token_id).nonzero().flatten())
    grids = iter(images.grids)
    for b in range(B):
        for d in docs[b].unique().tolist()[: images.row_images[b]]:
            doc = ids[b][docs[b] == d]
            t, h, w = next(grids)
            assert doc[0] == ByteTokenizer.bos_id and doc[-1] == ByteTokenizer.eos_id
            assert int((doc == CONFIG.image_token_id).sum()) == t * h * w // MERGE**2
        padding = docs[b] == images.row_images[b]
        assert (ids[b][padding] == ByteTokenizer.pad_id).all()
        assert (batch.labels[b][padding] == IGNORE_INDEX).all()
    # Greedy: the first sample of the next row did not fit in the rest of this one.
    first_of_row1 = int((docs[1] == 0).sum())
    assert first_of_row1 > int((docs[0] == images.row_images[0]).sum())
    # Targets: exactly the answer tokens and <eos>, each the next input token of its sample.
    target = batch.labels != IGNORE_INDEX
    assert torch.equal(batch.labels[:, :-1][target[:, :-1]], ids[:, 1:][target[:, :-1]])
    assert ((batch.answers >= 0) <= target).all()
    # Multimodal positions: an image spans max(h, w) / merge positions, then text resumes.
    start = int((ids[0] == CONFIG.vision_end_token_id).nonzero()[0])
    t, h, w = images.grids[0]
    assert batch.positions[0, 0, start] == 2 + max(h, w) // MERGE


def test_loader_resumes_exactly_from_its_state():
    a = _loader()
    next(a)
    b = _loader()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    x, y = next(a), next(b)
    for name in ("input_ids", "labels", "document_ids", "positions", "answers"):
        assert torch.equal(getattr(x, name), getattr(y, name)), name
    assert torch.equal(x.images.pixel_values, y.images.pixel_values)
    assert x.images.grids == y.images.grids


@pytest.mark.parametrize("backend", ["varlen", "sdpa"])
def test_perturbing_one_packed_sample_leaves_the_others_logits_bitwise_unchanged(backend):
    cls, config = titan_models.get_model("qwen3_vl", "debug", attention_backend=backend)
    with torch.device("meta"):
        model = cls(config)
    model.init_weights(device="cpu", seed=0).eval()
    batch = next(_loader())
    with torch.no_grad():
        logits = model(batch.input_ids, **batch.model_inputs())
    # Perturb sample 1 of row 0: its image (every patch) and one question token.
    row, doc = 0, 1
    mine = batch.document_ids[row] == doc
    assert batch.images.row_images[0] >= 2
    image = 1  # one image per sample: sample 1 of row 0 holds image 1
    t, h, w = batch.images.grids[image]
    lo = sum(a * b * c for a, b, c in batch.images.grids[:image])
    pixels = batch.images.pixel_values.clone()
    pixels[lo : lo + t * h * w] += torch.randn(t * h * w, pixels.shape[1])
    ids = batch.input_ids.clone()
    last_question_token = int(mine.nonzero()[-4])
    ids[row, last_question_token] = ord("#")
    inputs = batch.model_inputs() | {"pixel_values": pixels}
    with torch.no_grad():
        perturbed = model(ids, **inputs)
    others = torch.ones_like(batch.document_ids, dtype=torch.bool)
    others[row] = ~mine
    assert torch.equal(logits[others], perturbed[others])
    assert not torch.allclose(logits[row][mine], perturbed[row][mine])
    # Micro-batches carry their own rows' images: the same logits as the whole batch.
    halves = [model(mb.input_ids, **mb.model_inputs()) for mb in batch.split(2)]
    torch.testing.assert_close(torch.cat(halves), logits, atol=1e-5, rtol=1e-5)


def test_answer_accuracy_counts_a_sample_right_only_when_every_answer_token_is():
    labels = torch.tensor([[5, 6, 7, 8, 9]])
    answers = torch.tensor([[0, 0, -1, 1, 1]])
    logits = torch.nn.functional.one_hot(torch.tensor([[5, 6, 0, 8, 0]]), 10).float()
    assert int(answers_right(logits, labels, answers)) == 1


def test_bad_image_text_input_names_the_sample():
    with pytest.raises(ValueError, match=r"shapes sample \d+: \d+ tokens \(\d+ of them image "):
        next(_loader(seq_len=16))
    loader = _loader(seq_len=24, batch_size=5, skip_too_long=True)
    batch = next(loader)
    assert loader.skipped > 0 and batch.input_ids.shape == (5, 24)
    with pytest.raises(ValueError, match=r"shapes sample \d+: image of \d+x\d+ = \d+ pixels "
                       r"exceeds data.image_max_pixels=1024"):  # fmt: skip
        next(_loader(max_pixels=1024))
    processor = ImageProcessor(CONFIG.vision, min_pixels=1024, max_pixels=4096)
    with pytest.raises(ValueError, match="sample x: not a readable image"):
        processor(object(), name="sample x")
    from PIL import Image

    png = io.BytesIO()
    shapes_sample(0, 0).image.save(png, format="PNG")
    truncated = Image.open(io.BytesIO(png.getvalue()[:60]))
    with pytest.raises(ValueError, match="sample y: the image processor cannot read this image"):
        processor(truncated, name="sample y")


def test_shapes_data_needs_a_vision_language_model_and_one_pipeline_stage(tmp_path):
    with pytest.raises(ConfigError, match="data.source='shapes' needs a vision-language model"):
        resolve(parse_config(["--output-dir", str(tmp_path), "--data.source", "shapes"]))
    argv = ["--output-dir", str(tmp_path), "--parallel.pp", "2"]
    with pytest.raises(ConfigError, match=r"parallel.pp > 1 or parallel.cp > 1 is not supported"):
        resolve(parse_config(argv, recipe="qwen3_vl_debug"), world_size=2)


@pytest.mark.slow  # ~30-60 s on the shared 2-core machine
def test_vision_language_recipe_trains_and_reports_answer_accuracy(tmp_path):
    cfg = parse_config(
        [
            "--output-dir", str(tmp_path), "--name", "vl",
            "--training.steps", "4", "--training.batch-size", "2", "--metrics.log-every", "2",
            "--metrics.validate-every", "4", "--metrics.validation-batches", "1",
            "--metrics.peak-flops", "1e11", "--checkpoint.interval", "0",
        ],
        recipe="qwen3_vl_debug",
    )  # fmt: skip
    out = train(cfg)
    assert len(out["losses"]) == 4 and all(np.isfinite(out["losses"]))
    lines = [json.loads(x) for x in (tmp_path / "vl" / "metrics.jsonl").read_text().splitlines()]
    val = [x for x in lines if x["split"] == "validation"]
    assert val and 0.0 <= val[-1]["answer_accuracy"] <= 1.0
    assert (tmp_path / "vl" / "loss.png").stat().st_size > 0


def test_kimi_k25_batches_have_raster_patches_and_plain_positions():
    """Kimi K2.5's tower reads each image's patches row by row (normalised by 0.5 / 0.5)
    and its decoder 1-D positions: the loader hands it exactly that."""
    kimi = titan_models.get_model("kimi_k25", "debug")[1]
    vision = kimi.vision
    qwen = ImageProcessor(CONFIG.vision, min_pixels=1024, max_pixels=4096)
    raster = ImageProcessor(vision, min_pixels=1024, max_pixels=4096)
    image = shapes_sample(0, 3, unit=vision.patch_size * vision.spatial_merge_size).image
    pixels, (t, h, w) = raster(image, name="sample")
    assert t == 1
    P = vision.patch_size
    # Rebuild the image from the raster patches; it must be the normalised picture.
    picture = pixels.reshape(h, w, 3, P, P).permute(2, 0, 3, 1, 4).reshape(3, h * P, w * P)
    array = torch.tensor(np.asarray(image.convert("RGB")), dtype=torch.float32)
    expected = (array.permute(2, 0, 1) / 255 - 0.5) / 0.5
    assert picture.shape == expected.shape
    torch.testing.assert_close(picture, expected, atol=1e-5, rtol=0)
    assert qwen.raster is False and raster.raster is True

    loader = ImageTextLoader(
        ShapesSource(split="train", unit=P * vision.spatial_merge_size),
        ByteTokenizer(),
        raster,
        seq_len=128,
        batch_size=2,
        image_token_id=kimi.image_token_id,
        vision_start_id=kimi.vision_start_token_id,
        vision_end_id=kimi.vision_end_token_id,
        multimodal_positions=False,
    )
    batch = next(loader)
    assert batch.positions.shape == batch.input_ids.shape
    for b in range(2):  # positions count from 0 in every packed sample
        starts = torch.nonzero(batch.positions[b] == 0).flatten().tolist()
        assert starts[0] == 0 and len(starts) == int(batch.document_ids[b].max()) + 1
