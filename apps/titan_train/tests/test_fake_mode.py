"""Fake-backend mode: one CPU process runs real steps of a rank of a job of any size on the
recipe's device type, with nothing allocated or communicated, and writes ``memory.json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from titan_train.cli import main, parse_config
from titan_train.fake import run_fake

DEBUG = ["--training.batch-size", "4", "--training.seq-len", "64", "--training.steps", "2"]


def _fake(tmp_path, *argv: str, recipe: str = "llama3_debug") -> dict:
    out = run_fake(parse_config(["--output-dir", str(tmp_path), *DEBUG, *argv], recipe))
    return json.loads((out["run_dir"] / "memory.json").read_text())


def test_debug_recipe_runs_dp2_x_tp2_steps_on_a_fake_cuda_mesh(tmp_path):
    report = _fake(
        tmp_path, "--comm.fake-world-size", "4", "--parallel.dp-shard", "2", "--parallel.tp", "2"
    )
    assert report["device_type"] == "cuda" and report["world_size"] == 4
    (rank0,) = report["stages"]
    # Every piece of the model this rank holds, a quarter of it (norms are replicated over tp).
    model_bytes = report["parameters"] * 4
    assert rank0["params_bytes"] == pytest.approx(model_bytes / 4, rel=0.01)
    assert rank0["grads_bytes"] == rank0["params_bytes"]
    assert rank0["optimizer_bytes"] == 2 * rank0["params_bytes"]  # AdamW's two moments
    assert rank0["activations_peak_bytes"] > 0 and rank0["gathered_params_peak_bytes"] > 0


def test_a_cpu_tensor_reaching_the_step_raises(monkeypatch):
    # The step must only see tensors on the training device: a batch left on the host raises
    # in fake mode (as it would on a GPU), where a real CPU run would not notice.
    from titan_train.build import build_loaders, resolve
    from titan_train.data.packing import Batch
    from titan_train.fake import _run_rank

    cfg = parse_config([*DEBUG, "--comm.fake-world-size", "2", "--parallel.dp-shard", "2"])
    job = resolve(cfg)
    batches = [next(build_loaders(job)[0])]
    monkeypatch.setattr(Batch, "to", lambda self, device: self)
    # _run_rank registers the fake fused-attention backend (it runs in a child process in a
    # real fake-mode run): keep this process's registry as it was.
    from titan_models.components import backends

    monkeypatch.setattr(backends, "_BACKENDS", dict(backends._BACKENDS))
    # torch's device check, or the host read of a host tensor (fake tensors have no value)
    with pytest.raises(RuntimeError, match="device|_local_scalar_dense"):
        _run_rank(job, 0, batches)


# DeepSeek-V4's stages send hc_mult streams and the token ids (its hash-routed layers);
# 67 s on 2 shared cores (its gloo equality test, test_pipeline_families.py, is fast).
@pytest.mark.parametrize(
    "recipe",
    [
        "qwen3_moe_debug",
        pytest.param("deepseek_v4_debug", marks=[pytest.mark.slow, pytest.mark.extended]),
    ],
)
def test_pipeline_stages_each_get_a_row_and_the_shards_add_up_to_the_model(tmp_path, recipe):
    report = _fake(
        tmp_path,
        "--comm.fake-world-size", "8",
        "--parallel.pp", "2",
        "--parallel.dp-shard", "4",
        "--parallel.ep", "2",
        "--parallel.pp-microbatches", "2",
        recipe=recipe,
    )  # fmt: skip
    assert [row["stages"] for row in report["stages"]] == [[0], [1]]
    shards = report["layout"]["dp_shard"] * report["layout"]["tp"]
    total = sum(row["params_bytes"] for row in report["stages"]) * shards
    assert total == pytest.approx(report["parameters"] * 4, rel=0.01)


@pytest.mark.slow  # ~50 s on 2 shared cores (two fake ranks, each in its own process)
@pytest.mark.extended  # CP 8 at 128K and PP in the fast suite run in CI
def test_context_parallel_composes_with_pipeline_experts_and_fsdp_at_16_ranks(tmp_path):
    # PP 2 x DP-shard 2 x CP 4, EP 4 carved out of dp_shard x cp: every stage runs its step on
    # a quarter of each sequence, and the pieces of all ranks still add up to the model.
    report = _fake(
        tmp_path,
        "--comm.fake-world-size", "16",
        "--parallel.pp", "2",
        "--parallel.dp-shard", "2",
        "--parallel.cp", "4",
        "--parallel.ep", "4",
        "--parallel.pp-microbatches", "2",
        recipe="qwen3_moe_debug",
    )  # fmt: skip
    assert report["layout"]["cp"] == 4 and report["layout"]["ep"] == 4
    assert [row["stages"] for row in report["stages"]] == [[0], [1]]
    shards = report["layout"]["dp_shard"] * report["layout"]["cp"]
    total = sum(row["params_bytes"] for row in report["stages"]) * shards
    assert total == pytest.approx(report["parameters"] * 4, rel=0.01)
    assert all(row["activations_peak_bytes"] > 0 for row in report["stages"])


def test_tensor_and_expert_parallel_share_ranks_with_context_parallel_at_8_ranks(tmp_path):
    # TP 2 x CP 2 x DP-shard 2, EP 2 carved out of dp_shard x cp x tp (each tp pair): every
    # tp rank dispatches its half of the replicated tokens (static capacity), and the pieces
    # of all ranks add up to the model (router and norms replicated over tp: under 1 %).
    report = _fake(
        tmp_path,
        "--comm.fake-world-size", "8",
        "--parallel.tp", "2",
        "--parallel.cp", "2",
        "--parallel.dp-shard", "2",
        "--parallel.ep", "2",
        recipe="qwen3_moe_debug",
    )  # fmt: skip
    layout = report["layout"]
    assert (layout["tp"], layout["cp"], layout["ep"], layout["dp_shard"]) == (2, 2, 2, 2)
    (rank0,) = report["stages"]
    total = rank0["params_bytes"] * layout["dp_shard"] * layout["cp"] * layout["tp"]
    assert total == pytest.approx(report["parameters"] * 4, rel=0.01)
    assert rank0["activations_peak_bytes"] > 0


@pytest.mark.slow
@pytest.mark.extended  # 256 fake ranks of a 70B; test_cli.py's dry run is in the fast suite
def test_dry_run_is_the_fake_backend_with_no_step(tmp_path, capsys):
    argv = ["--dry-run", "--recipe", "llama3_70b", "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    report = json.loads((tmp_path / "llama3_70b" / "memory.json").read_text())
    assert report["steps"] == 0 and report["world_size"] == 256
    assert len(report["stages"]) == 4  # one representative rank per pipeline rank
    per_rank = sum(r["params_bytes"] for r in report["stages"]) / 4
    # 70.6 B fp32 parameters over tp 8 x pp 4 x dp 8.
    assert per_rank == pytest.approx(report["parameters"] * 4 / 256, rel=0.02)
    assert "70.55 B parameters" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--comm.fake-world-size", "6", "--parallel.tp", "4"],
            "does not divide it",
        ),
        (
            ["--recipe", "qwen3_moe_debug", "--comm.fake-world-size", "6",
             "--parallel.dp-shard", "6", "--parallel.ep", "3"],
            "parallel.ep=3 must divide the model's num_experts=8",
        ),
        (
            ["--comm.fake-world-size", "4", "--parallel.dp-shard", "4", "--parallel.ep", "3"],
            "parallel.ep=3 must divide parallel.dp_shard*cp*tp = 4*1*1",
        ),
        (
            ["--recipe", "qwen3_moe_debug", "--comm.fake-world-size", "2", "--parallel.tp", "2",
             "--parallel.ep", "2", "--training.seq-len", "63"],
            "parallel.tp must divide 63",
        ),
        (["--training.device", "cuda"], "has 0 CUDA device(s)"),
        (["--nproc", "2", "--comm.fake-world-size", "8"], "cannot be combined with --nproc 2"),
    ],
)  # fmt: skip
def test_bad_layouts_and_devices_fail_with_one_line_before_allocating(capsys, argv, message):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


# Llama 3 405B at 512 ranks (TP 8 / PP 8 / DP 8: eight stage processes, ~9 min here) and
# DeepSeek-V3 671B at 256 (PP 2 / DP 128 / EP 64, ~2 min) are left to
# apps/titan_train/benchmarks/fake_scale.py to keep CI's slow step within its budget; PP x EP
# in fake mode is checked by the pipeline-stage test above (deepseek_v4_debug, qwen3_moe_debug).
FULL_SIZE = {  # recipe: (arguments, how far the shards may add up past the model)
    "gpt_oss_120b": (["--comm.fake-world-size", "64"], 0.01),  # DP 64 / EP 32 (recipe)
    # TP 4 x EP 64 on the same ranks (PP 2 / DP 32), one step: ~5 min of the slow budget; TP
    # leaves routers, shared experts and MLA latents whole on each tp rank (measured +1.6 %)
    "deepseek_v3_671b": (
        ["--comm.fake-world-size", "256", "--parallel.dp-shard", "32", "--parallel.tp", "4",
         "--training.steps", "1"],
        0.02,
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe",
    [
        pytest.param(r, marks=pytest.mark.extended) if r != "deepseek_v3_671b" else r
        for r in sorted(FULL_SIZE)
    ],
)  # CI runs the largest (DeepSeek-V3 671B at TP 4 x EP 64); `-m extended` the others
def test_full_size_recipe_runs_two_fake_steps_in_little_memory(tmp_path, recipe):
    extra, rel = FULL_SIZE[recipe]
    argv = [
        sys.executable, "-m", "titan_train", "--recipe", recipe, "--training.steps", "2",
        *extra, "--output-dir", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    subprocess.run(argv, check=True, env=env, timeout=1500)
    report = json.loads((tmp_path / recipe / "memory.json").read_text())
    assert report["peak_rss_bytes"] <= 6 * 2**30
    shards = report["layout"]["dp_shard"] * report["layout"]["cp"] * report["layout"]["tp"]
    per_stage_ranks = report["world_size"] // report["layout"]["pp"]
    assert per_stage_ranks % shards == 0
    total = sum(row["params_bytes"] for row in report["stages"]) * shards
    assert report["parameters"] * 4 * 0.99 <= total <= report["parameters"] * 4 * (1 + rel)


@pytest.mark.slow
def test_llama3_8b_at_128k_cp8_runs_few_attention_tiles_within_28_gib(tmp_path):
    """Context-parallel attention at 128K CP 8 (the default sdpa tile kernel: whole chunks,
    one fused call per tile): at most 256 tiles per layer per rank (17; 8,487 with the torch
    kernel's default tiles), and the activations of one rank stay within 28 GiB (~75 s of
    CPU)."""
    argv = [
        sys.executable, "-m", "titan_train", "--recipe", "llama3_8b",
        "--comm.fake-world-size", "8", "--parallel.cp", "8", "--parallel.dp-shard", "1",
        "--training.seq-len", "131072", "--training.steps", "1", "--checkpoint.interval", "0",
        "--remat.policy", "full", "--output-dir", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    subprocess.run(argv, check=True, env=env, timeout=1500)
    (row,) = json.loads((tmp_path / "llama3_8b" / "memory.json").read_text())["stages"]
    assert row["cp_tiles_per_layer"] <= 256, row
    assert row["activations_peak_bytes"] <= 28 * 2**30, row


def test_a_real_run_that_cannot_hold_its_shard_fails_before_allocating(capsys):
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    argv = ["--recipe", "llama3_70b", "--parallel.dp-shard", "1", "--parallel.tp", "1",
            "--parallel.pp", "1", "--training.device", "cpu"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs" in err[0] and "GiB are free" in err[0], err
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 * 1024  # KiB
