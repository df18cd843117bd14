"""End to end on gloo: ``--parallel.cp 2`` trains like one process.

A context-parallel rank holds the zig-zag chunks of every row of its data-parallel rank's
batch, so CP 2 and CP 2 x TP 2 read the data of one process: their first-step loss equals the
single-process run's, and so does the hybrid Qwen3.5's (Gated DeltaNet layers) at CP 2. CP 2 x
DP-shard 2 reads the data of DP 2: its first-step loss equals one process computing the loss of
the two ranks' batches. CP 2 x PP 2 (a dense model) and Qwen3-MoE under CP 2 x PP 2 x EP 2 read
one process's data, Qwen3-MoE under CP 2 x DP-shard 2 x EP 4 that of DP 2. Loss falls in every
layout. One spawn per world size (the composed layouts: one more); bad input is rejected by
``resolve`` before any work.
"""

from __future__ import annotations

import pytest
import torch

from titan_testing import run_distributed
from titan_train.build import build_model, resolve
from titan_train.cli import parse_config
from titan_train.loaders import loaders
from titan_train.losses import cross_entropy_sum
from titan_train.trainer import train

STEPS = 6
COMMON = [
    "--training.steps", str(STEPS),
    "--training.batch-size", "2",
    "--training.seq-len", "64",
    "--lr-schedule.warmup-steps", "2",
    "--metrics.validate-every", "0",
    "--metrics.no-tensorboard",
    "--metrics.log-every", "3",
    "--metrics.peak-flops", "1e11", "--checkpoint.interval", "0",
]  # fmt: skip
QWEN3_5 = ["--model.family", "qwen3_5", "--model.flavor", "debug"]
WORLD2 = {
    "cp2": ["--parallel.cp", "2", "--parallel.dp-shard", "1", "--metrics.validate-every", "3"],
    "cp2_allgather": [
        "--parallel.cp", "2", "--parallel.dp-shard", "1", "--parallel.cp-algorithm", "allgather",
    ],
    "cp2_torch_tiles": [
        "--parallel.cp", "2", "--parallel.dp-shard", "1", "--parallel.cp-tile-kernel", "torch",
    ],
    # Hybrid: Gated DeltaNet layers pass their state and conv inputs across the shards.
    "cp2_qwen3_5": [*QWEN3_5, "--parallel.cp", "2", "--parallel.dp-shard", "1"],
}  # fmt: skip
PP2 = ["--parallel.pp", "2", "--parallel.pp-microbatches", "2"]
MOE = ["--model.family", "qwen3_moe"]
WORLD4 = {
    "cp2_dp2": ["--parallel.cp", "2", "--parallel.dp-shard", "2"],
    "cp2_tp2": ["--parallel.cp", "2", "--parallel.tp", "2", "--parallel.dp-shard", "1"],
}  # fmt: skip
COMPOSED = {  # world 4
    "cp2_pp2": [
        "--parallel.cp", "2", *PP2, "--parallel.dp-shard", "1", "--metrics.validate-every", "3",
    ],
    # EP carved out of dp_shard x cp: inside the cp group (ep 2), across dp_shard and cp (ep 4)
    "moe_cp2_pp2_ep2": [*MOE, "--parallel.cp", "2", *PP2, "--parallel.dp-shard", "1", "--parallel.ep", "2"],
    "moe_cp2_dp2_ep4": [*MOE, "--parallel.cp", "2", "--parallel.dp-shard", "2", "--parallel.ep", "4"],
}  # fmt: skip


def _cfg(out: str, name: str, *argv: str):
    return parse_config(["--output-dir", out, "--name", name, *COMMON, *argv])


def _train_cases(out: str, cases: dict[str, list[str]]) -> dict[str, list[float]]:
    return {name: train(_cfg(out, name, *argv))["losses"] for name, argv in cases.items()}


def _validation_losses(out: str, name: str) -> list[float]:
    import json
    from pathlib import Path

    rows = map(json.loads, Path(f"{out}/{name}/metrics.jsonl").read_text().splitlines())
    return [row["loss"] for row in rows if row["split"] == "validation"]


ONE_PROCESS = ["--parallel.dp-shard", "1", "--parallel.dp-replicate", "1", "--parallel.ep", "1",
               "--parallel.tp", "1", "--parallel.pp", "1", "--parallel.cp", "1"]  # fmt: skip


def _first_step_loss_of_global_batch(out: str, dp: int, *argv: str) -> float:
    """One process, the dp ranks' first batches: the loss a DP run must log at step 1."""
    cfg = _cfg(out, "reference", *argv, *ONE_PROCESS)  # the layout's data, one process
    job = resolve(cfg)
    model = build_model(job, torch.device("cpu"))
    total, tokens = 0.0, 0
    with torch.no_grad():
        for r in range(dp):
            batch = next(loaders(cfg, job.tokenizer, dp_rank=r, dp_size=dp)[0])
            logits = model(
                batch.input_ids, positions=batch.positions, document_ids=batch.document_ids
            )
            total += float(cross_entropy_sum(logits, batch.labels))
            tokens += batch.num_target_tokens
    return total / tokens


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("cp_runs"))
    got = run_distributed(_train_cases, 2, out + "/w2", WORLD2, timeout=600)[0]
    got |= run_distributed(_train_cases, 4, out + "/w4", WORLD4, timeout=600)[0]
    got["single"] = train(_cfg(out, "single", "--metrics.validate-every", "3"))["losses"]
    got["single_qwen3_5"] = train(_cfg(out, "single_qwen3_5", *QWEN3_5))["losses"]
    got["dp2_reference_step1"] = _first_step_loss_of_global_batch(out, 2)
    got["validation"] = {n: _validation_losses(out, n) for n in ("single", "w2/cp2")}
    return got


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("cp_composed"))
    got = run_distributed(_train_cases, 4, out + "/w4", COMPOSED, timeout=600)[0]
    got["single"] = train(_cfg(out, "single", "--metrics.validate-every", "3"))["losses"]
    got["moe_single"] = train(_cfg(out, "moe_single", *MOE))["losses"]
    got["moe_dp2_reference_step1"] = _first_step_loss_of_global_batch(out, 2, *MOE)
    got["validation"] = {n: _validation_losses(out, n) for n in ("single", "w4/cp2_pp2")}
    return got


