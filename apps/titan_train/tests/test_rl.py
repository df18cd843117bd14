"""``titan-train rl``: the task is the pre-training corpus, bad input is refused, and short
runs go end to end, in one process and on Monarch actors (the full runs: README and
docs/benchmarks/titan_rl.md)."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

import titan_rl
from titan_train.data.arithmetic import arithmetic_problem as app_problem
from titan_train.data.tokenizers import ByteTokenizer
from titan_train.rl import RLJob, get_rl_recipe, main, validate_rl
from titan_train.rl.init import check_reused, starting_job
from titan_train.rl.run import run_rl
from titan_train.rl.tasks import _CLEAN, _SLIP


def test_the_pretraining_corpus_is_the_rl_task():
    from titan_train.data.sources import DocumentSource

    docs = DocumentSource(kind="arithmetic", split="train", seed=0).documents()
    first = [next(docs) for _ in range(50)]
    problems = {app_problem(0, i).text for i in range(60)}  # a few indices are validation
    assert set(first) <= problems


def test_app_tokenizer_and_corpus_fit_the_titan_rl_task():
    tok = ByteTokenizer()
    assert isinstance(tok, titan_rl.Tokenizer)
    task = titan_rl.ExactMatchTask(tok, _CLEAN.problems(0))
    (prompt,) = task.prompts(0, 1)
    assert prompt.ids == [tok.bos_id, *tok.encode(app_problem(0, 0).prompt)]
    answer = [*tok.encode(app_problem(0, 0).answer), tok.eos_id]
    assert task.score(prompt, answer).score == 1.0
    # the task never sees the slip rule, and reverses answers with the corpus
    rev = _SLIP.problems(0)
    assert rev(1) == app_problem(0, 1, reverse_answer=True)


@pytest.mark.parametrize(
    ("group", "field", "value"),
    [
        ("rl", "group_size", 1),
        ("rl", "steps", 0),
        ("rl", "lr", 0.0),
        ("rl", "temperature", 0.0),
        ("rl", "generators", -1),
        ("rl", "trainer_ranks", 0),
        ("rl", "time_budget_s", -1.0),
        ("eval", "seed", 1),
        ("init", "steps", -1),
    ],
)
def test_bad_rl_config_names_the_field(group, field, value):
    job = RLJob()
    setattr(getattr(job, group), field, value)
    with pytest.raises(ValueError, match=f"{group}.{field}"):
        validate_rl(job)


def test_bad_task_name_and_run_name_are_refused():
    with pytest.raises(ValueError, match="task='nope' is unknown; tasks: arithmetic"):
        validate_rl(RLJob(task="nope"))
    with pytest.raises(ValueError, match="name='a/b'"):
        validate_rl(RLJob(name="a/b"))
    job = RLJob()
    job.rl.trainer_ranks, job.rl.num_prompts, job.rl.group_size = 3, 4, 2
    with pytest.raises(ValueError, match="rl.trainer_ranks=3 must divide the 8 rollouts"):
        validate_rl(job)


def test_starting_run_is_named_for_its_corpus():
    plain = starting_job(get_rl_recipe("arith_grpo_clean"))
    assert plain.name == "llama3_debug_600" and plain.data.arithmetic_slip_rate == 0.0
    assert plain.checkpoint.export_hf and plain.training.steps == 600
    slip = starting_job(get_rl_recipe("arith_grpo"))
    assert slip.name == "llama3_debug_slip0.6_rev_3000"
    assert slip.data.arithmetic_slip_rate == 0.6 and slip.data.arithmetic_reverse_answer
    tool = starting_job(get_rl_recipe("tool_grpo"))
    assert tool.data.source == "chat" and tool.data.chat_environment == "tool_calc"
    assert tool.name == "llama3_debug_tool_calc_3500"


def test_a_starting_run_made_with_other_settings_is_refused_not_reused(tmp_path):
    import dataclasses
    import json

    from titan_train.rl.init import starting_model

    job = get_rl_recipe("tool_grpo")
    job.output_dir = str(tmp_path)
    run = starting_job(job)
    folder = tmp_path / run.name
    (folder / "hf").mkdir(parents=True)
    (folder / "hf" / "config.json").write_text("{}")  # an export is there: no training
    recorded = dataclasses.asdict(run)
    recorded["optimizer"]["lr"] = 3e-3  # made before the task's rate changed
    (folder / "config.json").write_text(json.dumps(recorded))
    with pytest.raises(ValueError, match=r"optimizer\.lr=0\.003 \(this task: 0\.001\)"):
        starting_model(job, announce=pytest.fail)
    assert (folder / "hf" / "config.json").read_text() == "{}"  # nothing deleted or rewritten
    (folder / "config.json").write_text(json.dumps(dataclasses.asdict(run)))
    check_reused(run, folder)  # the same settings: reused
    for damaged in ("{trunc", "[]"):
        (folder / "config.json").write_text(damaged)
        with pytest.raises(ValueError, match="cannot be read"):
            check_reused(run, folder)


def test_shapes_prompts_carry_their_images_laid_out_as_the_training_samples():
    import titan_models
    from titan_train.data.image_text import ImageProcessor, ImageTextLoader, ShapesSource
    from titan_train.rl.shapes import ShapesTask

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
    job = starting_job(get_rl_recipe("shapes_grpo"))
    assert job.data.source == "shapes" and job.checkpoint.export_hf
    with pytest.raises(ValueError, match="task='shapes': init.recipe pre-trains"):
        starting_job(RLJob(task="shapes"))


def test_cli_rejects_an_unknown_recipe_and_a_bad_value(capsys):
    assert main(["--recipe", "nope"]) == 2
    assert "arith_grpo" in capsys.readouterr().err
    assert main(["--rl.group-size", "1"]) == 2
    assert "rl.group_size=1" in capsys.readouterr().err
    assert main(["--list-recipes"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in ("tool_grpo", "sort_grpo", "search_grpo", "code_grpo"))


def _tiny(job: RLJob, tmp_path, *, steps: int = 3, init_steps: int = 40) -> RLJob:
    job.output_dir = str(tmp_path)
    job.init.steps = init_steps
    job.rl.steps, job.rl.num_prompts, job.rl.group_size = steps, 4, 4
    job.rl.time_budget_s = 0.0
    job.eval.count, job.eval.every = 16, 2
    return job


def _lines(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_short_pretrain_then_grpo_runs_end_to_end(tmp_path):
    """A 40-step pre-training run made on the fly (announced), then 4 async GRPO steps in one
    process: the plumbing (starting run, rollouts, lag, evaluation, outputs), not the gain."""
    torch.set_num_threads(1)
    job = _tiny(get_rl_recipe("arith_grpo_clean"), tmp_path, steps=4)
    job.rl.max_offpolicy_steps = 1
    said = []
    summary = run_rl(job, announce=said.append)
    assert (tmp_path / "llama3_debug_40" / "hf" / "config.json").is_file()
    assert any("training it first" in x and "titan-train --recipe llama3_debug" in x for x in said)
    assert summary["steps"] == 4 and 0.0 <= summary["eval_reward_after"] <= 1.0
    run_dir = tmp_path / "arith_grpo_clean"
    lines = _lines(run_dir)
    train = [x for x in lines if x["split"] == "train"]
    assert len(train) == 4 and all(0 <= x["policy_lag_max"] <= 1 for x in train)
    assert [x["step"] for x in train] == [1, 2, 3, 4] and (run_dir / "loss.png").is_file()
    for key in ("reward_mean", "max_abs_logprob_diff", "generator_tokens_per_s",
                "trainer_tokens_per_s", "trainer_idle_fraction"):  # fmt: skip
        assert all(key in x for x in train), key
    assert [x["step"] for x in lines if x["split"] == "eval"] == [0, 2, 4, 4]
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    assert (run_dir / "timeline.png").stat().st_size > 0 and (run_dir / "hf").is_dir()
    # Starting again reuses the starting run instead of training another one.
    said.clear()
    again = run_rl(dataclasses.replace(job, name="again"), announce=said.append)
    assert again["eval_reward_before"] == summary["eval_reward_before"]
    assert not any("training it first" in x for x in said)
    with pytest.raises(ValueError, match="already holds a finished RL run"):
        run_rl(job)


@pytest.mark.slow
def test_resume_from_a_checkpoint_continues_the_run_bitwise(tmp_path):
    """Killed after step 2's checkpoint and run again, the job resumes there (trainer weights
    and optimizer, controller position) and ends with the weights of an uninterrupted run."""
    import safetensors.torch

    torch.set_num_threads(1)
    job = _tiny(get_rl_recipe("arith_grpo_clean"), tmp_path, steps=4)
    job.rl.checkpoint_interval, job.eval.every = 2, 0
    run_rl(dataclasses.replace(job, name="whole"), announce=lambda _: None)

    def crash_after_the_checkpoint(line: str) -> None:
        if "(checkpoint)" in line:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_rl(dataclasses.replace(job, name="cut"), announce=crash_after_the_checkpoint)
    said = []
    summary = run_rl(dataclasses.replace(job, name="cut"), announce=said.append)
    assert any("resuming" in x and "from step 2" in x for x in said)
    assert summary["steps"] == 2
    train = [x for x in _lines(tmp_path / "cut") if x["split"] == "train"]
    assert [x["step"] for x in train] == [1, 2, 3, 4]  # steps done, as pre-training logs them
    whole = safetensors.torch.load_file(tmp_path / "whole" / "hf" / "model.safetensors")
    cut = safetensors.torch.load_file(tmp_path / "cut" / "hf" / "model.safetensors")
    assert whole.keys() == cut.keys()
    assert all(torch.equal(whole[k], cut[k]) for k in whole)


@pytest.mark.slow
def test_short_pretrain_then_grpo_on_shapes_with_images_runs_end_to_end(tmp_path):
    """A 2-step qwen3_vl_debug pre-training run, then 2 GRPO steps on shapes questions with the
    pictures in the prompts: the generator's log-probs of the sampled tokens equal the
    trainer's forward with the same images (sync mode: same weights) within 1e-4."""
    torch.set_num_threads(1)
    job = _tiny(get_rl_recipe("shapes_grpo"), tmp_path, steps=2, init_steps=2)
    job.rl.num_prompts = job.rl.group_size = 2
    job.eval.count, job.eval.every = 6, 0
    summary = run_rl(job)
    assert summary["steps"] == 2 and 0.0 <= summary["eval_reward_after"] <= 1.0
    assert set(summary["after"]) >= {"accuracy", "reward_mean"}
    train = [x for x in _lines(tmp_path / "shapes_grpo") if x["split"] == "train"]
    assert len(train) == 2
    for m in train:
        assert m["max_abs_logprob_diff"] <= 1e-4, m["max_abs_logprob_diff"]
    assert (tmp_path / "shapes_grpo" / "hf" / "config.json").is_file()


