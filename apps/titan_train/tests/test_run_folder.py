"""Run-folder rules, the numerics guard and input validation: a run never loses a checkpoint
by mistake, says what changed on resume, never trains on (or exits 0 after) a non-finite
step, and rejects bad input with one line before writing anything."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import titan_train.trainer as trainer_module
from titan_train.cli import main, parse_config
from titan_train.errors import NonFiniteError
from titan_train.trainer import train

COMMON = [
    "--name", "run", "--training.batch-size", "2", "--training.seq-len", "32",
    "--lr-schedule.warmup-steps", "0", "--lr-schedule.decay", "constant",
    "--metrics.log-every", "1", "--metrics.validate-every", "0", "--metrics.no-tensorboard",
    "--metrics.peak-flops", "1e11", "--checkpoint.async-mode", "off",
]  # fmt: skip


def _argv(tmp_path, *extra: str) -> list[str]:
    return ["--output-dir", str(tmp_path), *COMMON, *extra]


def _records(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _tree(path) -> dict:
    return {p: p.stat().st_mtime_ns for p in path.rglob("*")}


def test_fresh_start_over_checkpoints_needs_overwrite_which_archives_them(tmp_path, capsys):
    ckpt = ["--training.steps", "2", "--checkpoint.interval", "2"]
    assert main(_argv(tmp_path, *ckpt)) == 0
    run = tmp_path / "run"
    before = _tree(run)
    capsys.readouterr()
    assert main(_argv(tmp_path, *ckpt, "--checkpoint.no-resume")) == 2
    err = capsys.readouterr().err.strip()
    assert "already holds checkpoints (latest complete step 2)" in err and "--overwrite" in err
    assert len(err.splitlines()) == 1 and _tree(run) == before  # nothing touched
    assert main(_argv(tmp_path, *ckpt, "--checkpoint.no-resume", "--overwrite")) == 0
    (archived,) = (run / "archive").iterdir()
    old = sorted(p.name for p in (archived / "checkpoints").iterdir() if p.name.startswith("step"))
    new = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step"))
    assert len(old) == 1 and len(new) == 1 and old != new  # both runs' checkpoints kept
    assert [r["step"] for r in _records(archived)] == [1, 2] == [r["step"] for r in _records(run)]


def test_resume_with_a_changed_config_lists_the_change_or_applies_it_when_allowed(tmp_path, capsys):
    first = _argv(tmp_path, "--training.steps", "2", "--checkpoint.interval", "2")
    assert main(first) == 0
    run = tmp_path / "run"
    before = _tree(run)
    capsys.readouterr()
    longer = _argv(tmp_path, "--training.steps", "4", "--checkpoint.interval", "2")
    assert main([*longer, "--optimizer.lr", "1e-3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "optimizer.lr: 0.003 saved, 0.001 now" in err and "training.steps: 2 saved" in err
    assert "--allow-config-change" in err and len(err.splitlines()) == 1
    assert main([*longer, "--training.seed", "7", "--allow-config-change"]) == 2
    assert "training.seed cannot change within a run" in capsys.readouterr().err
    assert _tree(run) == before
    assert main([*longer, "--optimizer.lr", "1e-3", "--allow-config-change"]) == 0
    rows = [r for r in _records(run) if r["split"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # the constant schedule's peak
    assert [r["lr"] for r in rows] == [3e-3, 3e-3, 1e-3, 1e-3]
    saved = json.loads((run / "config.json").read_text())
    assert saved["optimizer"]["lr"] == 1e-3 and saved["training"]["steps"] == 4
    (change,) = saved["history"]
    assert change["step"] == 2
    assert change["changes"]["optimizer.lr"] == {"from": 3e-3, "to": 1e-3}


def test_replayed_steps_are_logged_once(tmp_path):
    cfg = parse_config(_argv(tmp_path, "--training.steps", "5", "--checkpoint.interval", "2"))
    train(cfg, stop_after=3)  # steps 1-3 logged, checkpoint at 2: step 3 runs again
    out = train(cfg)
    assert [r["step"] for r in _records(out["run_dir"])] == [1, 2, 3, 4, 5]


def _poison_steps(monkeypatch, steps: set[int]) -> None:
    """Make the loss of the given (1-based) steps NaN, as a bad batch or an overflow would."""
    real, calls = trainer_module.loss_sum, [0]

    def loss_sum(model, batch):
        calls[0] += 1
        loss = real(model, batch)
        return loss * float("nan") if calls[0] in steps else loss

    monkeypatch.setattr(trainer_module, "loss_sum", loss_sum)


def test_non_finite_step_stops_the_run_naming_it_and_is_never_checkpointed(
    tmp_path, monkeypatch, capsys
):
    _poison_steps(monkeypatch, {3})
    argv = _argv(tmp_path, "--training.steps", "6", "--checkpoint.interval", "1")
    argv += ["--metrics.log-every", "2"]  # found at the log step after it (no per-step read)
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("titan-train: error: step 3: the loss is nan") and "skip-nonfinite" in err
    steps = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert [s[:17] for s in steps if s.startswith("step")] == [
        "step-000000000001",
        "step-000000000002",
    ]


def test_skip_nonfinite_skips_up_to_n_updates_then_stops(tmp_path, monkeypatch):
    _poison_steps(monkeypatch, {2})
    argv = _argv(tmp_path, "--training.steps", "4", "--training.skip-nonfinite", "1")
    skipped = train(parse_config([*argv, "--name", "skipped"]))
    assert skipped["step"] == 4 and all(x == x for x in skipped["losses"][2:])
    before = {k: v.clone() for k, v in skipped["model"].state_dict().items()}
    assert all(torch.isfinite(v).all() for v in before.values())
    _poison_steps(monkeypatch, {2, 3})
    with pytest.raises(NonFiniteError, match=r"step 3: .* again \(2 steps skipped: \[2, 3\]"):
        train(parse_config([*argv, "--name", "stopped"]))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--optimizer.lr", "inf"], "optimizer.lr=inf must be a finite number > 0"),
        (["--optimizer.lr", "nan"], "optimizer.lr=nan must be a finite number > 0"),
        (["--optimizer.betas", "2", "-1"], "optimizer.betas[0]=2.0 must be in [0, 1)"),
        (["--optimizer.weight-decay", "-50"], "optimizer.weight_decay=-50.0 must be"),
        (["--training.max-grad-norm", "nan"], "training.max_grad_norm=nan must be"),
        (["--metrics.peak-flops", "-1"], "metrics.peak_flops=-1.0 must be > 0"),
        (["--training.seq-len", "100000000"], "exceeds the model's max_seq_len"),
        (["--data.tokenizer", "/etc/passwd"], "data.tokenizer='/etc/passwd' is not a"),
        (["--training.skip-nonfinite", "-1"], "training.skip_nonfinite=-1 must be >= 0"),
    ],
)
def test_bad_numbers_and_files_are_one_line_before_any_file(tmp_path, capsys, argv, message):
    assert main(["--output-dir", str(tmp_path), "--training.steps", "1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def test_a_second_job_on_a_run_folder_in_use_fails_at_once(tmp_path, capsys):
    from titan_train.run_folder import RunLock

    lock = RunLock(tmp_path / "run")  # as the first job's rank 0 holds it
    try:
        assert main(_argv(tmp_path, "--training.steps", "1")) == 2
        err = capsys.readouterr().err.strip()
        assert "is in use by another job (pid" in err and len(err.splitlines()) == 1, err
    finally:
        lock.release()
    assert main(_argv(tmp_path, "--training.steps", "1")) == 0


WATCHDOG = textwrap.dedent(
    """
    import time
    from titan_train.watchdog import StepWatchdog
    dog = StepWatchdog(0.5, rank=1, poll_s=0.1)
    dog.beat(7)
    time.sleep(30)  # a stuck step
    """
)


def test_step_watchdog_ends_a_stuck_rank_with_a_clear_error():
    proc = subprocess.run(
        [sys.executable, "-c", WATCHDOG], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3
    assert "rank 1 made no progress for 1 s after step 7" in proc.stderr
    assert "time.sleep" in proc.stderr or "File" in proc.stderr  # the stacks


def test_the_header_and_closing_line_say_what_runs_and_where_results_are(tmp_path, capsys):
    # Guards: nothing printed before the first log step, and no line said where results were;
    # a resume and the archiving of an earlier run went unannounced.
    argv = _argv(tmp_path, "--training.steps", "2", "--checkpoint.interval", "1")
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("titan-train: run: llama3 debug, ") and "M parameters" in out[0]
    assert "1 process (dp_shard=1) on cpu" in out[0]
    assert out[1].strip().startswith("2 steps of 2 x 32 tokens") and "every 1 steps" in out[1]
    assert out[2].strip() == f"run folder {tmp_path / 'run'}: a fresh start"
    assert out[-1].startswith("titan-train: done at step 2 (loss ")
    assert out[-1].endswith(
        f"results in {tmp_path / 'run'}/ (metrics.jsonl, loss.png, checkpoints)"
    )
    longer = _argv(tmp_path, "--training.steps", "3", "--checkpoint.interval", "1")
    assert main([*longer, "--allow-config-change"]) == 0
    assert "resuming from the step-2 checkpoint" in capsys.readouterr().out
    assert main([*longer, "--checkpoint.no-resume", "--overwrite"]) == 0
    (archived,) = (tmp_path / "run" / "archive").iterdir()
    assert f"a fresh start; the previous run's outputs were moved to {archived}" in (
        capsys.readouterr().out
    )


def test_rerunning_a_finished_run_says_so_and_touches_nothing(tmp_path, capsys):
    # Guards: a rerun of a finished run trained nothing yet redrew loss.png blank.
    argv = _argv(tmp_path, "--training.steps", "2")  # checkpoints on by default
    assert main(argv) == 0
    run = tmp_path / "run"
    assert [p.name[:17] for p in (run / "checkpoints").iterdir() if p.name.startswith("step")] == [
        "step-000000000002"  # the last step is saved whatever the interval
    ]
    outputs = lambda: {p: t for p, t in _tree(run).items() if p.name != ".titan-train.lock"}  # noqa: E731
    before = outputs()
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"titan-train: {run} already finished (checkpoint at step 2 of 2)")
    assert len(out.splitlines()) == 1 and outputs() == before
