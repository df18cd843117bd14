"""Ctrl-C: the run stops between steps, saves (one process) or names its last checkpoint
(torchrun ranks), prints one line saying where a rerun resumes, exits 130 with no traceback,
and the same command resumes from there."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

ARGS = [
    "--training.steps", "10", "--training.batch-size", "2", "--training.seq-len", "32",
    "--metrics.log-every", "2", "--metrics.validate-every", "0", "--metrics.no-tensorboard",
    "--metrics.peak-flops", "1e11", "--checkpoint.interval", "3",
]  # fmt: skip


def _interrupt_after(argv: list[str], line: str) -> tuple[int, str, str]:
    """Run ``titan-train argv``; send SIGINT once stdout shows ``line``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "titan_train", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    out = []
    try:
        for text in proc.stdout:
            out.append(text)
            if line in text:
                proc.send_signal(signal.SIGINT)
                break
        rest, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, "".join(out) + rest, err


def _check(rc: int, err: str, *, saved_at_stop: bool) -> int:
    assert rc == 130, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    ours = [x for x in err.splitlines() if x.startswith("titan-train")]
    assert len(ours) == 1, err[-2000:]
    m = re.fullmatch(
        r"titan-train: interrupted at step (\d+); rerun the same command to resume from step (\d+)",
        ours[0],
    )
    assert m, ours[0]
    step, resume = int(m[1]), int(m[2])
    assert 4 <= step < 10
    if saved_at_stop:
        assert resume == step  # one process saves where it stopped
    else:
        assert resume % 3 == 0 and resume <= step  # the last periodic checkpoint
    return resume


def test_ctrl_c_on_one_process_saves_says_where_to_resume_and_the_rerun_resumes(tmp_path):
    # Guards: Ctrl-C lost everything (checkpoints off) and printed two chained tracebacks.
    argv = ["--output-dir", str(tmp_path), *ARGS]
    rc, _, err = _interrupt_after(argv, "step     4/10")
    resume = _check(rc, err, saved_at_stop=True)
    again = subprocess.run(
        [sys.executable, "-m", "titan_train", *argv], capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resuming from the step-{resume} checkpoint" in again.stdout
    assert "done at step 10" in again.stdout


@pytest.mark.slow  # two torchrun ranks, ~60 s on 2 shared cores
@pytest.mark.extended  # the one-process Ctrl-C (fast suite) and chaos's kill / stop of a rank run in CI
def test_ctrl_c_under_nproc_names_the_last_checkpoint_and_exits_130(tmp_path):
    argv = ["--output-dir", str(tmp_path), *ARGS, "--nproc", "2", "--parallel.dp-shard", "2"]
    rc, _, err = _interrupt_after(argv, "step     4/10")
    resume = _check(rc, err, saved_at_stop=False)
    again = subprocess.run(
        [sys.executable, "-m", "titan_train", *argv], capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resuming from the step-{resume} checkpoint" in again.stdout
