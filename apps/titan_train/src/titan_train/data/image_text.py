"""Image-text samples packed into fixed token budgets, with a resumable state.

A sample is ``<bos> <vision_start> <image>×n <vision_end> question " " answer <eos>``: its
picture goes through the model's Hugging Face image processor (transformers' Qwen2-VL
processor, built from the model's vision config: nothing downloaded), which yields the
flattened patches and the patch grid ``(t, h, w)``; the picture then takes
``n = t·h·w / merge²`` placeholder tokens. The loss is on the answer and ``<eos>``.

Packing: samples are placed whole, in order, into rows of ``S`` tokens (vision placeholders
counted); a sample that does not fit the rest of a row starts the next one and the rest is
padding (its own document, no loss). Every sample is one document (``document_ids``), so
attention never crosses samples; the multimodal positions restart in each. A sample longer
than ``S`` is an error naming it (or, with ``skip_too_long``, counted and skipped); so is an
image that cannot be decoded or is over the pixel budget (``skip_bad_images``), and a question
or answer whose tokens include the image placeholder.

Sources: ``ShapesSource`` (the built-in corpus) and ``image_files.ImageFilesSource`` (local
files through HF ``datasets``); each yields ``(name, sample)`` with ``image``, ``question`` and
``answer``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from titan_train.data.file_records import in_validation
from titan_train.data.packing import IGNORE_INDEX, Batch, ImageInputs
from titan_train.data.shapes import ShapesSample, shapes_sample
from titan_train.data.tokenizers import Tokenizer


class _BadImage(ValueError):
    """An image that cannot be decoded or is over the pixel budget (skippable)."""


class ImageProcessor:
    """The model's HF image processor (Qwen2-VL's, as Qwen3-VL uses), from its vision config.

    A tower that reads each image's patches row by row (``vision.patch_order == "raster"``,
    Kimi K2.5's MoonViT) gets them in that order instead of the processor's merge-block
    order, normalised with the tower's ``image_mean`` / ``image_std`` where it names them;
    one that flattens a patch frame-major (``vision.patch_layout == "time_channel"``, Muse
    Glimmer's ``(T, C, P, P)``) gets each patch so instead of the processor's ``(C, T, P, P)``."""

    def __init__(self, vision: Any, *, min_pixels: int, max_pixels: int) -> None:
        """``vision``: a config with ``patch_size``, ``temporal_patch_size`` and
        ``spatial_merge_size``; images are resized into ``[min_pixels, max_pixels]`` pixels."""
        try:
            from transformers import Qwen2VLImageProcessorPil
        except ImportError as e:
            raise ValueError(
                "image-text data needs transformers' Qwen2-VL image processor: install the "
                f"'vision' extra of titan-train (pip install 'titan-train[vision]'): {e}"
            ) from None
        if not 0 < min_pixels <= max_pixels:
            raise ValueError(
                f"data.image_min_pixels={min_pixels} must be in (0, data.image_max_pixels="
                f"{max_pixels}]"
            )
        self.merge = vision.spatial_merge_size
        self.unit = vision.patch_size * vision.spatial_merge_size
        self.max_pixels = max_pixels
        self.raster = getattr(vision, "patch_order", "merge_blocks") == "raster"
        self.time_channel = getattr(vision, "patch_layout", "channel_time") == "time_channel"
        self.patch_shape = (3, vision.temporal_patch_size, vision.patch_size, vision.patch_size)
        normalise: dict[str, Any] = {
            name: list(getattr(vision, name))
            for name in ("image_mean", "image_std")
            if getattr(vision, name, None) is not None
        }
        self._processor = Qwen2VLImageProcessorPil(
            patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.spatial_merge_size,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            **normalise,
        )

    def __call__(self, image: Any, *, name: str) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """``(patches, C·T·P·P)`` pixels and the patch grid of one PIL image; ``ValueError``
        naming the sample for an unreadable image or one over the pixel budget."""
        size = getattr(image, "size", None)
        if size is None:
            raise _BadImage(f"{name}: not a readable image ({type(image).__name__})")
        if size[0] * size[1] > self.max_pixels:
            raise _BadImage(
                f"{name}: image of {size[0]}x{size[1]} = {size[0] * size[1]} pixels exceeds "
                f"data.image_max_pixels={self.max_pixels}"
            )
        try:
            out = self._processor(images=[image.convert("RGB")], return_tensors="pt")
        except Exception as e:  # PIL / processor errors on a corrupt image
            raise _BadImage(f"{name}: the image processor cannot read this image ({e})") from e
        t, h, w = (int(x) for x in out["image_grid_thw"][0].tolist())
        grid = (t, h, w)
        pixels = out["pixel_values"].float()
        if self.raster:  # (t, h/m, w/m, m, m) blocks -> (t, h/m, m, w/m, m): row by row
            m = self.merge
            blocks = pixels.reshape(t, h // m, w // m, m, m, -1)
            pixels = blocks.permute(0, 1, 3, 2, 4, 5).reshape(t * h * w, -1)
        if self.time_channel:  # (C, T, P, P) -> (T, C, P, P) per patch
            pixels = pixels.reshape(-1, *self.patch_shape).transpose(1, 2).reshape(t * h * w, -1)
        return pixels, grid


def image_question_ids(
    tokenizer: Tokenizer,
    question: str,
    placeholders: int,
    image_token_id: int,
    vision_ids: tuple[int, int],
) -> list[int]:
    """``<bos> <vision_start> <image>×placeholders <vision_end> question " "``: the prompt of a
    sample, which its answer follows (in training and in RL prompts alike)."""
    start, end = vision_ids
    body = [tokenizer.bos_id, start, *[image_token_id] * placeholders, end]
    return body + tokenizer.encode(question + " ")


@dataclass(frozen=True, slots=True)
class _Encoded:
    tokens: list[int]
    labels: list[int]  # next-token targets, IGNORE_INDEX outside the answer
    answer: list[bool]  # which targets are answer tokens
    pixels: torch.Tensor
    grid: tuple[int, int, int]


class ShapesSource:
    """Samples of the built-in shapes corpus of one split for one data-parallel rank."""

    kind = "shapes"

    def __init__(
        self,
        *,
        split: Literal["train", "validation"],
        unit: int,
        seed: int = 0,
        validation_fraction: float = 0.01,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.split, self.unit, self.seed = split, unit, seed
        self.validation_fraction, self.rank, self.world_size = validation_fraction, rank, world_size

    def samples(self, start: int = 0) -> Iterator[tuple[str, ShapesSample]]:
        """``(name, sample)`` of this rank's split from its ``start``-th sample on (endless)."""
        indices = (
            i
            for i in itertools.count()
            if in_validation(i, self.validation_fraction) == (self.split == "validation")
        )
        mine = itertools.islice(indices, self.rank + start * self.world_size, None, self.world_size)
        return ((f"shapes sample {i}", shapes_sample(self.seed, i, unit=self.unit)) for i in mine)


class ImageTextLoader:
    """An endless stream of packed image-text batches (see the module docstring)."""

    def __init__(
        self,
        source: Any,
        tokenizer: Tokenizer,
        processor: ImageProcessor,
        *,
        seq_len: int,
        batch_size: int,
        image_token_id: int,
        vision_start_id: int,
        vision_end_id: int,
        skip_too_long: bool = False,
        skip_bad_images: bool = False,
        multimodal_positions: bool = True,
    ) -> None:
        """``source``: ``ShapesSource`` or ``ImageFilesSource`` (``samples(start)``);
        ``multimodal_positions``: ``(3, B, S)`` M-RoPE positions (Qwen3-VL), else ``(B, S)``
        positions inside each sample (a decoder with 1-D RoPE, Kimi K2.5)."""
        if seq_len < 2:
            raise ValueError(f"training.seq_len={seq_len} must be >= 2")
        self.source, self.tokenizer, self.processor = source, tokenizer, processor
        self.seq_len, self.batch_size = seq_len, batch_size
        self.image_token_id = image_token_id
        self.vision_ids = (vision_start_id, vision_end_id)
        self.skip_too_long = skip_too_long
        self.skipped = 0
        """Samples skipped because they are longer than a row (``skip_too_long``)."""
        self.skip_bad_images = skip_bad_images
        self.skipped_images = 0
        """Samples skipped for an undecodable or over-budget image (``skip_bad_images``)."""
        self.multimodal_positions = multimodal_positions
        self._consumed = 0  # samples of this rank placed in emitted batches (or skipped)
        self._stream: Iterator[tuple[str, Any]] | None = None
        self._carry: _Encoded | None = None

    def __iter__(self) -> ImageTextLoader:
        return self

    def encode(self, name: str, sample: Any) -> _Encoded:
        """Tokens, targets and pixels of one sample (``image``, ``question``, ``answer``)."""
        try:
            image = sample.image
        except Exception as e:  # datasets / PIL decoding a corrupt or missing file
            raise _BadImage(f"{name}: cannot decode the image ({e})") from e
        pixels, grid = self.processor(image, name=name)
        t, h, w = grid
        n = t * h * w // self.processor.merge**2
        tok = self.tokenizer
        prompt = image_question_ids(tok, sample.question, n, self.image_token_id, self.vision_ids)
        answer = tok.encode(sample.answer)
        tokens = prompt + answer + [tok.eos_id]
        # the target at position p is token p + 1: answer tokens and <eos> carry the loss
        labels = [IGNORE_INDEX] * (len(prompt) - 1) + answer + [tok.eos_id, IGNORE_INDEX]
        is_answer = [False] * (len(prompt) - 1) + [True] * len(answer) + [False, False]
        if tokens.count(self.image_token_id) != n:
            raise ValueError(
                f"{name}: its question or answer holds image placeholder token "
                f"{self.image_token_id}: {tokens.count(self.image_token_id)} placeholders for "
                f"one image of {n} tokens"
            )
        return _Encoded(tokens, labels, is_answer, pixels, grid)

    def _next_sample(self) -> _Encoded | None:
        if self._carry is not None:
            sample, self._carry = self._carry, None
            return sample
        if self._stream is None:
            self._stream = self.source.samples(self._consumed)
        name, raw = next(self._stream)
        try:
            encoded = self.encode(name, raw)
        except _BadImage:
            if not self.skip_bad_images:
                raise
            self.skipped_images += 1
            self._consumed += 1
            return None
        if len(encoded.tokens) > self.seq_len:
            if not self.skip_too_long:
                vision = encoded.tokens.count(self.image_token_id)
                raise ValueError(
                    f"{name}: {len(encoded.tokens)} tokens ({vision} of them image placeholders) "
                    f"exceed training.seq_len={self.seq_len} (data.skip_too_long skips such "
                    "samples)"
                )
            self.skipped += 1
            self._consumed += 1
            return None
        return encoded

    def __next__(self) -> Batch:
        B, S = self.batch_size, self.seq_len
        rows: list[list[_Encoded]] = []
        used = 0  # samples of the stream placed in this batch
        for _ in range(B):
            row, length = [], 0
            while True:
                sample = self._next_sample()
                if sample is None:  # skipped (too long, or a bad image)
                    continue
                if length + len(sample.tokens) > S:
                    self._carry = sample
                    break
                row.append(sample)
                length += len(sample.tokens)
                used += 1
            rows.append(row)
        self._consumed += used
        return self._collate(rows)

    def _collate(self, rows: list[list[_Encoded]]) -> Batch:
        from titan_models.components.vision import multimodal_positions

        B, S = len(rows), self.seq_len
        ids = torch.full((B, S), self.tokenizer.pad_id, dtype=torch.long)
        labels = torch.full((B, S), IGNORE_INDEX, dtype=torch.long)
        answers = torch.full((B, S), -1, dtype=torch.long)
        docs = torch.zeros((B, S), dtype=torch.long)
        positions = torch.arange(S).repeat(3, B, 1)
        pixels, grids, row_images = [], [], []
        k = 0  # sample number in the batch
        for b, row in enumerate(rows):
            at = 0
            for d, sample in enumerate(row):
                n = len(sample.tokens)
                span = slice(at, at + n)
                ids[b, span] = torch.tensor(sample.tokens)
                labels[b, span] = torch.tensor(sample.labels)
                answers[b, span] = torch.where(torch.tensor(sample.answer), k, -1)
                docs[b, span] = d
                if self.multimodal_positions:
                    positions[:, b, span], _ = multimodal_positions(
                        sample.tokens,
                        [sample.grid],
                        image_token_id=self.image_token_id,
                        spatial_merge_size=self.processor.merge,
                    )
                else:
                    positions[:, b, span] = torch.arange(n)
                pixels.append(sample.pixels)
                grids.append(sample.grid)
                at, k = at + n, k + 1
            docs[b, at:] = len(row)  # padding: a document of its own, no loss
            positions[:, b, at:] = torch.arange(S - at)
            row_images.append(len(row))
        index = (ids.flatten() == self.image_token_id).nonzero().flatten()
        images = ImageInputs(
            torch.cat(pixels), tuple(grids), index, tuple(row_images), self.processor.merge
        )
        if not self.multimodal_positions:
            positions = positions[0]
        return Batch(ids, labels, docs, positions, images, answers)

    def state_dict(self) -> dict[str, Any]:
        """Plain ints that restore the stream exactly (a carried sample is made again)."""
        return {
            "consumed": self._consumed,
            "skipped": self.skipped,
            "skipped_images": self.skipped_images,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the stream that produced ``state`` stopped."""
        self._consumed, self.skipped = int(state["consumed"]), int(state["skipped"])
        self.skipped_images = int(state.get("skipped_images", 0))
        self._stream, self._carry = None, None