@pytest.mark.slow
def test_tool_task_on_monarch_actors_is_bitwise_on_every_model_token(tmp_path):
    """tool_grpo end to end on actors: a 30-step chat SFT on the environment's
    demonstrations, then 3 multi-turn GRPO steps with a data-parallel trainer of 2 ranks
    (flexshard) and 2 generator replicas, batch-invariant: the generators' and the trainer's
    log-probs are equal on every model token of every turn, and the outputs are written."""
    job = _tiny(get_rl_recipe("tool_grpo"), tmp_path, steps=3, init_steps=30)
    job.rl.generators, job.rl.trainer_ranks, job.rl.max_offpolicy_steps = 2, 2, 1
    job.eval.count = 8
    summary = run_rl(job)
    run_dir = tmp_path / "tool_grpo"
    train = [x for x in _lines(run_dir) if x["split"] == "train"]
    assert len(train) == 3
    assert all(x["max_abs_logprob_diff"] == 0.0 for x in train)
    assert all(x["policy_lag_max"] <= 1 for x in train)
    assert summary["max_abs_logprob_diff"] == 0.0
    assert {"eval_reward_before", "eval_reward_after"} <= set(summary)
    lanes = {i["lane"] for i in json.loads((run_dir / "timeline.json").read_text())}
    assert "trainer" in lanes and {"replica:gen0", "replica:gen1"} <= lanes, lanes
    import titan_models

    model = titan_models.from_hf(run_dir / "hf")  # the trained weights, whole
    assert sum(p.numel() for p in model.parameters()) > 0


def test_titan_train_rl_subcommand_reaches_the_rl_cli(capsys):
    from titan_train.cli import main as cli_main

    assert cli_main(["rl", "--recipe", "nope"]) == 2
    assert "RL recipes: arith_grpo" in capsys.readouterr().err
