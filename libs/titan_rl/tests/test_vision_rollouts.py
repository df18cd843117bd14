"""Rollouts from a vision-language model: prompts carry images, the generator prefills them,
and the trainer's log-probs are recomputed with the same pixels."""

from __future__ import annotations

import pytest
import torch

import titan_models
from titan_rl import (
    GRPOConfig,
    GRPOTrainer,
    LossConfig,
    Prompt,
    PromptImages,
    RewardResult,
    SamplingParams,
    TorchGenerator,
    batch_images,
    collect_rollouts,
    evaluate_accuracy,
    sequence_logprobs,
)

pytestmark = pytest.mark.usefixtures("single_thread")
GRIDS = ((1, 4, 4), (1, 4, 6), (1, 6, 4))  # patch grids of different sizes
TOLERANCE = 1e-4  # generator (KV-cache decode) vs trainer (one forward) log-probs, fp32


def _model(seed=0):
    cls, config = titan_models.get_model("qwen3_vl", "debug")
    with torch.device("meta"):
        model = cls(config)
    return model.init_weights(device="cpu", seed=seed), config


class _BrightnessTask:
    """Prompt: ``<vision_start> image <vision_end> ?``; answer: the parity of the first
    response token is 1 for an image of positive mean pixel value, else 0 (checkable from the
    pixels alone; a random model gets about half right, so groups have reward variance)."""

    def __init__(self, config):
        self.config = config

    def prompts(self, start, count):
        c, m = self.config, self.config.vision.spatial_merge_size
        out = []
        for i in range(start, start + count):
            grid = GRIDS[i % len(GRIDS)]
            t, h, w = grid
            g = torch.Generator().manual_seed(i)
            pixels = torch.randn(t * h * w, c.vision.patch_dim, generator=g) + (-1) ** i * 0.5
            placeholders = [c.image_token_id] * (t * h * w // m**2)
            ids = [c.vision_start_token_id, *placeholders, c.vision_end_token_id, ord("?")]
            answer = "1" if pixels.mean() > 0 else "0"
            out.append(Prompt(ids, answer, PromptImages(pixels, (grid,))))
        return out

    def score(self, prompt, response_ids):
        right = bool(response_ids) and response_ids[0] % 2 == int(prompt.answer)
        return RewardResult(float(right), "correct" if right else "wrong")


def test_generator_and_trainer_logprobs_agree_with_images_in_the_prompt():
    model, config = _model()
    task = _BrightnessTask(config)
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0)
    sampled_placeholder = False
    for step in range(3):
        batch = collect_rollouts(
            TorchGenerator(model), task, step=step, num_prompts=3, group_size=2, sampling=sampling
        )
        assert len(batch.images) == 6 and batch.images[0] is batch.images[1]  # group shares
        gen = batch.generation
        with torch.no_grad():
            trainer = sequence_logprobs(
                model, batch.prompts, gen.tokens, gen.mask, images=batch.model_images()
            )
            blind = sequence_logprobs(model, batch.prompts, gen.tokens, gen.mask)
        mask = gen.mask.bool()
        diff = (trainer - gen.logprobs)[mask].abs().max()
        assert diff <= TOLERANCE, (
            f"step {step}: generator vs trainer log-probs differ by {diff:.2e}"
        )
        # The images matter: without them (placeholders as text) the log-probs are different.
        assert (blind - gen.logprobs)[mask].abs().max() > 100 * TOLERANCE
        sampled_placeholder |= bool((gen.tokens[mask] == config.image_token_id).any())
    # A response token equal to the placeholder id is text, as the generator decoded it.
    assert sampled_placeholder, "these seeds sample the placeholder id once (step 2)"
    # Rows of a slice get exactly their own images.
    rows = batch.model_images(slice(2, 4))
    assert rows["image_grid_thw"] == [GRIDS[1], GRIDS[1]]
    assert torch.equal(rows["pixel_values"][: 4 * 6], batch.images[2].pixel_values)
    assert batch_images([None, None]) is None
    with pytest.raises(ValueError, match=r"pixel_values of shape \(5, 12\) must be"):
        PromptImages(torch.zeros(5, 12), ((1, 2, 2),))


def test_grpo_steps_on_a_vision_language_model_train_with_the_prompt_images():
    model, config = _model(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grpo = GRPOConfig(
        num_prompts=3,
        group_size=2,
        sampling=SamplingParams(max_new_tokens=3, temperature=1.0),
        loss=LossConfig(correction="tis"),
        seed=5,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    history = GRPOTrainer(model, optimizer, _BrightnessTask(config), grpo).train(3)
    assert len(history) == 3
    for m in history:
        assert torch.isfinite(torch.tensor(m["loss"])) and m["grad_norm"] > 0
        # Sync mode: the trainer's first forward sees the generator's weights and images.
        assert m["max_abs_logprob_diff"] <= TOLERANCE
    visual = [k for k in before if k.startswith("visual.")]
    assert any(not torch.equal(before[k], model.state_dict()[k]) for k in visual)
    greedy = SamplingParams(max_new_tokens=1, temperature=0.0)
    score = evaluate_accuracy(
        TorchGenerator(model), _BrightnessTask(config), start=0, count=3, params=greedy
    )
    assert 0.0 <= score <= 1.0
