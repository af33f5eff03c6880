#!/usr/bin/env bash
# Issue 21's measurements in ONE device call on one H200 (3-4 minutes measured; at most $GL_BUDGET_S):
#
#   bash launch/gemm_layer_h200.sh     # carry .gemm-build .deepgemm .whl .cache
#
# 1. launch/gemm_h200.sh without bench.gemm's own layer rows (GEMM_ARGS=--layer-tokens=): every GEMM
#    at 128/1024/8192/32768 tokens beside DeepGEMM (psum, m_indices, exact M) and torch, the heuristic
#    table, tests/test_deep_gemm.py -> $OUT/gemm-<date>.json, $OUT/gemm_table.json, $OUT/gemm.log;
# 2. the whole batch layer at 8192 tokens, DeepGEMM, CUTLASS and Triton in one process with interleaved
#    replays, twice (two processes) -> $OUT/layer_run{1,2}.log;
# 3. the expert-parallel batch layer on 1 PE with DeepGEMM (block_m 128) against its own GEMM-only
#    time -> $OUT/ep-1pe-dg.json.
# Steps 2 and 3 take what is left of $GL_BUDGET_S (580 s from the start: the device call's limit is
# 600 s), so a slow step 1 shortens them rather than the call being cut.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
T0=$(date +%s)
END=$(( T0 + ${GL_BUDGET_S:-580} ))
cap() { local l=$(( END - $(date +%s) )); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 1 ] && l=1; echo "$l"; }
GEMM_BUDGET_S=${GEMM_BUDGET_S:-420} GEMM_ARGS="--layer-tokens=" bash launch/gemm_h200.sh > /dev/null 2>&1
echo "gemm_h200 rc=$?"
tail -40 "$OUT/gemm.log"
LOG="$OUT/layer.log"
say() { echo "$*" | tee -a "$LOG"; }
. launch/device_env.sh
export STREAMRING_CACHE="${STREAMRING_CACHE:-/tmp/streamring-cache}"
IMPLS=cutlass,triton
if [ -f .dg-site/deep_gemm_env.sh ]; then
  . .dg-site/deep_gemm_env.sh
  IMPLS=deep_gemm,cutlass,triton
fi
for i in 1 2; do
  timeout "$(cap 120)" python3 launch/layer_probe.py "$IMPLS" 8192 30 > "$OUT/layer_run$i.log" 2>&1
  say "layer_probe run $i rc=$?"
  grep -E "median|bitwise|psum|Error" "$OUT/layer_run$i.log" | tee -a "$LOG"
done
if [ -f .dg-site/deep_gemm_env.sh ]; then
  timeout "$(cap 150)" python3 -m bench.ep_layer --tokens 4096,8192 --routings uniform --chunks 1 --gemms deep_gemm,cutlass \
    --block-m 128 --no-baseline --straggler-ranks '' --budget-s 100 --json "$OUT/ep-1pe-dg.json" \
    > "$OUT/ep-1pe-dg.log" 2>&1
  say "ep_layer rc=$?"
  grep -E "^ +[0-9]+ uniform|gemm-only" "$OUT/ep-1pe-dg.log" | tee -a "$LOG"
fi
