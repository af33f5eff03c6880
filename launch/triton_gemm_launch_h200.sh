#!/usr/bin/env bash
# One device call (nvidia-h200): the Triton expert GEMMs' launch variants (bench/triton_gemm_launch.py) at
# 128 and 1024 tokens, then the Triton GEMM tests of the block consumer (bitwise streamed == batch), logs
# and JSON under $OUT.   run: bash launch/triton_gemm_launch_h200.sh   (env: TOKENS, BLOCK_M, STAGES, WARPS)
set -uo pipefail
cd "$(dirname "$0")/.."
. launch/device_job.sh triton-gemm-launch.log "${BUDGET_S:-540}"
say "== bench.triton_gemm_launch (budget $(left) s)"
timeout "$(limit 420 60)" python -m bench.triton_gemm_launch --tokens "${TOKENS:-128,1024}" --block-m "${BLOCK_M:-16,32,64}" \
    --stages "${STAGES:-3,4,5,6}" --warps "${WARPS:-4,8}" --json "$OUT/triton-gemm-launch.json" 2>&1 | tee -a "$LOG"
say "rc=${PIPESTATUS[0]}"
say "== GPU tests of the block consumer"
timeout "$(limit 120 5)" python -m pytest -q -p no:cacheprovider tests/test_blocks.py tests/test_gpu_ep.py -x 2>&1 | tail -5 | tee -a "$LOG"
say "done in $(( $(date +%s) - T0 )) s"
