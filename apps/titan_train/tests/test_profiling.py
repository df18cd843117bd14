"""--profiling.*: a torch.profiler trace of chosen steps, the per-phase step times in
metrics.jsonl and per rank (the timeline PNG), the CPU table of the bytes each module saves
for backward, and the collective flight recorder a stalled rank writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

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
    phases = [json.loads(x) for x in (run / "profiling" / "phases_rank0.jsonl").open()]
    assert [(r["step"], r["steps"]) for r in phases] == [(1, 1), (2, 1)]
    assert phases[1]["forward_s"] == train_rows[1]["forward_s"]
    assert (run / "profiling" / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_draws_one_lane_per_rank(tmp_path):
    from titan_train.timeline import PhaseLog, draw_timeline

    for rank, slow in ((0, 1.0), (1, 3.0)):
        log = PhaseLog(tmp_path, rank, resumed_step=None)
        log.add(5, 5, {"data_s": 0.01, "forward_s": 0.1 * slow, "collectives_s": 0.05})
    assert draw_timeline(tmp_path) == tmp_path / "timeline.png"
    kept = PhaseLog(tmp_path, 0, resumed_step=4)  # a resume before the line's step drops it
    assert kept.path.read_text() == ""
    assert draw_timeline(tmp_path / "nothing") is None


def test_a_stalled_rank_writes_its_flight_record_and_stacks(tmp_path):
    # One gloo rank: an all-reduce, then no progress: the watchdog fires, the on_fire hook
    # writes torch's flight-recorder trace (the all-reduce is in it) and every thread's stack.
    script = textwrap.dedent(f"""
        import time, torch, torch.distributed as dist
        from pathlib import Path
        from titan_train import flight_recorder
        from titan_train.watchdog import StepWatchdog
        flight_recorder.enable(100)
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0,
                                world_size=1)
        dist.all_reduce(torch.ones(3))
        out = Path("{tmp_path}") / "profiling"
        StepWatchdog(0.5, poll_s=0.1,
                     on_fire=lambda: flight_recorder.dump(out, 0, "gloo", "step watchdog"))
        time.sleep(60)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_FR_BUFFER_SIZE"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    assert done.returncode == 3, done.stderr
    record = json.loads((tmp_path / "profiling" / "flight_recorder_rank0.json").read_text())
    assert record["reason"] == "step watchdog" and record["backend"] == "gloo"
    entries = record["trace"]["entries"]
    assert [e["profiling_name"] for e in entries] == ["gloo:all_reduce"]
    assert entries[0]["input_sizes"] == [[3]]
    stacks = (tmp_path / "profiling" / "stacks_rank0.txt").read_text()
    assert "most recent call first" in stacks and "in <module>" in stacks, stacks
    assert "titan-step-watchdog" in stacks or "watchdog.py" in stacks, stacks


def test_flight_recorder_is_off_without_a_buffer(tmp_path, monkeypatch):
    from titan_train import flight_recorder

    monkeypatch.delenv(flight_recorder.ENV, raising=False)
    assert flight_recorder.dump(tmp_path, 0, "gloo", "x") is None
    assert not any(tmp_path.iterdir())
    flight_recorder.enable(0)
    assert flight_recorder.ENV not in os.environ


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
