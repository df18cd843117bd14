"""The metrics logger: plain unwrapped lines when stdout is not a terminal, a loss curve that
covers the steps before a resume, and an optional W&B run (offline here)."""

from __future__ import annotations

import json
import os

import pytest

from titan_train.metrics import MetricsLogger

VALUES = {
    "loss": 4.25, "grad_norm": 1.5, "lr": 3e-4, "tokens_per_s": 12345.6, "mfu": 0.123,
    "moe_load_max": 1.2, "moe_load_mean": 1.0, "max_rss_gib": 0.8,
}  # fmt: skip


def test_piped_output_is_one_plain_line_per_record(tmp_path, capsys):
    # Guards: piped to a file, lines wrapped at 80 columns and kept the bar's characters.
    logger = MetricsLogger(tmp_path, total_steps=100, tensorboard=False)
    logger.log(10, VALUES)
    logger.log(20, {"loss": 4.0}, prefix="validation")
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and len(lines[0]) > 80
    assert lines[0].startswith("train step    10/100  loss 4.25  grad_norm 1.5")
    assert not any(c in "".join(lines) for c in "█·[]")


def test_a_resumed_run_plots_every_step_and_keeps_earlier_records(tmp_path, monkeypatch):
    # Guards: loss.png after a resume showed only the resumed steps.
    first = MetricsLogger(tmp_path, total_steps=6, tensorboard=False)
    for step in range(1, 5):
        first.log(step, {"loss": 5.0 - step})
    first.close()
    drawn = []
    monkeypatch.setattr(
        MetricsLogger, "_plot_loss", lambda self: drawn.append(self.history("train/loss"))
    )
    resumed = MetricsLogger(tmp_path, total_steps=6, tensorboard=False, resumed_step=2)
    for step in (3, 4, 5, 6):
        resumed.log(step, {"loss": 2.5 - step / 10})
    resumed.close()
    (points,) = drawn
    assert [s for s, _ in points] == [1, 2, 3, 4, 5, 6]
    assert points[:2] == [(1, 4.0), (2, 3.0)]  # from metrics.jsonl, steps 3-4 logged anew
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]


def _wandb_history(path) -> list[dict[str, str]]:
    """The history records of an offline W&B run file (a LevelDB-style log of protobuf
    ``Record``s: 32 KiB blocks, 7-byte record headers, after a 7-byte file header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, records, buf = path.read_bytes(), 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        n, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0 and n == 0:
            break
        buf += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # a full record, or the last fragment of one
            records.append(buf)
            buf = b""
    history = []
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            history.append({i.key or "/".join(i.nested_key): i.value_json for i in items})
    return history


def test_wandb_offline_run_records_the_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb = {"project": "titan-test", "name": "t", "config": {"training": {"steps": 2}}}
    logger = MetricsLogger(tmp_path, total_steps=2, tensorboard=False, wandb=wandb)
    logger.log(1, {"loss": 3.5})
    logger.log(2, {"loss": 2.25})
    logger.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")  # under the run folder
    rows = [(r["_step"], r["train/loss"]) for r in _wandb_history(run) if "train/loss" in r]
    assert rows == [("1", "3.5"), ("2", "2.25")]


def test_metrics_wandb_without_the_package_is_one_error_line(tmp_path, capsys, monkeypatch):
    import sys

    from titan_train.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    argv = ["--output-dir", str(tmp_path), "--metrics.wandb", "--training.steps", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "titan-train: error: metrics.wandb needs the wandb package: pip install wandb (or drop "
        "--metrics.wandb)"
    )
    assert not os.listdir(tmp_path)
