"""Structure rules of the repository, read from the source with ``ast``: no module imports
another module's private names, the app's modules import each other without cycles, no code
outside titan_models decides anything by a model family's name, and no module switches
matplotlib's process-wide backend or draws through pyplot's global figure registry."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(
    p for pattern in ("libs/*/src", "apps/*/src", "tools/*/src") for p in ROOT.glob(pattern)
)


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every package of ours."""
    out = {}
    for src in SOURCES:
        for path in src.rglob("*.py"):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()
OURS = {name.split(".")[0] for name in MODULES}


def _module_of(path: Path) -> str:
    return next(name for name, p in MODULES.items() if p == path)


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{line}"


def _resolve(path: Path, node: ast.ImportFrom, module: str) -> str:
    """The absolute module an ``ImportFrom`` in ``module`` (file ``path``) reads from."""
    if not node.level:
        return node.module or ""
    package = module.split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_imports(path: Path, module: str | None = None) -> list[str]:
    """``from ours import _name`` where ``_name`` is not a module of the importing file's own
    package, and ``module._name`` read off a module of ours imported here."""
    module = module or _module_of(path)
    if not path.exists():
        return []
    tree = ast.parse(path.read_text(), str(path))
    own_package = module.split(".")[0]
    found: list[str] = []
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _resolve(path, node, module)
            if source.split(".")[0] not in OURS:
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in MODULES:  # a submodule
                    if _private(alias.name) and source.split(".")[0] != own_package:
                        found.append(f"{_where(path, node.lineno)} imports {full}")
                    aliases[alias.asname or alias.name] = full
                elif _private(alias.name) or (
                    _private(source.rpartition(".")[2]) and source.split(".")[0] != own_package
                ):
                    found.append(f"{_where(path, node.lineno)} imports {full}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and _private(node.attr)
            and f"{aliases[node.value.id]}.{node.attr}" not in MODULES
        ):
            found.append(f"{_where(path, node.lineno)} reads {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_module_imports_a_private_name_of_another_module():
    found = [hit for path in MODULES.values() for hit in _private_imports(path)]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (no runtime dependency)."""
    out = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if (
            isinstance(node, ast.If)
            and getattr(test, "id", getattr(test, "attr", "")) == "TYPE_CHECKING"
        ):
            out |= {id(n) for child in node.body for n in ast.walk(child)}
    return out


def _app_imports() -> dict[str, set[str]]:
    """titan_train module -> the titan_train modules it imports at run time (anywhere in the
    file, functions included; ``if TYPE_CHECKING:`` imports are annotations only)."""
    app = {n: p for n, p in MODULES.items() if n.split(".")[0] == "titan_train"}
    graph: dict[str, set[str]] = {}
    for name, path in app.items():
        deps = set()
        tree = ast.parse(path.read_text())
        typing_only = _type_only(tree)
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets = []
            if isinstance(node, ast.ImportFrom):
                source = _resolve(path, node, name)
                targets = [f"{source}.{a.name}" for a in node.names] + [source]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                while t and t not in app:  # a name inside a module: that module
                    t = t.rpartition(".")[0]
                if t and t != name and t != "titan_train" and not name.startswith(f"{t}."):
                    deps.add(t)
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_apps_modules_import_each_other_without_a_cycle():
    cycle = _cycle(_app_imports())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _family_comparisons(path: Path, families: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            names = [v.value for v in values if isinstance(v, ast.Constant)]
            if any(n in families for n in names):
                found.append(_where(path, node.lineno))
    return found


@pytest.mark.parametrize(
    "where", ["apps/*/src", "libs/flexshard/src", "libs/titan_rl/src", "libs/dist_moe/src"]
)
def test_no_code_outside_titan_models_compares_a_family_name(where):
    import titan_models

    families = set(titan_models.list_models())
    files = [p for src in ROOT.glob(where) for p in src.rglob("*.py")]
    found = [hit for path in files for hit in _family_comparisons(path, families)]
    assert not found, "family names compared (ask the model's plan instead):\n" + "\n".join(found)


def _process_wide_plotting(path: Path) -> list[str]:
    """``matplotlib.use(...)`` and imports of ``matplotlib.pyplot``: a library or an app used
    from a notebook must not change the host's backend or keep figures in pyplot's registry
    (draw on a ``matplotlib.figure.Figure`` of its own)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module or ""]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "matplotlib.use":
            names = ["matplotlib.use"]
        if any(n in ("matplotlib.pyplot", "matplotlib.use") for n in names):
            found.append(_where(path, node.lineno))
    return found


def test_no_module_switches_matplotlib_backend_or_uses_pyplot():
    found = [hit for path in MODULES.values() for hit in _process_wide_plotting(path)]
    assert not found, "process-wide plotting state (use a Figure of its own):\n" + "\n".join(found)


def test_the_rules_catch_what_they_forbid(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from titan_train.loaders import _x\n"
        "import titan_train.trainer as t\n"
        "t._loaders()\n"
        "from flexshard import _runtime\n"  # another package's private module
        "from . import _tree\n"  # a private module of its own package: allowed
        "if cfg.model.family in ('qwen3', 'deepseek_v4'):\n    pass\n"
    )
    hits = _private_imports(probe, module="torch_checkpointing.probe")
    assert [h.split(" ", 1)[1] for h in hits] == [
        "imports titan_train.loaders._x",
        "imports flexshard._runtime",
        "reads titan_train.trainer._loaders",
    ]
    assert len(_family_comparisons(probe, {"deepseek_v4"})) == 1
    plots = tmp_path / "plots.py"
    plots.write_text(
        "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
        "from matplotlib import pyplot\nfrom matplotlib.figure import Figure\n"
    )
    assert sorted(int(h.rsplit(":", 1)[1]) for h in _process_wide_plotting(plots)) == [2, 3, 4]
