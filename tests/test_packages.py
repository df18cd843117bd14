"""Every package imports and reports a version; every wheel installs and imports standalone,
and runs the examples that use it with nothing else of ours installed."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

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


# library -> the examples/ scripts that use it and nothing else of ours (plus torch and
# transformers), each with its number of processes (> 1: launched with torchrun). The
# extended test below runs each in an empty venv holding only that library's wheel.
EXAMPLES: dict[str, list[tuple[str, int]]] = {
    "titan-checkpointing": [("fsdp2_checkpoint.py", 1)],  # it starts its own 2 and 3 ranks
    "titan-flexshard": [("hf_llama_flexshard.py", 1)],  # it starts its own 2 ranks
    "titan-pipeline": [("plain_pipeline.py", 2)],
    "titan-remat": [("hf_remat.py", 1)],
    "titan-rl": [("verl_style_rl.py", 1)],
}
EXAMPLE_PARTNERS: dict[str, list[str]] = {"titan-flexshard": ["titan-checkpointing"]}
"""Libraries an example composes with its own, installed beside it only to run the examples
(after the import of the library alone has been checked)."""


def _example_command(python: Path, script: str, nproc: int) -> list[str]:
    path = str(ROOT / "examples" / script)
    if nproc == 1:
        return [str(python), path]
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [str(python), *launch, path]


def _installed_versions() -> str:
    """Constraints pinning every distribution of this environment but ours: the venvs then
    install what the lock installed here, from uv's cache."""
    pins = {
        d.metadata["Name"].lower(): d.version
        for d in importlib.metadata.distributions()
        if d.metadata["Name"] and not d.metadata["Name"].lower().startswith("titan")
    }
    pins["torch"] = pins["torch"].split("+")[0]
    return "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))


def test_examples_table_names_existing_scripts_of_known_libraries():
    assert EXAMPLE_PARTNERS.keys() <= EXAMPLES.keys()
    assert all(p in PACKAGES for partners in EXAMPLE_PARTNERS.values() for p in partners)
    for dist, scripts in EXAMPLES.items():
        assert dist in PACKAGES, dist
        for script, nproc in scripts:
            assert (ROOT / "examples" / script).is_file(), script
            assert nproc >= 1


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


def _wheels(folder: Path, dists: list[str]) -> list[str]:
    """The wheel files of ``dists`` and the workspace packages they depend on."""
    closure = dict.fromkeys(d for dist in dists for d in _workspace_closure(dist))
    return [str(next(folder.glob(f"{d.replace('-', '_')}-*.whl"))) for d in closure]


@pytest.mark.slow
def test_each_wheel_installs_and_imports_standalone(tmp_path):
    """Build every wheel, install each into an empty venv with only its declared deps and
    import it there (the examples themselves run in the workspace: examples/test_*.py)."""
    _standalone(tmp_path, run_examples=False)


@pytest.mark.slow
@pytest.mark.extended  # ~5 min: eight venvs and every example again in them
def test_each_wheel_installs_imports_and_runs_its_examples_standalone(tmp_path):
    """As above; where a library has examples, add transformers (and a library the example
    composes with, ``EXAMPLE_PARTNERS``) and run them there."""
    _standalone(tmp_path, run_examples=True)


def _standalone(tmp_path: Path, *, run_examples: bool) -> None:
    uv = shutil.which("uv")
    if uv is None:
        pytest.fail("uv is not on PATH: the standalone check needs it (pip install uv)")
    wheels = tmp_path / "wheels"
    subprocess.run(
        [uv, "build", "--all-packages", "--wheel", "--out-dir", str(wheels), "--quiet"],
        cwd=ROOT,
        check=True,
    )
    # The versions we test with, so the check reuses uv's cache instead of downloading.
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(_installed_versions())
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    for dist in sorted(PACKAGES):
        venv = tmp_path / f"venv-{dist}"
        subprocess.run(
            [uv, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True, env=env
        )
        python = venv / "bin" / "python"
        pip = [uv, "pip", "install", "--quiet", "--python", str(python), "-c", str(constraints)]
        subprocess.run([*pip, *_wheels(wheels, [dist])], check=True, env=env)
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
        if run_examples and dist in EXAMPLES:
            with_partners = _wheels(wheels, [dist, *EXAMPLE_PARTNERS.get(dist, [])])
            subprocess.run([*pip, *with_partners, "transformers"], check=True, env=env)
        for script, nproc in EXAMPLES.get(dist, []) if run_examples else []:
            run = subprocess.run(
                _example_command(python, script, nproc),
                cwd=tmp_path,
                capture_output=True,
                text=True,
                env=env,
                timeout=600,
            )
            assert run.returncode == 0, (
                f"examples/{script} fails with only {dist} installed:\n"
                f"{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
            )
        shutil.rmtree(venv)
