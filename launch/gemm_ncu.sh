#!/usr/bin/env bash
# Nsight Compute on one launch of each expert GEMM at one size (issue 21: what limits our kernel where
# DeepGEMM is faster), ONE device call on one H200:
#
#   NCU_TOKENS=32768 bash launch/gemm_ncu.sh      # carry .whl, .gemm-build and .deepgemm
#
# DeepGEMM is built from .deepgemm/ first (launch/build_deep_gemm.sh; without it only ours is
# profiled), then `ncu` runs launch/gemm_profile.py: one warm-up call each, then one profiled launch of
# the CUTLASS L1 and L2 variants named and DeepGEMM's L1 and L2 (its own layout, exact M).
# (Ran on the H200 with --launch-skip 4 --launch-count 4 instead, which needs DeepGEMM's launches.)
# Logs: $OUT/gemm_ncu.log (the lines that matter), $OUT/ncu.log (ncu's whole report).
# Env: NCU_TOKENS (default 32768), NCU_L1 / NCU_L2 (bench.gemm variant specs, default the table's
# CUTLASS picks at 32768, within run-to-run noise of s1: coop128:bf16:n and coop128:n:s4),
# NCU_BUDGET_S (default 360).
set -uo pipefail
cd "$(dirname "$0")/.."
. launch/device_job.sh gemm_ncu.log "${NCU_BUDGET_S:-360}"
dg_start 200
dg_wait "$(limit 200 120)"
[ "$DG_RC" = 0 ] || say "gemm_ncu: DeepGEMM did not build (see deep_gemm_build.log): ours only"
T=${NCU_TOKENS:-32768}
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
[ -x "$NCU" ] || { say "gemm_ncu: ncu not found"; exit 1; }
say "=== ncu at $T tokens ($(left) s left)"
# --profile-from-start off: gemm_profile.py brackets its profiled calls with cudaProfilerStart/Stop, so the
# warm-up launches are left out whether or not DeepGEMM's two kernels are among them
timeout "$(limit 300 10)" "$NCU" --target-processes all -k regex:'device_kernel|sm90_fp8_gemm' \
  --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section WarpStateStats --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
  python3 launch/gemm_profile.py "$T" "${NCU_L1:-coop128:bf16:n}" "${NCU_L2:-coop128:n:s4}" > "$OUT/ncu.log" 2>&1
rc=$?
say "ncu rc=$rc"
grep -E "gemm_profile|device_kernel|sm90_fp8|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Hit Rate|Duration|Waves Per SM|Issue Slots Busy|Executed Ipc Active|highest-utilized|stalled|Achieved Occupancy|Registers Per|Grid Size|Cluster Size|ERR|==PROF==|Warning" \
  "$OUT/ncu.log" | cut -c1-400 | head -160 >> "$LOG"
say "=== done in $(( $(date +%s) - T0 )) s"
exit $rc
