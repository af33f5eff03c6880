#!/usr/bin/env bash
# One device call (nvidia-h200): the expert GEMMs where the weights dominate, DeepGEMM side by side.
#   bash launch/gemm_small_h200.sh     # carry .whl .cache .gemm-build .deepgemm
# 1. DeepGEMM built in the background (launch/build_deep_gemm.sh);
# 2. bench.triton_gemm_launch (env SWEEP_TOKENS, SWEEP_BM, SWEEP_STAGES, SWEEP_WARPS; default 8192 tokens,
#    block_m 64 and 128); its limits assume BUDGET_S near the default (a smaller one cuts the sweep and
#    the DeepGEMM build to 5 s);
# 3. bench.gemm at 128 tokens with 16-row blocks (Triton, DeepGEMM, torch) and at 1024 tokens with 64-row
#    blocks (Triton, CUTLASS ping-pong 64 / cooperative 128, DeepGEMM, torch), each in one process;
# 4. the GPU tests of the block consumer, the EP layer and DeepGEMM.
# Logs and JSON under $OUT (gemm-small.log, bench-*.log, gemm-*.json, triton-gemm-launch-8192.json).
set -uo pipefail
cd "$(dirname "$0")/.."
. launch/device_job.sh gemm-small.log "${BUDGET_S:-570}"
export STREAMRING_CACHE="${STREAMRING_CACHE:-/tmp/streamring-cache}"
say "=== 1. DeepGEMM build in the background"
dg_start "${DG_BUILD_TIMEOUT:-240}"
say "=== 2. Triton launch variants (${SWEEP_TOKENS:=8192} tokens, block_m ${SWEEP_BM:=64,128}; $(left) s left)"
timeout "$(limit 150 380)" python -m bench.triton_gemm_launch --tokens "$SWEEP_TOKENS" --block-m "$SWEEP_BM" \
    --stages "${SWEEP_STAGES:-3,4,5}" --warps "${SWEEP_WARPS:-4,8}" --replays 5 --rounds 2 --json "$OUT/triton-gemm-launch-sweep.json" 2>&1 \
    | grep -v CUDAEvent | tee -a "$LOG"
say "=== waiting for the DeepGEMM build ($(left) s left)"
dg_wait "$(limit 240 330)"
say "=== 3. bench.gemm 128 tokens, block_m 16 ($(left) s left)"
timeout "$(limit 130 200)" python -m bench.gemm --tokens 128 --block-m 16 --l1 "" --l2 "" --layer-tokens "" \
    --json "$OUT/gemm-128-bm16.json" > "$OUT/bench-128.log" 2>&1; say "rc=$?"
grep -v "^\[.*check " "$OUT/bench-128.log" | tail -30 >> "$LOG"
say "=== 3b. bench.gemm 1024 tokens, block_m 64 ($(left) s left)"
timeout "$(limit 150 60)" python -m bench.gemm --tokens 1024 --block-m 64 --l1 "pingpong64:bf16,coop128:bf16" \
    --l2 "pingpong64,coop128" --layer-tokens "" --json "$OUT/gemm-1024-bm64.json" > "$OUT/bench-1024.log" 2>&1; say "rc=$?"
grep -v "^\[.*check " "$OUT/bench-1024.log" | tail -30 >> "$LOG"
if [ -n "${LAYER_8192:-}" ]; then
  say "=== 3c. bench.gemm 8192 tokens, block_m 64, Triton and DeepGEMM ($(left) s left)"
  timeout "$(limit 120 60)" python -m bench.gemm --tokens 8192 --block-m 64 --l1 "" --l2 "" --layer-tokens "" \
      --json "$OUT/gemm-8192-bm64.json" > "$OUT/bench-8192.log" 2>&1; say "rc=$?"
  grep -v "^\[.*check " "$OUT/bench-8192.log" | tail -24 >> "$LOG"
fi
say "=== 4. GPU tests ($(left) s left)"
timeout "$(limit 200 5)" python -m pytest -q -p no:cacheprovider tests/test_blocks.py tests/test_gpu_ep.py tests/test_deep_gemm.py tests/test_gpu_persistent.py \
    2>&1 | tail -4 | tee -a "$LOG"
say "done in $(( $(date +%s) - T0 )) s"
