"""Fault tolerance through torchft: replica groups that drop a lost group, heal a restarted
one from a live peer, equal plain HSDP bitwise without a failure; DiLoCo's fewer syncs; the
lighthouse unreachable. Multi-process runs are ``slow`` (2 to 4 processes on shared cores)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_train.cli import parse_config
from titan_train.fault_tolerance import (
    FaultTolerance,
    _first_line,
    _replica_index,
    replica_config,
)
from titan_train.replicas import _without_own_flags

ARGS = [
    "--training.batch-size", "2", "--training.seq-len", "32", "--metrics.log-every", "1",
    "--metrics.validate-every", "0", "--metrics.no-tensorboard", "--metrics.peak-flops", "1e11",
    "--checkpoint.interval", "0",
]  # fmt: skip


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def _titan(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "titan_train", *argv],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
    )


# --- config and helpers -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fault-tolerance.replica-id", "2", "--fault-tolerance.group-size", "2"], "in [0, "),
        (["--fault-tolerance.min-replicas", "3", "--fault-tolerance.group-size", "2"], "in [1, "),
        (["--parallel.tp", "2"], "not with parallel.tp=2"),
        (["--parallel.dp-replicate", "2"], "the groups are the replicate axis"),
        (["--fault-tolerance.sync-steps", "5", "--training.skip-nonfinite", "2"], "DiLoCo"),
    ],
)
def test_config_rejects_what_fault_tolerance_cannot_run(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_config(["--fault-tolerance.enable", *argv])


def test_each_replica_group_has_its_own_run_folder():
    cfg = parse_config(["--fault-tolerance.enable", "--fault-tolerance.replica-id", "1",
                        "--fault-tolerance.group-size", "2", "--output-dir", "out"])  # fmt: skip
    mine = replica_config(cfg)
    assert (mine.output_dir, mine.name) == (str(Path("out") / "llama3_debug"), "replica-1")
    assert replica_config(mine) is mine  # applied once
    assert replica_config(parse_config([])).name == "llama3_debug"  # off: unchanged


def test_helpers():
    assert _replica_index("replica_12:4f3c-uuid") == 12
    assert _without_own_flags(
        ["--nproc", "2", "--fault-tolerance.local-replicas", "2", "--fault-tolerance.local-replicas=3", "x"]
    ) == ["--nproc", "2", "x"]  # fmt: skip
    gloo = "[/src/gloo/transport/tcp/pair.cc:545] Read error: Connection reset by peer"
    assert _first_line(RuntimeError(gloo)) == "Read error: Connection reset by peer"


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_outer_optimizer_plain_averaging_or_nesterov(momentum):
    from titan_train.fault_tolerance import outer_optimizer
    from titan_train.fault_tolerance_config import FaultToleranceConfig

    p = torch.nn.Parameter(torch.ones(3))
    ft = FaultToleranceConfig(outer_lr=1.0, outer_momentum=momentum)
    opt = outer_optimizer([p], ft)
    assert opt.param_groups[0]["nesterov"] == (momentum > 0)
    p.grad = torch.full((3,), 0.25)  # the pseudo-gradient: synced weights - averaged weights
    opt.step()
    expected = 0.75 if momentum == 0 else 1 - 0.25 * (1 + momentum)  # Nesterov's first step
    torch.testing.assert_close(p.detach(), torch.full((3,), expected), rtol=0, atol=1e-7)


def test_a_healed_group_skips_exactly_the_batches_it_trained():
    ft = object.__new__(FaultTolerance)  # only the data-position bookkeeping
    ft.replica_id, ft.loader, ft._batch = 1, iter(range(100)), None
    ft.consumed = torch.tensor([0, 3])  # its own checkpoint: 3 batches trained
    ft._seek(torch.tensor([12, 8]))  # the peer's table: it trained 8 before it died
    assert next(ft.loader) == 5 and ft.consumed.tolist() == [12, 8]
    ft.loader, ft._batch = iter(range(100)), "kept"  # a discarded step's batch, not counted
    ft.consumed = torch.tensor([0, 4])
    ft._seek(torch.tensor([5, 4]))
    assert ft._batch == "kept" and next(ft.loader) == 0


def test_lighthouse_subcommand_help():
    out = _titan(["lighthouse", "--help"])
    assert out.returncode == 0 and "--min-replicas" in out.stdout


# --- one process ----------------------------------------------------------------------------


@pytest.mark.slow  # two short runs in this process
def test_one_replica_group_trains_like_a_plain_run_and_logs_its_quorum(tmp_path):
    from torchft._torchft import LighthouseServer

    from titan_train.trainer import train

    argv = [*ARGS, "--training.steps", "3", "--output-dir", str(tmp_path)]
    plain = train(parse_config([*argv, "--name", "plain"]))
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    try:
        ft = ["--fault-tolerance.enable", "--fault-tolerance.lighthouse", lighthouse.address()]
        tolerant = train(parse_config([*argv, "--name", "ft", *ft]))
    finally:
        lighthouse.shutdown()
    assert tolerant["losses"] == plain["losses"]  # one group: nothing summed, bitwise
    rows = _metrics(tmp_path / "ft" / "replica-0")
    assert [(r["live_replicas"], r["replica_syncs"], r["heals"]) for r in rows] == [
        (1, 1, 0),
        (1, 2, 0),
        (1, 3, 0),
    ]
    assert rows[0]["quorum_id"] >= 1


@pytest.mark.slow  # three short runs in this process
@pytest.mark.parametrize("sync_steps", [1, 2])
def test_a_replica_group_resumes_bitwise_after_a_full_stop(tmp_path, sync_steps):
    # DiLoCo (sync_steps 2) stops between syncs: its last synced weights, its outer optimizer
    # and its inner-step count come back from the checkpoint.
    from torchft._torchft import LighthouseServer

    from titan_train.trainer import train

    argv = [*ARGS, "--training.steps", "5", "--output-dir", str(tmp_path),
            "--checkpoint.interval", "3", "--fault-tolerance.enable",
            "--fault-tolerance.sync-steps", str(sync_steps)]  # fmt: skip
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    try:
        argv += ["--fault-tolerance.lighthouse", lighthouse.address()]
        whole = train(parse_config([*argv, "--name", "whole"]))["losses"]
        first = train(parse_config([*argv, "--name", "stopped"]), stop_after=3)["losses"]
        rest = train(parse_config([*argv, "--name", "stopped"]))["losses"]
    finally:
        lighthouse.shutdown()
    assert first + rest == whole


def test_an_unreachable_lighthouse_is_one_line_within_the_timeout(tmp_path, capsys):
    from titan_train.cli import main

    argv = [*ARGS, "--training.steps", "2", "--output-dir", str(tmp_path),
            "--model.config", "num_layers=1", "dim=64", "--fault-tolerance.enable",
            "--fault-tolerance.lighthouse", "http://127.0.0.1:9",
            "--fault-tolerance.timeout-s", "2"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(
        "titan-train: error: replica 0: cannot reach the torchft lighthouse at "
        "http://127.0.0.1:9 within --fault-tolerance.timeout-s 2 ("
    ), lines[0]


# --- several replica groups (slow) ----------------------------------------------------------


def _hf(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(f)
    return out


@pytest.mark.slow  # 2 replica groups, then 2 torchrun ranks: ~2 min on 2 shared cores
@pytest.mark.extended  # CI runs the kill-and-heal test of 2 groups
@pytest.mark.timeout(1800)
def test_without_a_failure_two_replica_groups_equal_hsdp_bitwise(tmp_path):
    argv = [*ARGS, "--training.steps", "4", "--output-dir", str(tmp_path), "--checkpoint.export-hf"]
    ft = _titan([*argv, "--name", "ft", "--fault-tolerance.local-replicas", "2",
                 "--fault-tolerance.min-replicas", "2"])  # fmt: skip
    assert ft.returncode == 0, ft.stdout[-3000:] + ft.stderr[-3000:]
    hsdp = _titan([*argv, "--name", "hsdp", "--nproc", "2", "--parallel.dp-replicate", "2",
                   "--parallel.dp-shard", "1"])  # fmt: skip
    assert hsdp.returncode == 0, hsdp.stderr[-3000:]
    want = [(r["loss"], r["grad_norm"]) for r in _metrics(tmp_path / "hsdp")]
    reference = _hf(tmp_path / "hsdp" / "hf")
    for i in (0, 1):
        rows = _metrics(tmp_path / "ft" / f"replica-{i}")
        assert [(r["loss"], r["grad_norm"]) for r in rows] == want
        assert [r["live_replicas"] for r in rows] == [2] * 4
        assert [r["replica_syncs"] for r in rows] == [1, 2, 3, 4]  # one per step
        got = _hf(tmp_path / "ft" / f"replica-{i}" / "hf")
        assert got.keys() == reference.keys()
        assert all(torch.equal(got[k], reference[k]) for k in reference)


def _kill_replica_1_at_step_10(tmp_path: Path, extra: list[str], ranks: int) -> None:
    """Kill replica 1 (every rank, SIGKILL) in step 10; stop the job (Ctrl-C) three steps
    after it healed; check replica 0 never stopped, the data position, the heal."""
    argv = [*ARGS, "--training.steps", "500", "--output-dir", str(tmp_path),
            "--fault-tolerance.local-replicas", "2", *extra]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TITAN_FT_FAULT": "1:10"}
    env["TITAN_FT_HEAL_CHECK"] = "1"
    proc = subprocess.Popen(
        [sys.executable, "-m", "titan_train", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    killed = heal = None
    try:
        for line in proc.stdout:
            lines.append(line)
            if "titan-train: replica 1 exited" in line:
                killed = line
            m = re.search(
                r"replica 1: healed from replica 0 at step (\d+): .* position (\d+) ", line
            )
            if m and killed:
                heal = int(m[1]), int(m[2])
            if heal and f"[replica 0] train step {heal[0] + 3:>5}/" in line:
                proc.send_signal(signal.SIGINT)
                break
        rest, _ = proc.communicate(timeout=600)
        lines.append(rest)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    assert heal is not None, out[-5000:]
    assert proc.returncode == 130, out[-5000:]
    assert "replica 0 exited" not in out  # replica 0 was never restarted
    assert "restart 1/3" in killed
    step, position = heal
    root = tmp_path / "llama3_debug"
    rows = _metrics(root / "replica-0")  # from its first step (or the one after it healed,
    steps = [r["step"] for r in rows]  # when replica 1 formed the first quorum alone)
    assert steps[0] < 10 and steps == list(range(steps[0], steps[0] + len(steps)))  # none lost
    live = {r["step"]: r["live_replicas"] for r in rows}
    assert live[10] == 1 and live[step + 1] == 2  # dropped, then back
    # The data position replica 1 resumed at: the steps its first life committed (its
    # metrics, moved aside when it restarted).
    (first_life,) = (root / "replica-1" / "archive").glob("*/metrics.jsonl")
    assert position == sum(1 for r in _metrics(first_life.parent) if r["step"] < 10)
    # Weights and optimizer state equal after the first step it trained again.
    for rank in range(ranks):
        name = f"heal-check-step-{step + 1}-rank-{rank}.pt"
        a = torch.load(root / "replica-0" / name, weights_only=True)
        b = torch.load(root / "replica-1" / name, weights_only=True)
        assert a["model"].keys() == b["model"].keys()
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        sa, sb = a["optim"]["state"], b["optim"]["state"]
        assert sa.keys() == sb.keys() and len(sa) > 0
        assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    losses = {r["step"]: r["loss"] for r in rows}
    before = [losses[s] for s in range(step - 4, step + 1)]
    assert losses[step + 1] <= max(before) + 0.25  # no jump when it rejoins


@pytest.mark.slow  # 2 replica groups and a restart: minutes on 2 shared cores
@pytest.mark.timeout(3000)
def test_kill_one_of_two_replica_groups_it_heals_from_the_live_one(tmp_path):
    _kill_replica_1_at_step_10(tmp_path, [], ranks=1)


@pytest.mark.slow  # 2 replica groups x 2 torchrun ranks (FSDP inside each) and a restart
@pytest.mark.extended  # the 1-rank groups' kill runs in CI
@pytest.mark.timeout(3000)
def test_kill_one_of_two_sharded_replica_groups(tmp_path):
    _kill_replica_1_at_step_10(tmp_path, ["--nproc", "2", "--parallel.dp-shard", "2"], ranks=2)


@pytest.mark.slow  # 2 replica groups: ~2 min on 2 shared cores
@pytest.mark.extended  # DiLoCo's resume between syncs runs in CI
@pytest.mark.timeout(1800)
def test_diloco_syncs_once_every_h_steps(tmp_path):
    argv = [*ARGS, "--training.steps", "10", "--output-dir", str(tmp_path),
            "--fault-tolerance.local-replicas", "2", "--fault-tolerance.min-replicas", "2",
            "--fault-tolerance.sync-steps", "5"]  # fmt: skip
    out = _titan(argv)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for i in (0, 1):
        rows = _metrics(tmp_path / "llama3_debug" / f"replica-{i}")
        syncs = [r["replica_syncs"] for r in rows]
        assert syncs == [0, 0, 0, 0, 1, 1, 1, 1, 1, 2]  # 5x fewer than one per step
        assert [r["live_replicas"] for r in rows][4:] == [2] * 6
