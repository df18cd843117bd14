"""The import rules of the repository (``docs/architecture.md``), checked by reading source files with ``ast``.

Layers (an arrow only points down)::

    titan_train                      may import every library
    titan_rl                         may import titan_models, dist_moe
    titan_models                     may import dist_moe, torch_checkpointing
    flexshard dist_moe torch_remat torch_checkpointing titan_pipeline
                                     import none of the others

Nothing imports ``titan_train``, and no shipped source imports the dev-only
``titan_testing``. Besides our own packages, a library's source may import only the
standard library, its declared dependencies and its optional extras (plus modules that come
with torch, such as triton); an integration module ``integrations/<host>.py`` (or ``integrations/<host>/``) may also import
its host ``<host>``.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ALLOWED", "FOUNDATION", "Violation", "check_layering"]

FOUNDATION = frozenset(
    {"flexshard", "dist_moe", "torch_remat", "torch_checkpointing", "titan_pipeline"}
)
OURS = FOUNDATION | {"titan_models", "titan_rl", "titan_train", "titan_testing"}

# For each package: the other packages of ours that its *source* may import.
ALLOWED: dict[str, frozenset[str]] = {
    **{name: frozenset() for name in FOUNDATION},
    "titan_models": frozenset({"dist_moe", "torch_checkpointing"}),
    "titan_rl": frozenset({"titan_models", "dist_moe"}),
    "titan_train": FOUNDATION | {"titan_models", "titan_rl"},
    "titan_testing": frozenset(),
}

# Tests and benchmarks of a package may also use the dev-only harness.
_DEV_ONLY = frozenset({"titan_testing"})
# Distribution name -> import name where they differ.
_IMPORT_NAME = {
    "nvidia-cutlass-dsl": "cutlass",
    "pyyaml": "yaml",
    "pillow": "PIL",
    "torchmonarch": "monarch",
}
# Importable whenever torch is installed (torch depends on them on Linux).
_WITH_TORCH = frozenset({"triton", "typing_extensions", "sympy", "networkx", "jinja2", "filelock"})


@dataclass(frozen=True, slots=True)
class Violation:
    """One import that breaks the layering."""

    file: Path
    line: int
    importer: str
    imported: str
    rule: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.importer} imports {self.imported} ({self.rule})"


def _top_level_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def _normalise(dist: str) -> str:
    name = re.split(r"[\s<>=!~;\[]", dist.strip(), maxsplit=1)[0].lower()
    return _IMPORT_NAME.get(name, name.replace("-", "_"))


def _declared_imports(pyproject: Path) -> set[str]:
    project = tomllib.loads(pyproject.read_text()).get("project", {})
    deps = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        deps += extra
    return {_normalise(d) for d in deps}


def _package_dirs(root: Path) -> list[tuple[Path, str]]:
    """(package folder, import name) for every member with a ``src/<name>/`` layout."""
    found = []
    for member in sorted([*root.glob("libs/*"), *root.glob("apps/*"), *root.glob("tools/*")]):
        src = member / "src"
        if not src.is_dir():
            continue
        for pkg in sorted(src.iterdir()):
            if (pkg / "__init__.py").exists():
                found.append((member, pkg.name))
    return found


def check_layering(root: Path) -> list[Violation]:
    """Every import in ``root``'s libs/apps/tools that breaks the layering rules."""
    violations: list[Violation] = []
    stdlib = set(sys.stdlib_module_names)
    for member, name in _package_dirs(root):
        if name not in ALLOWED:
            violations.append(
                Violation(member, 0, name, "-", f"unknown package; known: {sorted(ALLOWED)}")
            )
            continue
        declared = _declared_imports(member / "pyproject.toml")
        for sub, is_src in (("src", True), ("tests", False), ("benchmarks", False)):
            for path in sorted((member / sub).rglob("*.py")):
                # `integrations/<host>.py` is the one place that imports a host framework
                # (which is no dependency: the module is imported only where the host is).
                host = {path.stem} if path.parent.name == "integrations" else set()
                if path.parent.parent.name == "integrations":  # integrations/<host>/ package
                    host = {path.parent.name}
                for line, mod in _top_level_imports(path):
                    rule = _rule_broken(name, mod, is_src, declared | host, stdlib)
                    if rule:
                        violations.append(Violation(path, line, name, mod, rule))
    return violations


def _rule_broken(
    importer: str, mod: str, is_src: bool, declared: set[str], stdlib: set[str]
) -> str | None:
    if mod == importer:
        return None
    if mod in OURS:
        allowed = ALLOWED[importer] | (frozenset() if is_src else _DEV_ONLY)
        if mod in allowed:
            return None
        if mod == "titan_train":
            return "nothing imports the app titan_train"
        if mod == "titan_testing":
            return "titan_testing is dev-only; shipped source must not import it"
        return f"{importer} may import only {sorted(allowed) or 'none of ours'}"
    if not is_src or mod in stdlib or mod in _WITH_TORCH or mod == "__future__":
        return None
    if mod not in declared:
        return f"third-party module not declared in {importer}'s pyproject.toml"
    return None
