#!/usr/bin/env bash
# Everything GPU-only in one command, for when a GPU is lent (about 10 minutes on one GPU).
#
#   bash tools/gpu_check.sh [report-file]      (default: gpu_check_report.txt)
#
# Runs, in order, each step bounded and its outcome recorded (a failing step does not stop
# the others; the exit status is that of the worst step):
#   1. every test marked `gpu` (pytest -m gpu): flexshard over NCCL, torch_remat on CUDA,
#      dist_moe's Triton kernels / symmetric memory / CUDA-graph capture / CuTe GEMM, the
#      checkpoint GPU tests, FlexAttention gradients and torch's varlen kernel, the
#      delta-rule Triton kernels (linear attention), the FP8 / MXFP8 device GEMMs;
#   2. the debug recipe on one GPU (bf16), then a ~1B Llama (Llama 3.2 1B shape) for 50 steps
#      with local compile: tok/s and MFU against the device's dense bf16 peak;
#   3. the checkpoint benchmark with the state on the GPU (--device cuda), and its load into
#      GPU tensors on 2 ranks with resharding (pinned staging reused, H2D copies overlapping
#      the next read; the breakdown and peak memory it prints);
#   4. dist_moe's kernel benchmarks: CuTe grouped GEMM vs torch._grouped_mm, pack/combine
#      bandwidth vs the device copy bandwidth (and symmetric-memory dispatch on >= 2 GPUs);
#   5. NVFP4 (sm100 only, skipped elsewhere with the reason): scaled_mm on float4_e2m1fn_x2
#      with e4m3 block scales against the emulation (forward, dgrad, wgrad);
#   6. FP8 / MXFP8 (and NVFP4 on sm100) with the device kernels: loss vs fp32 on the debug
#      recipe, a 1B step rate.
# Steps 1-5 fit about 10 minutes; step 6 adds about 5 (run it when the lease allows).
set -uo pipefail
cd "$(dirname "$0")/.."
report=${1:-gpu_check_report.txt}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$HOME/.cache/titan/inductor}"
status=0
: >"$report"

log() { printf '%s\n' "$*" | tee -a "$report"; }

step() {  # step NAME SECONDS COMMAND...: run, keep the tail of its output, record the outcome
  local name=$1 limit=$2; shift 2
  log "== $name"
  local start=$SECONDS out
  out=$(timeout --kill-after=10 "$limit" "$@" 2>&1)
  local rc=$?
  printf '%s\n' "$out" | tail -n 40 | tee -a "$report"
  log "-- $name: rc=$rc in $((SECONDS - start)) s"
  [ "$rc" -ne 0 ] && status=$rc
  return 0
}

if ! uv run python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  log "no CUDA device visible: nothing to check"; exit 3
fi
gpus=$(uv run python -c 'import torch; print(torch.cuda.device_count())')
name=$(uv run python -c 'import torch; print(torch.cuda.get_device_name(0))')
log "device: $name x $gpus, $(uv run python -c 'import torch; print(torch.__version__, torch.version.cuda)')"

# Dense bf16 peak FLOP/s of the device (the number MFU is reported against).
case "$name" in
  *H100*|*H200*|*H800*|*H20*) peak=989e12 ;;
  *B200*|*B300*|*GB200*|*GB300*) peak=2250e12 ;;
  *A100*|*A800*) peak=312e12 ;;
  *L40S*) peak=362e12 ;;
  *) peak=0 ;;  # unknown: the app measures a bf16 matmul instead
esac
log "bf16 peak used for MFU: ${peak} (0 = measured)"

uv pip install --quiet 'nvidia-cutlass-dsl==4.8.1' >/dev/null 2>&1 \
  || log "(could not install the cutlass extra: the CuTe checks will skip)"

step "pytest -m gpu" 240 uv run pytest -m gpu -q -rs -p no:cacheprovider \
  --deselect libs/titan_models/tests/test_nvfp4.py::test_device_gemms_match_the_emulation \
  --deselect libs/titan_rl/tests/test_actors.py::test_distributed_grpo_on_cuda  # own steps

run=$(mktemp -d)
common=(--training.device cuda --training.mixed-precision bf16 --metrics.peak-flops "$peak"
        --metrics.no-tensorboard --metrics.validate-every 0 --checkpoint.interval 0
        --output-dir "$run")
step "llama3_debug on one GPU" 90 uv run titan-train --recipe llama3_debug \
  "${common[@]}" --training.steps 50 --metrics.log-every 10
step "Llama 1B, 50 steps, local compile" 240 uv run titan-train --recipe llama3_debug \
  --name llama3_1b --model.flavor 1B --model.vocab-size 128256 --compile.mode local \
  --training.seq-len 2048 --training.batch-size 8 --training.steps 50 \
  --metrics.log-every 10 --lr-schedule.warmup-steps 10 "${common[@]}"
