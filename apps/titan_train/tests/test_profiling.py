"""--profiling.*: a torch.profiler trace of chosen steps, the per-phase step times in
metrics.jsonl, and the CPU table of the bytes each module saves for backward."""

from __future__ import annotations

import json

import pytest

from titan_train.cli import main, parse_config
from titan_train.trainer import train

FAST = ["--training.steps", "2", "--training.batch-size", "2", "--training.seq-len", "32",
        "--metrics.log-every", "1", "--metrics.validate-every", "2", "--checkpoint.interval", "2",
        "--metrics.no-tensorboard"]  # fmt: skip


def test_a_trace_the_phase_times_and_the_activation_table(tmp_path):
    argv = ["--output-dir", str(tmp_path), "--name", "p", *FAST]
    out = train(
        parse_config([*argv, "--profiling.trace-steps", "1:2", "--profiling.memory-snapshot"])
    )
    run = out["run_dir"]
    trace = json.loads((run / "profiling" / "trace_rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"data", "forward", "backward", "optimizer", "checkpoint", "validation"} <= names
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert len(train_rows) == 2
    for r in train_rows:
        assert all(r[f"{k}_s"] > 0 for k in ("data", "forward", "backward", "optimizer")), r
    table = json.loads((run / "profiling" / "activation_memory_rank0.json").read_text())
    layers = [k for k in table["modules"] if k.startswith("layers.")]
    assert layers and table["total_bytes"] == sum(table["modules"].values()) > 0
    assert (run / "profiling" / "activation_memory_rank0.txt").read_text().startswith("module")


@pytest.mark.parametrize("steps", ["3:1", "0:2", "a:b"])
def test_a_bad_trace_range_is_one_error_line(steps, tmp_path, capsys):
    argv = ["--output-dir", str(tmp_path), *FAST, "--profiling.trace-steps", steps]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"titan-train: error: profiling.trace_steps={steps!r} must read 'a:b' with 1 <= a <= b "
        "(steps, 1-based)"
    ]
    assert not any(tmp_path.iterdir())