def _falls(losses: list[float]) -> None:
    assert len(losses) == STEPS
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.slow
def test_context_parallel_layouts_train_like_one_process(runs):
    single = runs["single"]
    _falls(single)
    for name in ("cp2", "cp2_allgather", "cp2_torch_tiles", "cp2_tp2"):
        assert abs(runs[name][0] - single[0]) <= 1e-5, (name, runs[name][0], single[0])
        _falls(runs[name])
        # The same tokens and updates with attention split over ranks: close every step.
        torch.testing.assert_close(runs[name], single, rtol=0, atol=5e-3)
    hybrid, single_hybrid = runs["cp2_qwen3_5"], runs["single_qwen3_5"]
    assert abs(hybrid[0] - single_hybrid[0]) <= 1e-5, (hybrid[0], single_hybrid[0])
    _falls(hybrid)
    torch.testing.assert_close(hybrid, single_hybrid, rtol=0, atol=5e-3)
    assert abs(runs["cp2_dp2"][0] - runs["dp2_reference_step1"]) <= 1e-5
    _falls(runs["cp2_dp2"])
    # Validation sums every shard's tokens over the context-parallel group.
    val = runs["validation"]
    assert len(val["single"]) == 2
    torch.testing.assert_close(val["w2/cp2"], val["single"], rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.extended  # CP with EP: test_tensor_expert_parallel.py's 8 ranks run in CI
def test_context_parallel_composes_with_pipeline_and_expert_parallelism(composed):
    runs = composed
    # CP 2 x PP 2: each stage runs on the local half of every sequence (both microbatches);
    # the stage's cp group is the cp axis at its pipeline position.
    single = runs["single"]
    assert abs(runs["cp2_pp2"][0] - single[0]) <= 1e-5, (runs["cp2_pp2"][0], single[0])
    _falls(runs["cp2_pp2"])
    torch.testing.assert_close(runs["cp2_pp2"], single, rtol=0, atol=5e-3)
    val = runs["validation"]  # the pipeline's forward-only schedule on shards
    torch.testing.assert_close(val["w4/cp2_pp2"], val["single"], rtol=0, atol=1e-5)
    # Qwen3-MoE with EP inside the cp group (and PP 2): one process's data.
    moe = runs["moe_cp2_pp2_ep2"]
    assert abs(moe[0] - runs["moe_single"][0]) <= 1e-5, (moe[0], runs["moe_single"][0])
    _falls(moe)
    torch.testing.assert_close(moe, runs["moe_single"], rtol=0, atol=5e-3)
    # EP 4 across dp_shard 2 x cp 2: the data of DP 2.
    moe = runs["moe_cp2_dp2_ep4"]
    assert abs(moe[0] - runs["moe_dp2_reference_step1"]) <= 1e-5
    _falls(moe)


@pytest.mark.parametrize(
    ("argv", "world", "message"),
    [
        (
            ["--parallel.cp", "3"],
            3,
            "training.seq_len=128 must be divisible by 2 * parallel.cp = 6",
        ),
        (
            ["--parallel.cp", "2", "--model.attention-backend", "sdpa"],
            2,
            "model.attention_backend='sdpa' cannot attend across the shards of parallel.cp=2",
        ),
        (
            ["--model.family", "qwen3_moe", "--parallel.cp", "2", "--parallel.ep", "4"],
            2,
            "parallel.ep=4 must divide parallel.dp_shard*cp*tp = 1*2*1",
        ),
        (
            ["--parallel.cp", "2", "--remat.policy", "selective"],
            2,
            "parallel.cp=2 does not compose with remat.policy='selective' yet",
        ),
        (
            ["--model.family", "deepseek_v4", "--parallel.cp", "2"],
            2,
            "parallel.cp=2 is not supported by deepseek_v4 debug: the model's attention cannot "
            "be split over a sequence yet",
        ),
        (
            ["--model.family", "qwen3_5", "--parallel.cp", "4", "--training.seq-len", "16"],
            4,
            "parallel.cp=4 splits training.seq_len=16 into chunks of 2 tokens, shorter than "
            "the model's smallest context-parallel chunk of 3 tokens",
        ),
    ],
)
def test_bad_context_parallel_config_is_one_clear_error_before_work(argv, world, message, tmp_path):
    with pytest.raises(ValueError) as info:  # the CLI's parse, then the job's checks
        resolve(parse_config(["--output-dir", str(tmp_path), *argv]), world_size=world)
    assert message in str(info.value)
    assert not any(tmp_path.iterdir())
