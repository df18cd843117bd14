"""``examples/fsdp2_checkpoint.py`` runs as written and its equality checks hold."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "fsdp2_checkpoint.py"


@pytest.mark.slow
def test_fsdp2_checkpoint_saved_on_2_ranks_loads_equal_on_3_and_on_1():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "AdamW state equal on 2, 3 and 1 ranks" in proc.stdout, proc.stdout
