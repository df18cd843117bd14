#!/usr/bin/env bash
# Everything GPU-only in one command, within 8 minutes, with a one-page summary:
#
#   bash tools/gpu_check.sh [--extended] [--budget S] [--report PATH] [--only NAME ...]
#
# The steps, their limits and the driver / torch-build probe are in tools/gpu_check.py (plain
# python3, so it starts before any environment works); see its docstring.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$HOME/.cache/titan/inductor}"
exec python3 tools/gpu_check.py "$@"
