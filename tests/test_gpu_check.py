"""tools/gpu_check.py on a machine without a GPU: its budget, its probes and its one-line
outcomes (the GPU steps themselves run where a GPU is lent)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def test_the_core_steps_fit_the_default_budget(gpu_check):
    core = [s for s in gpu_check.STEPS if not s.extended]
    assert core and sum(s.limit_s for s in core) <= gpu_check.BUDGET_S - gpu_check.PROBE_S
    assert len({s.name for s in gpu_check.STEPS}) == len(gpu_check.STEPS)


def test_pytest_steps_name_tests_that_exist(gpu_check):
    """Every path (and ``path::test``) a step passes to pytest, deselected ones included, is
    a file of the repository with that test in it: a renamed test fails here, not on a GPU."""
    for step in gpu_check.STEPS:
        for arg in step.argv:
            path, _, test = arg.partition("::")
            if not path.endswith(".py") or "{" in path or not path.startswith(("libs/", "apps/")):
                continue
            assert (ROOT / path).is_file(), (step.name, path)
            if test:
                assert f"def {test.split('[')[0]}(" in (ROOT / path).read_text(), (step.name, arg)


class _Parsed(Exception):
    """Raised in place of running a script once its arguments have parsed."""


def _commands(gpu_check, program: str):
    """(step, arguments) of each step running ``program`` (after ``uv run``), placeholders
    filled as on a one-GPU machine."""
    fill = {"gpus": "1", "report": "/tmp/r", "run": "/tmp/run", "TITAN_RL_VLLM_GPU_PYTHON": ""}
    for step in gpu_check.STEPS:
        argv = [a.format(**fill) for a in step.argv]
        argv = argv[2:] if argv[:2] == ["uv", "run"] else argv
        if argv[:1] == [program]:
            yield step, argv[1:]


def test_titan_train_steps_pass_the_cli_checks(gpu_check):
    """Every ``titan-train`` step's flags resolve to a valid config here (``--print-config``):
    a renamed or removed field fails in CI, not on a lent GPU."""
    from titan_train.cli import main

    steps = list(_commands(gpu_check, "titan-train"))
    assert len(steps) >= 4
    for step, args in steps:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([*args, "--print-config"])
            except SystemExit as e:  # tyro's answer to an unknown flag
                code = e.code
        assert code == 0, f"{step.name}: titan-train {' '.join(args)}: {err.getvalue()[-3000:]}"


def test_script_steps_parse_their_arguments(gpu_check, monkeypatch):
    """Every ``python script.py ...`` step's arguments pass that script's argument parser
    (types and ranges included); the script stops there instead of running."""
    from titan_train.cli import parse_config

    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    steps = list(_commands(gpu_check, "python"))
    assert len(steps) >= 6
    for step, (script, *args) in steps:
        if "--" in args:  # what follows goes to titan-train: its own check
            rest = args[args.index("--") + 1 :]
            try:
                parse_config(rest)
            except SystemExit:
                pytest.fail(f"{step.name}: titan-train refuses {' '.join(rest)}")
        monkeypatch.setattr(sys, "argv", [script, *args])
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(_Parsed):
            try:
                runpy.run_path(str(ROOT / script), run_name="__main__")
            except SystemExit as e:
                pytest.fail(
                    f"{step.name}: {script} {' '.join(args)}: exit {e.code}: {err.getvalue()}"
                )


@pytest.mark.parametrize(
    ("driver", "index"),
    [("13.2", "cu132"), ("13.0", "cu132"), ("12.4", "cu129"), ("12.9", "cu129"),
     ("14.1", "cu132"), ("11.8", None)],
)  # fmt: skip
def test_the_torch_build_for_a_driver(gpu_check, driver, index):
    assert gpu_check.torch_index_for(driver) == index


def _fake_nvidia_smi(tmp_path: Path, output: str, names: str = "") -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text(
        '#!/bin/sh\ncase "$1" in --query-gpu*) printf "%s" "$NAMES" ;; *) printf "%s\\n" "$OUT" ;; esac\n'
    )
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": output, "NAMES": names}


def test_without_a_gpu_it_says_so_in_one_line(tmp_path):
    env = _fake_nvidia_smi(tmp_path, "No devices were found")
    report = tmp_path / "report"
    done = subprocess.run(
        ["bash", "tools/gpu_check.sh", "--report", str(report)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip().splitlines() == [
        "gpu_check: no NVIDIA GPU here (nvidia-smi finds none): nothing to check"
    ]
    assert json.loads(report.with_suffix(".json").read_text())["verdict"] == "no GPU"


def test_an_older_driver_gets_the_one_command_for_its_torch_build(gpu_check, tmp_path, capsys):
    def driver():
        return {"gpus": ["NVIDIA H100 80GB HBM3"], "cuda": "12.4", "capability": 90}

    def torch_sees():
        return {"version": "2.15.0+cu132", "cuda": "13.2", "available": False, "count": 0}

    gpu_check.probe_driver, gpu_check.probe_torch = driver, torch_sees
    assert gpu_check.main(["--report", str(tmp_path / "r")]) == 4
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert line.endswith(
        "run: uv pip install --reinstall torch==2.15.0 --index-url "
        "https://download.pytorch.org/whl/cu129  (or pass --install-torch)"
    )
    summary = json.loads((tmp_path / "r.json").read_text())
    assert summary["driver_cuda"] == "12.4" and summary["steps"] == []


def test_steps_are_planned_with_reasons_and_stop_at_the_budget(gpu_check, tmp_path, capsys):
    ran = []

    def fake_run(step, limit, fill):
        ran.append((step.name, limit))
        return gpu_check.Outcome(step.name, "passed", 1.0, "", ["tok/s 123"])

    gpu_check.probe_driver = lambda: {"gpus": ["H100"], "cuda": "13.2", "capability": 90}
    gpu_check.probe_torch = lambda: {
        "version": "2.15.0",
        "cuda": "13.2",
        "available": True,
        "count": 1,
    }
    gpu_check.run_step = fake_run
    assert gpu_check.main(["--report", str(tmp_path / "r"), "--extended"]) == 0
    summary = json.loads((tmp_path / "r.json").read_text())
    statuses = {s["name"]: (s["status"], s["reason"]) for s in summary["steps"]}
    assert len(statuses) == len(gpu_check.STEPS)
    assert statuses["symmetric-memory dispatch vs all-to-all"] == (
        "skipped",
        "needs 2 GPUs, 1 here",
    )
    for name in (
        "CP 2 on NCCL: llama3_debug, 20 steps",
        "symm_mem dispatch from the app: qwen3_moe_debug at EP 2, 20 steps",
    ):
        assert statuses[name] == ("skipped", "needs 2 GPUs, 1 here")
    assert statuses["CUDA-graph pipeline stage = eager (outputs, gradients)"][0] == "passed"
    cute = "grouped GEMM cute: GroupedExperts(gemm='cute') = torch, forward and backward"
    assert statuses[cute][0] == "passed"  # sm90 here
    for name in (
        "grouped GEMM triton: triton_grouped_mm and GroupedExperts(gemm='triton') = torch, "
        "fp32 and bf16, forward and backward",
        "host syncs on CUDA: none outside log steps (llama3_debug, qwen3_moe_debug with the "
        "torch and the triton grouped GEMM; sync debug mode)",
    ):
        assert statuses[name][0] == "passed"
    assert statuses["NVFP4 scaled_mm vs the emulation (sm100)"][0] == "skipped"
    limits = {s.name: s.limit_s for s in gpu_check.STEPS}
    assert all(limit <= limits[name] for name, limit in ran)
    assert "tok/s 123" in (tmp_path / "r.txt").read_text()
    ran.clear()  # a short budget bounds every step's limit by what is left of it
    assert gpu_check.main(["--report", str(tmp_path / "short"), "--budget", "100"]) == 0
    assert ran and all(limit <= 100 - gpu_check.PROBE_S for _, limit in ran)
