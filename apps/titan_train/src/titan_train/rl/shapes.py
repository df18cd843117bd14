"""RL tasks with images: questions about the built-in shapes pictures for a vision-language
model, rewarded by exact match (titan_rl ``Task`` protocol).

A prompt is laid out as the image-text training samples are (``image_question_ids``) and
carries its image as the model's image processor makes it (``titan_rl.PromptImages``), so
the generator prefills the pixels and the trainer recomputes log-probs with the same ones.
"""

from __future__ import annotations

import itertools
from typing import Any, Literal

import titan_models
import titan_rl
from titan_train.data.image_text import ImageProcessor, ShapesSource, image_question_ids
from titan_train.data.shapes import KINDS
from titan_train.data.tokenizers import Tokenizer
from titan_train.loaders import VisionLanguageConfig


class ShapesTask:
    """Shapes questions of one split (``ShapesSource``); reward 1 for the exact answer then EOS."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        model_config: titan_models.TransformerConfig,
        *,
        split: Literal["train", "validation"],
        seed: int,
        validation_fraction: float = 0.01,
        min_pixels: int = 1024,
        max_pixels: int = 64 * 64,
    ) -> None:
        """``model_config``: a vision-language config (``vision``, image and vision-start /
        end token ids)."""
        if not isinstance(model_config, VisionLanguageConfig):
            raise ValueError(
                "task='shapes' needs a vision-language model (e.g. init_recipe='qwen3_vl_debug')"
            )
        vision = model_config.vision
        self.tokenizer, self.config = tokenizer, model_config
        self.processor = ImageProcessor(vision, min_pixels=min_pixels, max_pixels=max_pixels)
        unit = vision.patch_size * vision.spatial_merge_size
        self.source = ShapesSource(
            split=split, unit=unit, seed=seed, validation_fraction=validation_fraction
        )

    def prompts(self, start: int, count: int) -> list[titan_rl.Prompt]:
        """Prompts ``start .. start + count - 1`` with their images."""
        return [self._prompt(name, s) for name, s in self._samples(start, count)]

    def kinds(self, start: int, count: int) -> list[str]:
        """The question kind (``count``, ``colour``, ``side``) of each of those prompts."""
        return [s.kind for _, s in self._samples(start, count)]

    def score(self, prompt: titan_rl.Prompt, response_ids: list[int]) -> titan_rl.RewardResult:
        """1 for the exact answer followed by EOS, else 0."""
        eos = self.tokenizer.eos_id
        if eos not in response_ids:
            return titan_rl.RewardResult(0.0, "truncated", "no EOS within the token budget")
        text = self.tokenizer.decode(response_ids[: response_ids.index(eos)]).strip()
        right = text == prompt.answer
        return titan_rl.RewardResult(float(right), "correct" if right else "wrong", text[:40])

    def breakdown(self, kinds: list[str], scores: list[float]) -> dict[str, float]:
        """Mean score overall (``accuracy``) and per question kind."""
        out = {"accuracy": sum(scores) / len(scores)}
        for kind in KINDS:
            mine = [x for k, x in zip(kinds, scores, strict=True) if k == kind]
            if mine:
                out[f"accuracy_{kind}"] = sum(mine) / len(mine)
        return out

    def _samples(self, start: int, count: int):
        return itertools.islice(self.source.samples(start), count)

    def _prompt(self, name: str, sample: Any) -> titan_rl.Prompt:
        pixels, grid = self.processor(sample.image, name=name)
        c = self.config
        n = grid[0] * grid[1] * grid[2] // self.processor.merge**2
        vision_ids = (c.vision_start_token_id, c.vision_end_token_id)
        ids = image_question_ids(self.tokenizer, sample.question, n, c.image_token_id, vision_ids)
        return titan_rl.Prompt(ids, sample.answer, titan_rl.PromptImages(pixels, (grid,)))
