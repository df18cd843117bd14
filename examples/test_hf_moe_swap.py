"""``examples/hf_moe_swap.py`` runs as written on 2 gloo ranks and its checks pass."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("hf_moe_swap.py")


@pytest.mark.slow  # two processes importing torch and transformers: ~30 s, more under load
def test_hf_moe_swap_on_two_ranks_keeps_logits_and_aux_loss():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run([*cmd, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # The two ranks share one pipe and CI runs unbuffered, so one rank's line can end up
    # glued to the other's: match each report up to its last field, not to the line end.
    report = r"rank (\d)/2: swapped 2 blocks, 4 of 8 experts here; (.*?expert grad sum [0-9.e+-]+)"
    lines = re.findall(report, out)
    assert sorted(r for r, _ in lines) == ["0", "1"], out[-4000:]
    for _, rest in lines:
        diffs = [float(v) for v in re.findall(r"diff\| ([0-9.e+-]+)", rest)]
        assert len(diffs) == 3 and max(diffs) <= 1e-5, rest
