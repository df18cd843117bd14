"""Every Python block of every README runs as pasted, and every library README starts by
saying how to install that library alone.

Each block runs on its own in a fresh interpreter (a temporary working folder, nothing
downloaded): a reader who pastes one block into a file and runs it gets no error.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = sorted(
    [
        ROOT / "README.md",
        *ROOT.glob("libs/*/README.md"),
        *ROOT.glob("apps/*/README.md"),
        *ROOT.glob("tools/*/README.md"),
    ]
)
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _blocks() -> list[tuple[str, int, str]]:
    out = []
    for readme in READMES:
        text = readme.read_text()
        for k, match in enumerate(_BLOCK.finditer(text)):
            out.append((str(readme.relative_to(ROOT)), k, match.group(1)))
    return out


BLOCKS = _blocks()


def test_the_blocks_are_found():
    # Guards the extraction itself: the libraries' READMEs all open with an example.
    assert len(BLOCKS) >= 8
    assert {b[0] for b in BLOCKS} >= {"libs/flexshard/README.md", "libs/titan_rl/README.md"}


@pytest.mark.parametrize("readme", [r for r in READMES if "libs/" in str(r) or "apps/" in str(r)])
def test_library_readme_starts_with_its_install_step(readme):
    head = readme.read_text()[:1500]
    assert re.search(r"(uv )?pip install", head), f"{readme}: no install line near the top"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("readme", "index", "code"), BLOCKS, ids=[f"{b[0]}#{b[1]}" for b in BLOCKS]
)
def test_readme_python_block_runs_as_pasted(readme, index, code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, (
        f"{readme} block {index} failed (exit {run.returncode}):\n{run.stderr[-3000:]}"
    )
