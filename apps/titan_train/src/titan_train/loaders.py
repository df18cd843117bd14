"""The data loaders of a job: this data-parallel rank's training stream and its validation
source, for text (packed documents) or image-text data."""

from __future__ import annotations

from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

import titan_models
from titan_train.config import JobConfig
from titan_train.data.chat import ChatSource, chat_sources
from titan_train.data.image_files import ImageFilesSource
from titan_train.data.image_text import ImageProcessor, ImageTextLoader, ShapesSource
from titan_train.data.packing import PackedLoader
from titan_train.data.sources import DocumentSource
from titan_train.data.tokenizers import Tokenizer

IMAGE_TEXT = ("shapes", "image_files")
"""Data sources of image-text samples (vision-language models)."""


@runtime_checkable
class VisionLanguageConfig(Protocol):
    """What image-text data needs of a model config: its vision tower's config and the image
    special tokens (Qwen3-VL, Qwen3-VL-MoE, Kimi K2.5 and any family that has them)."""

    vision: Any
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int


TrainLoader: TypeAlias = PackedLoader | ImageTextLoader
"""A training stream of packed batches."""

ValidationSource: TypeAlias = DocumentSource | ChatSource | ShapesSource | ImageFilesSource
"""A validation split's source."""


def image_text_loader(
    cfg: JobConfig,
    tokenizer: Tokenizer,
    source: ShapesSource | ImageFilesSource,
    config: titan_models.TransformerConfig,
) -> ImageTextLoader:
    """An ``ImageTextLoader`` over ``source`` for the model of config ``config`` (its image
    processor and special tokens)."""
    vl = _vision_language(cfg, config)
    d, t = cfg.data, cfg.training
    processor = ImageProcessor(
        vl.vision, min_pixels=d.image_min_pixels, max_pixels=d.image_max_pixels
    )
    return ImageTextLoader(
        source,
        tokenizer,
        processor,
        seq_len=t.seq_len,
        batch_size=t.batch_size,
        image_token_id=vl.image_token_id,
        vision_start_id=vl.vision_start_token_id,
        vision_end_id=vl.vision_end_token_id,
        skip_too_long=d.skip_too_long,
        skip_bad_images=d.skip_bad_images,
        multimodal_positions=hasattr(config, "mrope_section"),
    )


def _image_text_sources(
    cfg: JobConfig,
    tokenizer: Tokenizer,
    config: titan_models.TransformerConfig,
    dp_rank: int,
    dp_size: int,
) -> tuple[ImageTextLoader, ShapesSource | ImageFilesSource]:
    d = cfg.data
    vision = _vision_language(cfg, config).vision

    def source(split: Literal["train", "validation"]) -> ShapesSource | ImageFilesSource:
        if d.source == "shapes":
            return ShapesSource(
                split=split,
                unit=vision.patch_size * vision.spatial_merge_size,
                seed=cfg.training.seed,
                validation_fraction=d.validation_fraction,
                rank=dp_rank,
                world_size=dp_size,
            )
        return ImageFilesSource(
            split=split,
            validation_fraction=d.validation_fraction,
            rank=dp_rank,
            world_size=dp_size,
            paths=d.paths,
            image_field=d.image_field,
            question_field=d.question_field,
            answer_field=d.answer_field,
        )

    train, val = source("train"), source("validation")
    return image_text_loader(cfg, tokenizer, train, config), val


def _vision_language(
    cfg: JobConfig, config: titan_models.TransformerConfig
) -> VisionLanguageConfig:
    """``config`` as a vision-language model's; ``ValueError`` for a text-only model."""
    if not isinstance(config, VisionLanguageConfig) or config.vision is None:
        raise ValueError(
            f"data.source={cfg.data.source!r} needs a vision-language model; {cfg.model.family} "
            "has no vision tower (e.g. --model.family qwen3_vl)"
        )
    for name in ("vision_start_token_id", "vision_end_token_id"):
        if getattr(config, name) is None:  # a tokenizer id the HF config may not carry
            raise ValueError(
                f"data.source={cfg.data.source!r} needs the model config's {name} (the image "
                f"start / end token of its tokenizer); {cfg.model.family} has {name}=None"
            )
    return config


def loaders(
    cfg: JobConfig,
    tokenizer: Tokenizer,
    model_config: titan_models.TransformerConfig | None = None,
    *,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> tuple[TrainLoader, ValidationSource]:
    """This data-parallel rank's training stream (every ``dp_size``-th document, or its own
    files with ``data.streaming``) and its validation source. ``model_config``: the model's
    config, which image-text data needs (its image processor and special tokens)."""
    d, t = cfg.data, cfg.training
    if d.source == "shapes" or d.source == "image_files":  # IMAGE_TEXT
        if model_config is None:
            raise ValueError(f"data.source={d.source!r}: the loaders need the model's config")
        return _image_text_sources(cfg, tokenizer, model_config, dp_rank, dp_size)
    if d.source == "chat":
        train_src, val_src = chat_sources(cfg, tokenizer, dp_rank=dp_rank, dp_size=dp_size)
        loader = PackedLoader(train_src, tokenizer, seq_len=t.seq_len, batch_size=t.batch_size)
        return loader, val_src
    kind = d.source

    def source(split: Literal["train", "validation"]) -> DocumentSource:
        return DocumentSource(
            split=split,
            kind=kind,
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

    train_src, val_src = source("train"), source("validation")
    return PackedLoader(train_src, tokenizer, seq_len=t.seq_len, batch_size=t.batch_size), val_src


def check_data(
    cfg: JobConfig,
    tokenizer: Tokenizer,
    model_config: titan_models.TransformerConfig,
    *,
    dp_size: int,
) -> None:
    """Build the last data-parallel rank's loaders (the files, formats and fields are checked
    on the way) and fail when its training split of the files holds no document: the last
    rank gets the fewest records."""
    loader, _ = loaders(cfg, tokenizer, model_config, dp_rank=dp_size - 1, dp_size=dp_size)
    source = getattr(loader, "source", None)
    if isinstance(source, DocumentSource):
        source.check_not_empty()
