#!/usr/bin/env bash
# DeepGEMM's psum layout in the batch layer, and what limits the CUTLASS GEMMs (issue 21), in ONE device
# call on one H200, at most $DGL_BUDGET_S (540 s):
#
#   bash launch/deep_gemm_layer.sh     # carry .gemm-build .deepgemm .whl
#
# 1. DeepGEMM built from .deepgemm/ (launch/build_deep_gemm.sh);
# 2. tests/test_deep_gemm.py (the psum batch == the m_indices streamed path bitwise, among the rest);
# 3. the whole batch layer at $DGL_TOKENS (8192) through launch/layer_probe.py, each in its own process:
#    DeepGEMM with the psum layout and with m_indices in one process (their outputs compared bitwise),
#    then CUTLASS, then Triton; each graph replayed $DGL_REPLAYS (30) times;
# 4. Nsight Compute on one launch of each GEMM at 8192 tokens (launch/gemm_profile.py): our CUTLASS
#    L1/L2 picks and DeepGEMM's on the exact M: speed of light, tensor pipe, warp stalls, waves.
# Logs: $OUT/dgl.log (everything), $OUT/deep_gemm_build.log, $OUT/tests_deep_gemm.log,
#       $OUT/layer_*.log, $OUT/ncu.log (+ $OUT/ncu.csv).
set -uo pipefail
cd "$(dirname "$0")/.."
. launch/device_job.sh dgl.log "${DGL_BUDGET_S:-540}"
TOK=${DGL_TOKENS:-8192}
REPLAYS=${DGL_REPLAYS:-30}
export STREAMRING_CACHE="${STREAMRING_CACHE:-/tmp/streamring-cache}"

say "=== 1. DeepGEMM build ($(( $(date +%s) - T0 )) s)"
dg_start "$(limit 200 300)"
dg_wait "$(limit 200 300)"

say "=== 2. tests/test_deep_gemm.py ($(( $(date +%s) - T0 )) s)"
timeout "$(limit 150 240)" python3 -m pytest -q -rs tests/test_deep_gemm.py -p no:cacheprovider \
  > "$OUT/tests_deep_gemm.log" 2>&1
say "tests rc=$?"
tail -8 "$OUT/tests_deep_gemm.log" | tee -a "$LOG"

say "=== 3. the batch layer at $TOK tokens ($(( $(date +%s) - T0 )) s)"
for impls in deep_gemm,deep_gemm:indices cutlass triton; do
  f="$OUT/layer_${impls//[,:]/_}.log"
  timeout "$(limit 100 90)" python3 launch/layer_probe.py "$impls" "$TOK" "$REPLAYS" > "$f" 2>&1
  say "layer_probe $impls rc=$?"
  grep -E "median|bitwise|psum|Error|error" "$f" | tee -a "$LOG"
done

say "=== 4. ncu on one launch per GEMM at 8192 tokens ($(( $(date +%s) - T0 )) s)"
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if [ -x "$NCU" ]; then
  timeout "$(limit 200 10)" "$NCU" --target-processes all -k regex:'device_kernel|sm90_fp8_gemm' \
    --launch-skip 4 --launch-count 4 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
    python3 launch/gemm_profile.py 8192 > "$OUT/ncu.log" 2>&1
  say "ncu rc=$?"
  grep -E "gemm_profile|device_kernel|sm90_fp8|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Duration|Waves Per SM|Issue Slots Busy|Executed Ipc Active|Stall|Achieved Occupancy|Registers Per|Block Size|Grid Size|Cluster|Tensor|ERR|==PROF==|Warning" \
    "$OUT/ncu.log" | head -150 | tee -a "$LOG"
else
  say "ncu: not found"
fi
say "=== done ($(( $(date +%s) - T0 )) s)"
