"""The data loaders of a job: this data-parallel rank's training stream and its validation
source, for text (packed documents) or image-text data."""

from __future__ import annotations

from typing import Any

from titan_train.config import JobConfig
from titan_train.data.chat import chat_sources
from titan_train.data.image_files import ImageFilesSource
from titan_train.data.image_text import ImageProcessor, ImageTextLoader, ShapesSource
from titan_train.data.packing import PackedLoader
from titan_train.data.sources import DocumentSource
from titan_train.data.tokenizers import Tokenizer

IMAGE_TEXT = ("shapes", "image_files")
"""Data sources of image-text samples (vision-language models)."""


def image_text_loader(cfg: JobConfig, tokenizer: Tokenizer, source: Any) -> Any:
    """An ``ImageTextLoader`` over ``source`` for the job's model (its image processor and
    special tokens)."""
    from titan_train.model_config import model_config

    _, config = model_config(cfg, tokenizer)
    d, t = cfg.data, cfg.training
    processor = ImageProcessor(
        config.vision, min_pixels=d.image_min_pixels, max_pixels=d.image_max_pixels
    )
    return ImageTextLoader(
        source,
        tokenizer,
        processor,
        seq_len=t.seq_len,
        batch_size=t.batch_size,
        image_token_id=config.image_token_id,
        vision_start_id=config.vision_start_token_id,
        vision_end_id=config.vision_end_token_id,
        skip_too_long=d.skip_too_long,
        skip_bad_images=d.skip_bad_images,
        multimodal_positions=hasattr(config, "mrope_section"),
    )


def _image_text_sources(
    cfg: JobConfig, tokenizer: Tokenizer, dp_rank: int, dp_size: int
) -> tuple[Any, ShapesSource | ImageFilesSource]:
    from titan_train.model_config import model_config

    _, config = model_config(cfg, tokenizer)
    vision = getattr(config, "vision", None)
    d = cfg.data
    if vision is None:
        raise ValueError(
            f"data.source={d.source!r} needs a vision-language model; {cfg.model.family} has no "
            "vision tower (e.g. --model.family qwen3_vl)"
        )
    common = dict(validation_fraction=d.validation_fraction, rank=dp_rank, world_size=dp_size)
    if d.source == "shapes":
        unit = vision.patch_size * vision.spatial_merge_size
        common |= dict(unit=unit, seed=cfg.training.seed)
        train, val = (ShapesSource(split=s, **common) for s in ("train", "validation"))
    else:
        common |= dict(
            paths=d.paths,
            image_field=d.image_field,
            question_field=d.question_field,
            answer_field=d.answer_field,
        )
        train, val = (ImageFilesSource(split=s, **common) for s in ("train", "validation"))
    return image_text_loader(cfg, tokenizer, train), val


def loaders(
    cfg: JobConfig, tokenizer: Tokenizer, *, dp_rank: int = 0, dp_size: int = 1
) -> tuple[Any, Any]:
    """This data-parallel rank's training stream (every ``dp_size``-th document, or its own
    files with ``data.streaming``) and its validation source."""
    d, t = cfg.data, cfg.training
    if d.source in IMAGE_TEXT:
        return _image_text_sources(cfg, tokenizer, dp_rank, dp_size)
    if d.source == "chat":
        train_src, val_src = chat_sources(cfg, tokenizer, dp_rank=dp_rank, dp_size=dp_size)
        loader = PackedLoader(train_src, tokenizer, seq_len=t.seq_len, batch_size=t.batch_size)
        return loader, val_src
    common = dict(
        kind=d.source,
        seed=t.seed,
        validation_fraction=d.validation_fraction,
        paths=d.paths,
        text_field=d.text_field,
        slip_rate=d.arithmetic_slip_rate,
        reverse_answer=d.arithmetic_reverse_answer,
        rank=dp_rank,
        world_size=dp_size,
        streaming=d.streaming,
        shuffle_buffer=d.shuffle_buffer,
    )
    train_src = DocumentSource(split="train", **common)
    val_src = DocumentSource(split="validation", **common)
    return PackedLoader(train_src, tokenizer, seq_len=t.seq_len, batch_size=t.batch_size), val_src


def check_data(cfg: JobConfig, tokenizer: Tokenizer, *, dp_size: int) -> None:
    """Build the last data-parallel rank's loaders (the files, formats and fields are checked
    on the way) and fail when its training split of the files holds no document: the last
    rank gets the fewest records."""
    loader, _ = loaders(cfg, tokenizer, dp_rank=dp_size - 1, dp_size=dp_size)
    source = getattr(loader, "source", None)
    if isinstance(source, DocumentSource):
        source.check_not_empty()
