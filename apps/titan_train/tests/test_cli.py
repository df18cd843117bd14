"""The command line a newcomer meets: ``--help`` answers at once (no torch), ``--config FILE``
(TOML, or a run's ``config.json``) reproduces a run, a bad path is one line, and ``--dry-run``
fills every memory column with a verdict per accelerator."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from titan_train.cli import main, parse_config
from titan_train.trainer import train

SHORT = [
    "--training.steps", "3", "--training.batch-size", "2", "--training.seq-len", "32",
    "--metrics.validate-every", "0", "--metrics.no-tensorboard", "--metrics.peak-flops", "1e11",
    "--checkpoint.interval", "0",
]  # fmt: skip


def test_help_is_quick_and_the_cli_module_does_not_import_torch():
    # Guards: `titan-train --help` took 26 s, importing torch._dynamo through the recipes.
    # CPU seconds, not wall time: on a shared 2-core machine the wall clock measures the
    # load (0.7 s CPU took 9 s of wall time at load 19; importing torch costs ~12 s of CPU).
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        [sys.executable, "-m", "titan_train", "--help"], capture_output=True, text=True, timeout=120
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert out.returncode == 0 and "--training.steps" in out.stdout and "--config" in out.stdout
    assert cpu < 5, f"--help took {cpu:.1f} s of CPU"  # generous: 0.7 s measured
    probe = "import sys, titan_train.cli; print(sorted(m for m in sys.modules if m.startswith('torch')))"
    mods = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert mods.returncode == 0 and mods.stdout.strip() == "[]", mods.stdout[:300]


def test_config_file_sets_fields_and_the_command_line_overrides_it(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text(
        'name = "from_file"\n[training]\nsteps = 7\nseq_len = 48\n'
        '[optimizer]\nbetas = [0.8, 0.9]\n[model]\noverrides = ["output=chunked_cross_entropy"]\n'
    )
    cfg = parse_config(["--training.steps", "9"], config_file=str(toml))
    assert (cfg.name, cfg.training.steps, cfg.training.seq_len) == ("from_file", 9, 48)
    assert cfg.optimizer.betas == (0.8, 0.9)
    assert cfg.model.overrides == ("output=chunked_cross_entropy",)
    for text, message in [
        ("[training]\nstep = 3\n", "training.step is not a field"),
        ('[training]\nsteps = "3"\n', "training.steps='3' must be an integer"),
        ('[data]\nsource = "web"\n', "data.source='web' must be one of 'arithmetic'"),
        ("[training\n", "not valid TOML"),
    ]:
        toml.write_text(text)
        assert main(["--config", str(toml), "--print-config"]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert main(["--config", str(tmp_path / "missing.toml")]) == 2
    assert "cannot be read" in capsys.readouterr().err


def test_a_runs_config_json_reproduces_the_run(tmp_path):
    first = train(parse_config(["--output-dir", str(tmp_path), "--name", "a", *SHORT]))
    saved = tmp_path / "a" / "config.json"
    again = train(parse_config(["--name", "b"], config_file=str(saved)))
    assert again["run_dir"] == tmp_path / "b"
    assert again["losses"] == first["losses"]  # bitwise: the same job
    a, b = (json.loads((tmp_path / n / "config.json").read_text()) for n in ("a", "b"))
    assert {**a, "name": "b"} == b


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--checkpoint.init-from-hf", "/nonexistent/hf"],
            "init_from_hf='/nonexistent/hf' does not exist",
        ),
        (["--checkpoint.init-from-hf", "{tmp}"], "has no config.json: not an HF checkpoint folder"),
        (["--output-dir", "{tmp}/a_file"], "output_dir='{tmp}/a_file': '{tmp}/a_file' is a file"),
        (["--output-dir", "{tmp}/a_file/runs"], "output_dir='{tmp}/a_file/runs': '{tmp}/a_file' is a file"),
        (["--output-dir", "/proc/titan-runs"], "'/proc' refuses a new folder"),
        (["--data.source", "files", "--data.paths", "{tmp}/none.jsonl"], "does not exist"),
        (["--data.source", "files", "--data.paths", "{tmp}"], "is not a file"),
        (["--data.tokenizer", "{tmp}/none.json"], "no such tokenizer.json file"),
        (["--data.tokenizer", "{tmp}/a_file"], "is not a Hugging Face tokenizer.json"),
        (["--data.tokenizer", "{tmp}/empty.json"], "is not a Hugging Face tokenizer.json"),
    ],
)  # fmt: skip
def test_a_bad_path_is_one_error_line(tmp_path, capsys, argv, message):
    # Guards: a missing HF folder, or an output dir that is a file, ended in a traceback; an
    # output dir under a file was "not writable"; one under /proc (read-only even for root)
    # ended in a PermissionError traceback.
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "empty.json").write_text("{}")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    out = [] if "--output-dir" in argv else ["--output-dir", str(tmp_path / "runs")]
    assert main([*out, *SHORT, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"titan-train: error: {err.removeprefix('titan-train: error: ')}"
    assert message.replace("{tmp}", str(tmp_path)) in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a mode-0o555 folder")
def test_a_read_only_output_dir_is_one_error_line(tmp_path, capsys):
    # (Root: the /proc case of test_a_bad_path_is_one_error_line stands for it.)
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    try:
        assert main(["--output-dir", str(out / "runs"), *SHORT]) == 2
    finally:
        out.chmod(0o755)
    err = capsys.readouterr().err.strip()
    assert f"'{out}' refuses a new folder (Permission denied)" in err, err
    assert len(err.splitlines()) == 1 and not any(out.iterdir())


def test_a_corpus_of_one_long_line_says_why_no_document_is_left_and_writes_nothing(
    tmp_path, capsys
):
    # Guards: a 60 MB one-line .txt failed after the run folder was written, in a traceback
    # ending "this rank's split holds no documents": its one record is the first, which
    # validation holds out.
    big = tmp_path / "big.txt"
    big.write_text("ab " * 20_000_000 + "\n")
    argv = ["--output-dir", str(tmp_path / "runs"), *SHORT, "--data.source", "files"]
    assert main([*argv, "--data.paths", str(big)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("titan-train: error: "), err
    assert "hold 1 record(s) (a .txt file's record is one line)" in err, err
    assert "holds out one record in 100 for validation, the first one included: 1 of" in err
    assert not (tmp_path / "runs").exists()


def test_a_failed_start_removes_the_run_folder_it_created_and_only_that(tmp_path):
    from titan_train.run_folder import LOCK_NAME, RunLock

    fresh = RunLock(tmp_path / "out" / "run")
    (tmp_path / "out" / "run" / "config.json").write_text("{}")
    fresh.release()
    fresh.discard_failed_start()
    assert not (tmp_path / "out").exists()  # the output dir it created goes too
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("a user's file")
    (kept / "run").mkdir()
    existing = RunLock(kept / "run")  # the run folder was there before: never removed
    existing.release()
    existing.discard_failed_start()
    assert (kept / "run" / LOCK_NAME).exists() and (kept / "notes.txt").exists()
    logged = RunLock(kept / "new")
    (kept / "new" / "metrics.jsonl").write_text('{"step": 1}\n')  # a step was logged: kept
    logged.release()
    logged.discard_failed_start()
    assert (kept / "new" / "metrics.jsonl").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_data_file_is_one_error_line(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "x"}\n')
    data.chmod(0)
    argv = [
        "--output-dir",
        str(tmp_path),
        *SHORT,
        "--data.source",
        "files",
        "--data.paths",
        str(data),
    ]
    assert main(argv) == 2
    assert "is not readable" in capsys.readouterr().err


def test_dry_run_fills_every_memory_column_and_says_where_it_fits(tmp_path, capsys):
    # Guards: --dry-run printed 0.00 for gradients and optimizer, no total and no verdict.
    argv = ["--dry-run", "--output-dir", str(tmp_path), "--parallel.dp-shard", "2"]
    assert main([*argv, "--training.batch-size", "2"]) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "llama3_debug" / "memory.json").read_text())
    (row,) = report["stages"]
    assert row["grads_bytes"] == row["params_bytes"] > 0
    assert row["optimizer_bytes"] == 2 * row["params_bytes"]  # AdamW: two fp32 moments
    assert row["activations_estimate_bytes"] > 0 and row["gathered_params_peak_bytes"] > 0
    total = sum(row[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes"))
    total += row["activations_estimate_bytes"] + row["gathered_params_peak_bytes"]
    assert report["total_bytes_per_rank"] == total
    assert report["fits"] == {"H100": True, "H200": True, "GB300": True}
    assert "total" in out and "activ. (est.)" in out
    assert "H100 80 GB: fits; H200 141 GB: fits; GB300 288 GB: fits" in out


def test_the_verdict_is_against_each_accelerators_memory_with_headroom():
    from titan_train.fake import fits

    assert fits(70 * 10**9) == {"H100": True, "H200": True, "GB300": True}
    assert fits(100 * 10**9) == {"H100": False, "H200": True, "GB300": True}
    assert fits(200 * 10**9) == {"H100": False, "H200": False, "GB300": True}  # 141 GB x 0.9
    assert fits(260 * 10**9) == {"H100": False, "H200": False, "GB300": False}  # 288 GB x 0.9
