"""Shared by the examples' tests: load an example script as a module (``example(name)``).

An example is a script, not a package module: its tests load it by path under its own
module name (``titan_testing.run_distributed`` finds functions loaded this way by file).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parent


def load_example(name: str) -> ModuleType:
    """The module of ``examples/<name>.py`` (its ``__main__`` block does not run)."""
    path = EXAMPLES / f"{name}.py"
    module_name = f"titan_example_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def example() -> Callable[[str], ModuleType]:
    """``example("plain_pipeline")``: the module of ``examples/plain_pipeline.py``."""
    return load_example
