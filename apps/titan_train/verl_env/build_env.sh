#!/usr/bin/env bash
# Build the separate environment in which titan_train's veRL engine runs (see README.md here).
#
# verl 0.9.1 caps transformers<5.11 while the repository's lock has 5.24, so veRL cannot join the
# uv workspace: it gets its own virtual environment, outside the repository, with torch 2.15 (the
# lock's), verl==0.9.1, transformers 5.9.0 (the version verl's own `cpu` extra pins) and the Titan
# packages installed editable from this checkout. Every other version is pinned by
# constraints.txt (the environment the check passed in).
#
# Usage: apps/titan_train/verl_env/build_env.sh            (ENV_DIR = $TITAN_VERL_ENV or the default)
# Then:  uv run pytest -m slow apps/titan_train/tests/test_verl_engine.py
set -euo pipefail
ENV_DIR="${TITAN_VERL_ENV:-$HOME/.cache/titan/verl-env}"
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"

uv venv --clear --python 3.11 "$ENV_DIR"   # a rebuild starts from nothing
# One resolve for everything, so pip-style backtracking never swaps torch or transformers.
uv pip install --python "$ENV_DIR/bin/python" -c "$HERE/constraints.txt" \
    "torch==2.15.0" "verl==0.9.1" "transformers==5.9.0" \
    -e "$REPO/libs/flexshard" -e "$REPO/libs/dist_moe" -e "$REPO/libs/torch_remat" \
    -e "$REPO/libs/torch_checkpointing" -e "$REPO/libs/pipeline" -e "$REPO/libs/titan_models" \
    -e "$REPO/libs/titan_rl[monarch]" -e "$REPO/apps/titan_train"
"$ENV_DIR/bin/python" -c "import torch, transformers, verl, titan_train
print('torch', torch.__version__, 'transformers', transformers.__version__, 'verl', verl.__version__)"
echo "export TITAN_VERL_ENV=$ENV_DIR"
