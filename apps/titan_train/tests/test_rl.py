"""``titan-train rl``: the task is the pre-training corpus, bad input is refused, and a short
pre-train + GRPO run goes end to end (the full accuracy runs: docs/benchmarks/titan_rl.md)."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

import titan_rl
from titan_train.data.arithmetic import arithmetic_problem as app_problem
from titan_train.data.tokenizers import ByteTokenizer
from titan_train.rl import (
    RLConfig,
    arith_grpo,
    arithmetic_problems,
    main,
    pretraining_job,
    run_rl,
    shapes_grpo,
    validate_rl,
)


def test_the_pretraining_corpus_is_the_rl_task():
    from titan_train.data.sources import DocumentSource

    docs = DocumentSource(kind="arithmetic", split="train", seed=0).documents()
    first = [next(docs) for _ in range(50)]
    problems = {app_problem(0, i).text for i in range(60)}  # a few indices are validation
    assert set(first) <= problems


def test_app_tokenizer_and_corpus_fit_the_titan_rl_task():
    tok = ByteTokenizer()
    assert isinstance(tok, titan_rl.Tokenizer)
    task = titan_rl.ExactMatchTask(tok, arithmetic_problems(RLConfig(), seed=0))
    (prompt,) = task.prompts(0, 1)
    assert prompt.ids == [tok.bos_id, *tok.encode(app_problem(0, 0).prompt)]
    answer = [*tok.encode(app_problem(0, 0).answer), tok.eos_id]
    assert task.score(prompt, answer).score == 1.0
    # the task never sees the slip rule, and reverses answers with the corpus
    rev = arithmetic_problems(RLConfig(reverse_answer=True, init_slip_rate=1.0), seed=0)
    assert rev(1) == app_problem(0, 1, reverse_answer=True)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("group_size", 1),
        ("steps", 0),
        ("lr", 0.0),
        ("temperature", 0.0),
        ("heldout_seed", 1),
        ("time_budget_s", -1.0),
        ("name", "a/b"),
        ("init_slip_rate", 1.2),
        ("init_slip_rate", -0.5),
    ],
)
def test_bad_rl_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        validate_rl(RLConfig(**{field: value}))


def test_pretraining_run_is_named_for_its_corpus_options():
    plain = pretraining_job(RLConfig(init_steps=600))
    assert plain.name == "llama3_debug_600" and plain.data.arithmetic_slip_rate == 0.0
    job = pretraining_job(RLConfig(init_steps=600, init_slip_rate=0.5, reverse_answer=True))
    assert job.name == "llama3_debug_600_slip0.5_rev"
    assert job.data.arithmetic_slip_rate == 0.5 and job.data.arithmetic_reverse_answer
    assert job.checkpoint.export_hf
    recipe = arith_grpo()
    assert pretraining_job(recipe).data.arithmetic_slip_rate == recipe.init_slip_rate


def test_shapes_prompts_carry_their_images_laid_out_as_the_training_samples():
    import titan_models
    from titan_train.data.image_text import ImageProcessor, ImageTextLoader, ShapesSource
    from titan_train.rl_tasks import ShapesTask

    pytest.importorskip("transformers")
    config = titan_models.get_model("qwen3_vl", "debug")[1]
    tok = ByteTokenizer()
    task = ShapesTask(tok, config, split="train", seed=3)
    unit = config.vision.patch_size * config.vision.spatial_merge_size
    samples = ShapesSource(split="train", unit=unit, seed=3).samples(5)
    loader = ImageTextLoader(
        ShapesSource(split="train", unit=unit, seed=3),
        tok,
        ImageProcessor(config.vision, min_pixels=1024, max_pixels=64 * 64),
        seq_len=128,
        batch_size=1,
        image_token_id=config.image_token_id,
        vision_start_id=config.vision_start_token_id,
        vision_end_id=config.vision_end_token_id,
    )
    for prompt, (name, sample) in zip(task.prompts(5, 3), samples, strict=False):
        encoded = loader.encode(name, sample)  # the pre-training sample: prompt + answer + eos
        answer = [*tok.encode(sample.answer), tok.eos_id]
        assert encoded.tokens == prompt.ids + answer and prompt.answer == sample.answer
        assert torch.equal(prompt.images.pixel_values, encoded.pixels)
        assert prompt.images.grids == (encoded.grid,)
        assert task.score(prompt, answer).score == 1.0
        assert task.score(prompt, [*tok.encode("x"), tok.eos_id]).score == 0.0
    again = ShapesSource(split="train", unit=unit, seed=3).samples(5)
    assert task.kinds(5, 3) == [s.kind for _, s in itertools.islice(again, 3)]
    job = pretraining_job(shapes_grpo())
    assert job.data.source == "shapes" and job.checkpoint.export_hf
    with pytest.raises(ValueError, match="task='shapes': init_recipe 'llama3_debug' pre-trains"):
        pretraining_job(RLConfig(task="shapes"))


def test_cli_rejects_an_unknown_recipe_and_a_bad_value(capsys):
    assert main(["--recipe", "nope"]) == 2
    assert "arith_grpo" in capsys.readouterr().err
    assert main(["--group-size", "1"]) == 2
    assert "group_size=1" in capsys.readouterr().err


@pytest.mark.slow
def test_short_pretrain_then_grpo_runs_end_to_end(tmp_path):
    """A 40-step pre-training run made on the fly, then 6 async GRPO steps: the plumbing (init
    run, rollouts, version tags, evaluation, outputs), not the accuracy gain."""
    torch.set_num_threads(1)
    cfg = RLConfig(
        output_dir=str(tmp_path),
        init_steps=40,
        steps=6,
        num_prompts=4,
        group_size=4,
        heldout_count=32,
        eval_every=3,
        mode="async",
        max_offpolicy_steps=1,
        time_budget_s=0.0,
    )
    summary = run_rl(cfg)
    assert (tmp_path / "llama3_debug_40" / "hf" / "config.json").is_file()
    assert summary["steps"] == 6
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    run_dir = tmp_path / "arith_grpo"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["split"] == "train"]
    assert len(train) == 6 and all(0 <= x["staleness"] <= 1 for x in train)
    assert [x["step"] for x in lines if x["split"] == "eval"] == [0, 3, 6, 6]
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    # Starting again reuses the pre-training run instead of training another one.
    again = run_rl(dataclasses.replace(cfg, name="again", steps=1, eval_every=0))
    assert again["accuracy_before"] == summary["accuracy_before"]
    with pytest.raises(ValueError, match="already holds a finished RL run"):
        run_rl(cfg)


@pytest.mark.slow
def test_short_pretrain_then_grpo_on_shapes_with_images_runs_end_to_end(tmp_path):
    """A 2-step qwen3_vl_debug pre-training run, then 2 GRPO steps on shapes questions with the
    pictures in the prompts: the generator's log-probs of the sampled tokens equal the
    trainer's forward with the same images (sync mode: same weights) within 1e-4."""
    torch.set_num_threads(1)
    cfg = dataclasses.replace(
        shapes_grpo(),
        output_dir=str(tmp_path),
        init_steps=2,
        steps=2,
        num_prompts=2,
        group_size=2,
        heldout_count=6,
        eval_every=0,
        time_budget_s=0.0,
    )
    summary = run_rl(cfg)
    assert summary["steps"] == 2 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert set(summary["after"]) >= {"accuracy"}
    lines = (tmp_path / "shapes_grpo" / "metrics.jsonl").read_text().splitlines()
    train = [json.loads(x) for x in lines if json.loads(x)["split"] == "train"]
    assert len(train) == 2
    for m in train:
        assert m["max_abs_logprob_diff"] <= 1e-4, m["max_abs_logprob_diff"]
    assert (tmp_path / "shapes_grpo" / "hf" / "config.json").is_file()


def test_titan_train_rl_subcommand_reaches_the_rl_cli(capsys):
    from titan_train.cli import main as cli_main

    assert cli_main(["rl", "--recipe", "nope"]) == 2
    assert "RL recipes: arith_grpo" in capsys.readouterr().err