for r in llama3_debug llama3_1b; do
  [ -f "$run/$r/metrics.jsonl" ] && log "$r last: $(grep '"split": "train"' "$run/$r/metrics.jsonl" | tail -n 1)"
done

# Graph mode (issue 37): step time and peak memory, eager vs local vs graph (+ Inductor).
step "graph mode vs eager vs local compile" 240 uv run python \
  apps/titan_train/benchmarks/graph_vs_eager.py --device cuda --batch-size 8 --seq-len 512

step "checkpoint benchmark, state on the GPU" 120 uv run python \
  libs/torch_checkpointing/benchmarks/vs_dcp.py --device cuda --gib 1 --ranks 1 --reps 3
step "checkpoint load into GPU tensors: pinned staging, H2D overlap, 2 -> 1 and 1 -> 2" 150 \
  uv run python libs/torch_checkpointing/benchmarks/vs_dcp.py --device cuda --gib 0.25 \
  --ranks 2 --reps 3 --layout 1d --shard-numel 4194304
step "CuTe grouped GEMM vs torch._grouped_mm" 60 uv run python \
  libs/dist_moe/benchmarks/bench_cute_grouped_gemm.py
step "pack / combine bandwidth" 60 uv run python libs/dist_moe/benchmarks/bench_pack_bandwidth.py
if [ "$gpus" -ge 2 ]; then
  step "symmetric-memory dispatch vs all-to-all" 90 uv run torchrun --standalone \
    --nproc-per-node "$gpus" libs/dist_moe/benchmarks/bench_symm_dispatch.py
fi
# titan_rl at scale (issue 33): Monarch actors on the GPU (a trainer rank over NCCL, a
# TorchGenerator replica on CUDA, weight slots copied from and to device memory).
step "titan_rl: DistributedGRPO on CUDA" 120 uv run pytest -q -rs -p no:cacheprovider \
  "libs/titan_rl/tests/test_actors.py::test_distributed_grpo_on_cuda"
# titan_rl's vLLM generator on the GPU (issue 33): greedy ids and multi-turn tool episodes equal
# TorchGenerator's. GPU vLLM pins its own torch, so it lives in an environment built elsewhere
# (this machine may have no network): point TITAN_RL_VLLM_GPU_PYTHON at its python.
if [ -n "${TITAN_RL_VLLM_GPU_PYTHON:-}" ]; then
  step "titan_rl: vLLM (GPU) = TorchGenerator, incl. multi-turn" 180 \
    "$TITAN_RL_VLLM_GPU_PYTHON" libs/titan_rl/vllm_generator/check_greedy.py
else
  log "skip: titan_rl vLLM on GPU (set TITAN_RL_VLLM_GPU_PYTHON to a GPU vLLM env's python)"
fi
# FP8 / MXFP8 (issue 27): the real kernels against fp32 on the debug recipe, and a 1B step rate.
cap=$(uv run python -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())')
# NVFP4 (issue 41): only sm100 (compute capability 10.x) has the kernels torch calls.
if [ "$cap" -ge 100 ] && [ "$cap" -lt 110 ]; then
  step "NVFP4 scaled_mm vs the emulation" 90 uv run pytest -q -rs -p no:cacheprovider \
    "libs/titan_models/tests/test_nvfp4.py::test_device_gemms_match_the_emulation"
else
  log "skip: NVFP4 device GEMMs need sm100 (compute capability 10.x); this device is sm$cap"
fi
modes="fp8_rowwise"; [ "$cap" -ge 100 ] && modes="fp8_rowwise mxfp8"
[ "$cap" -ge 100 ] && [ "$cap" -lt 110 ] && modes="$modes nvfp4"
step "low-precision numerics, real kernels, llama3_debug 100 steps" 180 uv run python \
  apps/titan_train/benchmarks/low_precision_numerics.py --kernels auto --modes $modes \
  --steps 100 --out "$report.numerics.png" -- --training.device cuda --training.mixed-precision bf16
for q in $modes; do
  step "Llama 1B, quantize.linear=$q, 30 steps" 120 uv run titan-train --recipe llama3_debug \
    --name "llama3_1b_$q" --model.flavor 1B --model.vocab-size 128256 --training.seq-len 2048 \
    --training.batch-size 8 --training.steps 30 --metrics.log-every 10 \
    --lr-schedule.warmup-steps 10 --quantize.linear "$q" "${common[@]}"
  [ -f "$run/llama3_1b_$q/metrics.jsonl" ] && log "1B $q last: $(grep '"split": "train"' "$run/llama3_1b_$q/metrics.jsonl" | tail -n 1)"
done
rm -rf "$run"
log "== done: exit $status (report: $report)"
exit "$status"
