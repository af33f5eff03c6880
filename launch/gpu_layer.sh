#!/usr/bin/env bash
# The layer benchmark in ONE device call (see docs/gpu.md, "Layer benchmark"):
#
#   bash launch/gpu_layer.sh          # logs and JSON under $OUT (default ./out)
#
# 1. installs the carried wheels (.whl/) into .site (the machine has no network);
# 2. tests/test_blocks.py natively on the GPU (the block consumer's kernels, bitwise
#    streamed == batch, tolerance against a float32 emulation);
# 3. bench/layer_gpu.py: DeepSeek-V3-shaped layer at $LAYER_TOKENS tokens (batch vs
#    streamed under every progress policy, producer/MoE alone, L1 vs torch._scaled_grouped_mm,
#    idle-consumer cost, device timeline) -> $OUT/layer.json;
# 4. protocol overhead per chunk with 1, 2 and 4 PEs on the one GPU (MPS; timings on a shared
#    GPU) -> $OUT/protocol-{1,2,4}.json.
# Env: LAYER_TOKENS (default 128,1024,8192,32768), LAYER_BUDGET_S (default 400),
#      LAYER_ARGS (extra bench arguments), LAYER_SKIP_MPS=1.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
LOG="$OUT/gpu_layer.log"
: > "$LOG"
T0=$(date +%s)
export PYTHONUNBUFFERED=1
# Every stream gets its own hardware queue: with the default 8 connections two streams can share
# one, and a consumer's cuStreamWaitValue64 (stream_wait policy, no deadline) enqueued before its
# producer then blocks that producer for good.
export CUDA_DEVICE_MAX_CONNECTIONS=32
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_osc="^ucx"
export STREAMRING_CACHE="${STREAMRING_CACHE:-/tmp/streamring-cache}"
say() { echo "$*" | tee -a "$LOG"; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl >>"$LOG" 2>&1 \
    || { say "gpu_layer: installing the carried wheels failed"; exit 3; }
fi
export PYTHONPATH="$PWD/.site:$PWD:${PYTHONPATH:-}"
nvidia-smi -L | tee -a "$LOG"

say "=== tests/test_blocks.py on the GPU"
timeout 240 python3 -m pytest -q -x tests/test_blocks.py -p no:cacheprovider 2>&1 | tail -15 | tee -a "$LOG"

say "=== layer benchmark"
timeout "${LAYER_BUDGET_S:-400}" python3 -m bench.layer_gpu --tokens "${LAYER_TOKENS:-128,1024,8192,32768}" \
  --timeline-json --budget-s $(( ${LAYER_BUDGET_S:-400} - 60 )) --json "$OUT/layer.json" ${LAYER_ARGS:-} 2>&1 | tee -a "$LOG"
say "gpu_layer: bench exit ${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s"

if [ "${LAYER_SKIP_MPS:-0}" != 1 ]; then
  say "=== protocol overhead per chunk (synthetic payload), 1 PE"
  timeout 60 mpiexec -n 1 python3 -m streamring gpu-check --policies stream_wait,spin_kernel,serialized \
    --replays 3000 --json "$OUT/protocol-1.json" 2>&1 | tail -6 | tee -a "$LOG"
  export CUDA_MPS_PIPE_DIRECTORY="$(mktemp -d)" CUDA_MPS_LOG_DIRECTORY="$(mktemp -d)"
  if nvidia-cuda-mps-control -d >>"$LOG" 2>&1; then
    sleep 1
    for n in 2 4; do
      say "=== protocol overhead per chunk, $n PEs under MPS (shared GPU)"
      CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / n)) timeout 90 mpiexec --oversubscribe -n $n python3 -m streamring \
        gpu-check --policies stream_wait,spin_kernel,serialized --replays 3000 --json "$OUT/protocol-$n.json" 2>&1 | tail -6 | tee -a "$LOG"
    done
    echo quit | nvidia-cuda-mps-control >/dev/null 2>&1 || true
  else
    say "gpu_layer: MPS did not start: multi-PE protocol overhead not measured"
  fi
fi
say "gpu_layer: done in $(( $(date +%s) - T0 )) s"
