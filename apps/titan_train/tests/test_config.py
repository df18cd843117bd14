"""Recipes, CLI overrides, LR schedules and config validation."""

from __future__ import annotations

import itertools

import pytest

from titan_train.cli import main, parse_config
from titan_train.config import LRScheduleConfig
from titan_train.lr_schedule import lr_factor
from titan_train.recipes import get_recipe, list_recipes


def test_every_recipe_builds_and_validates():
    for name in list_recipes():
        cfg = parse_config([], name)
        assert cfg.name == name


def test_cli_overrides_nested_fields_with_both_spellings():
    cfg = parse_config(
        ["--optimizer.lr", "3e-4", "--parallel.tp", "2", "--training.batch_size", "4"]
    )
    assert (cfg.optimizer.lr, cfg.parallel.tp, cfg.training.batch_size) == (3e-4, 2, 4)
    assert parse_config(["--training.batch-size", "4"]).training.batch_size == 4
    # Defaults come from the chosen recipe, not from the dataclass.
    assert parse_config([], "qwen3_debug").model.family == "qwen3"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--recipe", "nope"], "unknown; recipes"),
        (["--training.batch_size", "3", "--training.grad_accum", "2"], "divisible"),
        (["--parallel.cp", "3"], "must be divisible by 2 * parallel.cp = 6"),
        (["--optimizer.lr", "-1"], "optimizer.lr"),
        (
            ["--model.attention_backend", "dense"],
            "model.attention_backend='dense' is not one of ['auto', 'context_parallel', 'flex', 'sdpa', 'varlen']",
        ),
    ],
)
def test_bad_config_is_one_clear_error_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_wrong_type_and_unknown_field_are_rejected():
    with pytest.raises(SystemExit):
        parse_config(["--optimizer.lr", "abc"])
    with pytest.raises(SystemExit):
        parse_config(["--optimizer.not_a_field", "1"])


def test_list_recipes_and_print_config(capsys):
    assert main(["--list-recipes"]) == 0
    assert "llama3_debug" in capsys.readouterr().out
    assert main(["--print-config", "--optimizer.lr", "0.5"]) == 0
    assert '"lr": 0.5' in capsys.readouterr().out


@pytest.mark.parametrize("decay", ["cosine", "linear", "wsd", "constant"])
def test_lr_schedule_warms_up_then_decays_to_the_floor(decay):
    cfg = LRScheduleConfig(warmup_steps=10, decay=decay, min_lr_ratio=0.1)
    f = [lr_factor(s, 100, cfg) for s in range(100)]
    assert f[0] < f[5] < f[9] < 1.0 and max(f) == 1.0
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(f[10:]))
    if decay != "constant":
        assert abs(lr_factor(100, 100, cfg) - 0.1) < 1e-9
    if decay == "wsd":
        assert f[70] == 1.0 and f[90] < 1.0


def test_recipe_returns_a_fresh_config_each_time():
    a = get_recipe("llama3_debug")
    a.optimizer.lr = 123.0
    assert get_recipe("llama3_debug").optimizer.lr != 123.0


def test_dry_run_rejects_a_tp_degree_that_does_not_divide_the_heads(capsys):
    assert (
        main(
            ["--dry-run", "--recipe", "llama3_8b", "--parallel.tp", "3", "--parallel.dp-shard", "1"]
        )
        == 2
    )
    assert "parallel.tp=3 must divide the model's num_heads=32" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "world", "cp", "seq_len"),
    [("muse_spark_open_96k", 256, 4, 96 * 1024), ("muse_spark_open_192k", 512, 8, 192 * 1024)],
)
def test_muse_spark_open_recipes_resolve_to_the_seed_layouts(name, world, cp, seq_len):
    from titan_train.parallelize import ParallelDims

    cfg = get_recipe(name)
    dims = ParallelDims.resolve(cfg, world)
    assert (dims.pp, dims.dp, dims.tp, dims.cp, dims.ep) == (1, 16, 4, cp, 64)
    assert (cfg.model.family, cfg.model.flavor, cfg.training.seq_len) == (
        "muse_spark",
        "816B",
        seq_len,
    )
    assert (seq_len // cp) % 2 == 0  # whole zig-zag chunks per CP rank
