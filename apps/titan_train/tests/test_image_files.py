"""Local image-text datasets through HF ``datasets`` (imagefolder, jsonl with image paths):
packed like the built-in corpus, the pixels those of the files on disk, bad records named."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import titan_models
from titan_train.cli import parse_config
from titan_train.data.image_files import ImageFilesSource
from titan_train.data.image_text import ImageProcessor, ImageTextLoader
from titan_train.data.packing import IGNORE_INDEX
from titan_train.data.shapes import shapes_sample
from titan_train.data.tokenizers import ByteTokenizer
from titan_train.trainer import train

pytest.importorskip("transformers")
pytest.importorskip("datasets")
PIL = pytest.importorskip("PIL.Image")
CONFIG = titan_models.get_model("qwen3_vl", "debug")[1]


def _write_dataset(root, n=8, *, layout="imagefolder"):
    """``n`` shapes PNGs (2-3 x 16 pixels a side) and their questions; the data path."""
    images = root / "images"
    images.mkdir(parents=True)
    rows = []
    for i in range(n):
        s = shapes_sample(1, i)
        s.image.save(images / f"{i:02d}.png")
        rows.append({"file_name": f"{i:02d}.png", "question": s.question, "answer": s.answer})
    if layout == "imagefolder":
        (images / "metadata.jsonl").write_text("\n".join(map(json.dumps, rows)))
        return images
    data = root / "data.jsonl"  # image paths relative to the data file's folder
    rec = [{"img": f"images/{r['file_name']}", "q": r["question"], "a": r["answer"]} for r in rows]
    data.write_text("\n".join(map(json.dumps, rec)))
    return data


def _loader(source, *, seq_len=128, batch_size=2, max_pixels=4096, tokenizer=None, **kw):
    processor = ImageProcessor(CONFIG.vision, min_pixels=1024, max_pixels=max_pixels)
    return ImageTextLoader(
        source,
        tokenizer or ByteTokenizer(),
        processor,
        seq_len=seq_len,
        batch_size=batch_size,
        image_token_id=CONFIG.image_token_id,
        vision_start_id=CONFIG.vision_start_token_id,
        vision_end_id=CONFIG.vision_end_token_id,
        **kw,
    )


@pytest.mark.parametrize("layout", ["imagefolder", "jsonl"])
def test_local_dataset_packs_the_images_on_disk_with_their_questions(tmp_path, layout):
    path = _write_dataset(tmp_path, layout=layout)
    fields = {} if layout == "imagefolder" else dict(image_field="img", question_field="q")
    fields |= {} if layout == "imagefolder" else dict(answer_field="a")
    source = ImageFilesSource(paths=(str(path),), split="train", validation_fraction=0.25, **fields)
    loader = _loader(source)
    batches = [next(loader), next(loader)]  # 6 train records: the second batch wraps around
    processor = ImageProcessor(CONFIG.vision, min_pixels=1024, max_pixels=4096)
    train_ids = [1, 2, 3, 5, 6, 7]  # records 0 and 4 are validation
    k = 0  # the k-th packed sample overall, in order through the epochs
    for batch in batches:
        ids, docs, images = batch.input_ids, batch.document_ids, batch.images
        lo = 0
        for b in range(ids.shape[0]):
            for d in range(images.row_images[b]):
                i = train_ids[k % len(train_ids)]
                truth = shapes_sample(1, i)
                on_disk = PIL.open(tmp_path / "images" / f"{i:02d}.png")
                assert np.array_equal(np.asarray(on_disk.convert("RGB")), np.asarray(truth.image))
                expected, grid = processor(on_disk, name="reference")
                t, h, w = grid
                n = t * h * w
                image = images.grids[sum(images.row_images[:b]) + d]
                assert image == grid
                assert torch.equal(images.pixel_values[lo : lo + n], expected)
                doc = ids[b][docs[b] == d]
                text = bytes(x for x in doc.tolist() if x < 256).decode()
                assert text == f"{truth.question} {truth.answer}"
                assert int((doc == CONFIG.image_token_id).sum()) == n // 4
                lo, k = lo + n, k + 1
            padding = docs[b] == images.row_images[b]
            assert (batch.labels[b][padding] == IGNORE_INDEX).all()
        assert lo == images.pixel_values.shape[0]
    assert k > len(train_ids)  # the stream went round into a second epoch
    val = ImageFilesSource(
        paths=(str(path),), split="validation", validation_fraction=0.25, **fields
    )
    names = [name.split(" (")[0] for name, _ in _take(val, 3)]
    assert names == ["record 0", "record 4", "record 0"]


def _take(source, n):
    it = source.samples()
    return [next(it) for _ in range(n)]


def test_bad_local_records_are_errors_naming_them_or_counted_skips(tmp_path):
    root = _write_dataset(tmp_path, n=4)
    (root / "01.png").write_bytes((root / "01.png").read_bytes()[:60])  # truncated
    source = ImageFilesSource(paths=(str(root),), split="train", validation_fraction=0)
    with pytest.raises(ValueError, match=r"record 1 \(.*01\.png\): cannot decode the image"):
        next(_loader(source))
    loader = _loader(source, seq_len=36, batch_size=1, skip_bad_images=True)
    next(loader)  # one sample a row: record 0 placed, record 1 skipped, record 2 carried
    assert loader.skipped_images == 1 and loader.state_dict()["skipped_images"] == 1
    PIL.new("RGB", (80, 64)).save(root / "01.png")  # 5120 pixels, over the budget of 4096
    with pytest.raises(ValueError, match=r"record 1 .*: image of 80x64 = 5120 pixels exceeds"):
        next(_loader(source))
    with pytest.raises(ValueError, match=r"record 0 .*: \d+ tokens \(\d+ of them image place"):
        next(_loader(source, seq_len=12))

    class PlaceholderInText(ByteTokenizer):  # a tokenizer that maps "?" to the image token
        def encode(self, text):
            return [CONFIG.image_token_id if c == ord("?") else c for c in super().encode(text)]

    with pytest.raises(ValueError, match=r"record 0 .*: its question or answer holds image "):
        next(_loader(source, tokenizer=PlaceholderInText()))
    with pytest.raises(ValueError, match="data.question_field='prompt': record 0 has no text"):
        ImageFilesSource(paths=(str(root),), split="train", question_field="prompt")
    with pytest.raises(ValueError, match="data.image_field='picture' is not a column"):
        ImageFilesSource(paths=(str(root),), split="train", image_field="picture")
    with pytest.raises(ValueError, match="data.paths: .* does not exist"):
        ImageFilesSource(paths=(str(tmp_path / "missing.jsonl"),), split="train")
    with pytest.raises(ValueError, match="no validation record for data-parallel rank 1 of 2"):
        ImageFilesSource(paths=(str(root),), split="validation", rank=1, world_size=2)


def test_vision_language_recipe_trains_on_a_local_imagefolder(tmp_path):  # ~3 s (2 steps)
    root = _write_dataset(tmp_path, n=12)
    argv = [
        "--output-dir", str(tmp_path), "--name", "vl", "--data.source", "image_files",
        "--data.paths", str(root), "--data.validation-fraction", "0.25",
        "--training.steps", "2", "--training.batch-size", "2", "--metrics.log-every", "1",
        "--metrics.validate-every", "2", "--metrics.validation-batches", "1",
        "--metrics.peak-flops", "1e11", "--checkpoint.interval", "0",
    ]  # fmt: skip
    out = train(parse_config(argv, recipe="qwen3_vl_debug"))
    assert len(out["losses"]) == 2 and all(np.isfinite(out["losses"]))
    lines = [json.loads(x) for x in (tmp_path / "vl" / "metrics.jsonl").read_text().splitlines()]
    assert [x for x in lines if x["split"] == "validation"][-1]["answer_accuracy"] >= 0.0
