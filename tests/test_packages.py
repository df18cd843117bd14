"""Every package imports and reports a version; every wheel installs and imports standalone."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    # distribution name: (folder, import name)
    "titan-flexshard": ("libs/flexshard", "flexshard"),
    "titan-dist-moe": ("libs/dist_moe", "dist_moe"),
    "titan-remat": ("libs/torch_remat", "torch_remat"),
    "titan-checkpointing": ("libs/torch_checkpointing", "torch_checkpointing"),
    "titan-pipeline": ("libs/pipeline", "titan_pipeline"),
    "titan-models": ("libs/titan_models", "titan_models"),
    "titan-rl": ("libs/titan_rl", "titan_rl"),
    "titan-train": ("apps/titan_train", "titan_train"),
}


@pytest.mark.parametrize("dist", sorted(PACKAGES))
def test_package_layout_and_version(dist):
    folder, name = PACKAGES[dist]
    member = ROOT / folder
    meta = tomllib.loads((member / "pyproject.toml").read_text())["project"]
    assert meta["name"] == dist
    for part in ("README.md", "tests", "benchmarks", f"src/{name}/__init__.py"):
        assert (member / part).exists(), f"{folder}/{part} is missing"
    for dep in meta["dependencies"]:
        assert "==" not in dep, f"{dist} pins {dep!r}: members declare ranges, the lock pins"
    module = importlib.import_module(name)
    assert module.__version__ == meta["version"]


def _workspace_closure(dist: str) -> list[str]:
    """``dist`` and the workspace packages it depends on, transitively."""
    seen: list[str] = []
    stack = [dist]
    while stack:
        d = stack.pop()
        if d in seen:
            continue
        seen.append(d)
        meta = tomllib.loads((ROOT / PACKAGES[d][0] / "pyproject.toml").read_text())
        for dep in meta["project"]["dependencies"]:
            name = dep.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip()
            if name in PACKAGES:
                stack.append(name)
    return seen


@pytest.mark.slow
def test_each_wheel_installs_and_imports_standalone(tmp_path):
    """Build every wheel, install each into an empty venv with only its declared deps."""
    uv = shutil.which("uv")
    if uv is None:
        pytest.fail("uv is not on PATH: the standalone check needs it (pip install uv)")
    wheels = tmp_path / "wheels"
    subprocess.run(
        [uv, "build", "--all-packages", "--wheel", "--out-dir", str(wheels), "--quiet"],
        cwd=ROOT,
        check=True,
    )
    # Install the torch we test with, so the check reuses uv's cache instead of downloading.
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    for dist in sorted(PACKAGES):
        venv = tmp_path / f"venv-{dist}"
        subprocess.run(
            [uv, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True, env=env
        )
        python = venv / "bin" / "python"
        wheel_files = [
            str(next(wheels.glob(f"{d.replace('-', '_')}-*.whl"))) for d in _workspace_closure(dist)
        ]
        subprocess.run(
            [
                uv,
                "pip",
                "install",
                "--quiet",
                "--python",
                str(python),
                "-c",
                str(constraints),
                *wheel_files,
            ],
            check=True,
            env=env,
        )
        name = PACKAGES[dist][1]
        out = subprocess.run(
            [str(python), "-c", f"import {name}; print({name}.__version__)"],
            cwd=tmp_path,  # not the repo: the import must come from the installed wheel
            capture_output=True,
            text=True,
            env=env,
        )
        assert out.returncode == 0, f"{dist} does not import standalone:\n{out.stderr}"
        assert out.stdout.strip() == "0.1.0"
        shutil.rmtree(venv)
