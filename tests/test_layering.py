"""The layer rules of docs/architecture.md hold for the repository and catch a bad import."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from titan_testing.layering import check_layering

ROOT = Path(__file__).resolve().parents[1]


def _package(root: Path, folder: str, name: str, deps: list[str], source: str) -> None:
    pkg = root / folder
    (pkg / "src" / name).mkdir(parents=True)
    quoted = ", ".join(f'"{d}"' for d in deps)
    (pkg / "pyproject.toml").write_text(f'[project]\nname = "x"\ndependencies = [{quoted}]\n')
    (pkg / "src" / name / "__init__.py").write_text(textwrap.dedent(source))


def test_repository_follows_the_layering():
    violations = check_layering(ROOT)
    assert not violations, "\n".join(map(str, violations))


@pytest.mark.parametrize(
    ("folder", "name", "source", "rule"),
    [
        ("libs/flexshard", "flexshard", "import torch_checkpointing\n", "none of ours"),
        ("libs/dist_moe", "dist_moe", "from titan_pipeline.schedules import x\n", "none of ours"),
        (
            "libs/titan_models",
            "titan_models",
            "import flexshard\n",
            "only ['dist_moe', 'torch_checkpointing']",
        ),
        ("libs/titan_rl", "titan_rl", "from titan_train import cli\n", "app titan_train"),
        ("libs/torch_remat", "torch_remat", "import titan_testing\n", "dev-only"),
        ("libs/torch_remat", "torch_remat", "def f():\n    import requests\n", "not declared"),
    ],
)
def test_bad_import_in_a_temporary_tree_is_reported(tmp_path, folder, name, source, rule):
    _package(tmp_path, folder, name, ["torch"], source)
    violations = check_layering(tmp_path)
    assert len(violations) == 1, violations
    assert rule in violations[0].rule
    assert violations[0].file.name == "__init__.py"


def test_an_integration_module_imports_its_host_and_nothing_else_undeclared(tmp_path):
    _package(tmp_path, "apps/titan_train", "titan_train", ["torch"], "")
    integrations = tmp_path / "apps/titan_train/src/titan_train/integrations"
    integrations.mkdir()
    (integrations / "verl.py").write_text("import verl\nfrom verl.workers import engine\n")
    assert check_layering(tmp_path) == []
    (integrations / "verl.py").write_text("import verl\nimport tensordict\n")
    [violation] = check_layering(tmp_path)
    assert violation.imported == "tensordict" and "not declared" in violation.rule
    (integrations / "ray.py").write_text("import verl\n")  # another host's module
    assert {v.file.name for v in check_layering(tmp_path)} == {"verl.py", "ray.py"}


def test_allowed_imports_in_a_temporary_tree_pass(tmp_path):
    _package(tmp_path, "libs/dist_moe", "dist_moe", ["torch"], "import torch\nimport os\n")
    _package(
        tmp_path,
        "libs/titan_models",
        "titan_models",
        ["torch", "safetensors", "titan-dist-moe"],
        "import dist_moe\nfrom safetensors import safe_open\nfrom . import x\n",
    )
    _package(tmp_path, "apps/titan_train", "titan_train", ["torch"], "import flexshard\n")
    assert check_layering(tmp_path) == []
