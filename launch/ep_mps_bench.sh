#!/usr/bin/env bash
# Issue 20 on ONE H200: the expert-parallel layer with 2 PEs sharing the GPU under MPS (half the SMs
# each), batch against streamed, with a 1 ms straggler on each PE in turn; then where the time of the
# one-GPU batch layer goes (kernels per forward). One device call, at most $EPM_BUDGET_S (560 s):
#
#   bash launch/ep_mps_bench.sh     # carry .whl .cache .gemm-build .deepgemm
#
# 1. in the background: DeepGEMM built from .deepgemm/ (for step 3);
# 2. MPS daemon, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50, `mpiexec -n 2 python3 -m bench.ep_layer` at
#    $EPM_TOKENS (1024,4096) tokens per rank, uniform routing, chunks 1/2/4, consumers per_chunk and
#    persistent, $EPM_GEMMS (triton,cutlass); no torch + NCCL baseline (NCCL refuses two ranks on one
#    GPU) -> $OUT/ep-layer-mps.json, $OUT/ep-timelines-mps.json; MPS stopped;
# 3. LAYER_PROBE_KERNELS=1 launch/layer_probe.py deep_gemm,cutlass 8192: replay times and the kernels
#    per forward of the one-GPU batch layer.
# What two PEs on one GPU cannot show: NVLink transfers (every pull is GPU-local), and each PE's GEMMs
# run on half the SMs; what it can show is the schedule: whether a late source delays only its rows.
set -uo pipefail
cd "$(dirname "$0")/.."
. launch/device_job.sh epm.log "${EPM_BUDGET_S:-560}"
export STREAMRING_CACHE="${STREAMRING_CACHE:-$PWD/.cache/streamring}"

say "=== 1. DeepGEMM build in the background ($(( $(date +%s) - T0 )) s)"
dg_start 240

say "=== 2. EP layer, 2 PEs under MPS ($(( $(date +%s) - T0 )) s)"
export CUDA_MPS_PIPE_DIRECTORY="$(mktemp -d)" CUDA_MPS_LOG_DIRECTORY="$(mktemp -d)"
if nvidia-cuda-mps-control -d >>"$LOG" 2>&1; then
  sleep 1
  BUDGET=$(( $(left) - 150 ))
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 timeout "$BUDGET" mpiexec --allow-run-as-root --bind-to none -n 2 \
    -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY \
    python3 -m bench.ep_layer --tokens "${EPM_TOKENS:-1024,4096}" --routings uniform --chunks 1,2,4 \
    --consumers per_chunk,persistent --gemms "${EPM_GEMMS:-triton,cutlass}" --no-baseline \
    --budget-s $(( BUDGET - 60 )) --json "$OUT/ep-layer-mps.json" --timeline-json "$OUT/ep-timelines-mps.json" \
    ${EPM_ARGS:-} > "$OUT/ep_mps.log" 2>&1
  say "ep_layer rc=$?"
  tail -60 "$OUT/ep_mps.log" | tee -a "$LOG"
  echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
  sleep 1
else
  say "could not start the MPS daemon"
fi
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY

say "=== 3. the one-GPU batch layer's kernels ($(( $(date +%s) - T0 )) s, $(left) s left)"
dg_wait "$(limit 240 30)"
IMPLS=cutlass
[ "$DG_RC" = 0 ] && IMPLS=deep_gemm,cutlass
LAYER_PROBE_KERNELS=1 timeout $(( $(left) - 5 )) python3 launch/layer_probe.py "$IMPLS" 8192 30 \
  > "$OUT/layer_kernels.log" 2>&1
say "layer_probe rc=$?"
grep -E "median|bitwise|kernels|layer_probe:   |Error|error" "$OUT/layer_kernels.log" | tee -a "$LOG"
say "=== done ($(( $(date +%s) - T0 )) s)"
