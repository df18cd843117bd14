"""titan_train's veRL engine equals veRL's own FSDP engine (veRL environment only).

veRL 0.9.1 caps transformers<5.11, so it lives in its own environment, outside the uv
workspace: ``apps/titan_train/verl_env/build_env.sh`` builds it, by default in
``~/.cache/titan/verl-env``; ``TITAN_VERL_ENV`` may point at it elsewhere. The comparison runs
in that environment's python (``verl_env/check_engine.py``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "apps" / "titan_train" / "verl_env" / "check_engine.py"
VERL_ENV = Path(os.environ.get("TITAN_VERL_ENV") or Path.home() / ".cache" / "titan" / "verl-env")
VERL_PYTHON = VERL_ENV / "bin" / "python"
TOLERANCE = 1e-5


@pytest.mark.slow
@pytest.mark.skipif(
    not VERL_PYTHON.is_file(),
    reason=f"veRL environment absent ({VERL_PYTHON} does not exist): build it with "
    "apps/titan_train/verl_env/build_env.sh and, for a folder other than the default, set "
    "TITAN_VERL_ENV to it",
)
def test_titan_engine_equals_verl_fsdp_engine():
    """One PPO step of veRL's ``train_batch`` on a ``DataProto`` batch, on 1 and 2 gloo ranks:
    log-probs, entropy, loss, grad norm, the updated weights and the log-probs after the step
    agree with veRL's FSDP engine within 1e-5 (fp32, same HF safetensors); a checkpoint
    restored into a fresh engine takes the next step bit for bit like the original; the
    checkpoint's HF export equals the weights; bad engine config values are ValueErrors."""
    # The environment has this repository's packages installed editable from wherever it was
    # built: put this checkout's sources first, so the code under test is this checkout's.
    sources = [str(p) for p in sorted(REPO.glob("libs/*/src"))] + [
        str(REPO / "apps/titan_train/src")
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([*sources, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run(
        [str(VERL_PYTHON), str(SCRIPT), "--nproc", "1", "--nproc", "2"],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    lines = [json.loads(s) for s in out.stdout.splitlines() if s.startswith('{"world"')]
    assert [r["world"] for r in lines] == [1, 2], out.stdout[-3000:]
    for result in lines:
        for key in ("log_probs", "entropy", "loss", "grad_norm", "weights", "log_probs_after"):
            assert result[key] <= TOLERANCE, result
        # The step moved the weights (else "weights" above compares two untouched models).
        assert result["weights_moved"] > 100 * TOLERANCE, result
        # Model, optimizer moments and LR schedule came back exactly from torch_checkpointing,
        # and the checkpoint's HF export holds exactly the weights the rollout is sent.
        assert result["restored_step"] == 0.0, result
        assert result["hf_export"] == 0.0, result
    [errors] = [json.loads(s)["errors"] for s in out.stdout.splitlines() if s.startswith('{"err')]
    for field_name, message in errors.items():  # one ValueError naming the field
        assert field_name in message, errors


@pytest.mark.skipif(
    importlib.util.find_spec("verl") is not None, reason="verl is installed in this environment"
)
def test_app_imports_without_verl_and_the_engine_says_how_to_get_it():
    """The app never imports veRL; the engine module names the script that builds its
    environment instead of a bare ModuleNotFoundError."""
    import titan_train.integrations

    with pytest.raises(ImportError, match="verl_env/build_env.sh"):
        import titan_train.integrations.verl  # noqa: F401
