#!/usr/bin/env bash
# A/B of a build-time variant of the ring kernels in ONE device call: launch/ep_mps_bench.sh (2 PEs under MPS)
# twice, first with the default build of csrc/, then with AB_DEFINES passed to the build
# (STREAMRING_NVCC_DEFINES, streamring/device/build.py; its own cubin cache), the same EPM_* settings both
# times, each under $OUT/default and $OUT/variant; the two runs' printed tables end $OUT/ab.log.
#
#   AB_DEFINES="SR_ONE_WARP=" EPM_TESTS=0 EPM_RUN=0 EPM_TOKENS=4096,8192 EPM_GEMMS=cutlass EPM_CHUNKS=1 \
#     EPM_ARGS="--orders ready --straggler-ms 3 --straggler-ranks 1 --skew-ms= --replays 10" \
#     bash launch/ab_nvcc_defines.sh          # carry .whl and .gemm-build
#
# AB_BUDGET_S (560): the whole call; each run gets half. Every ratio a run prints is over the batch path of
# that run (same build), so the two runs compare through their ratios.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE_NEEDS_MPI=1  # (ep_mps_bench.sh starts ranks with mpiexec)
. launch/device_env.sh ab.log "${AB_BUDGET_S:-560}"
[ -n "${AB_DEFINES:-}" ] || { say "ab_nvcc_defines.sh: AB_DEFINES is empty: give the NAME=VALUE words of the variant build, e.g. AB_DEFINES=SR_ONE_WARP="; exit 2; }
ROOT_OUT="$OUT"
HALF=$(( ${AB_BUDGET_S:-560} / 2 ))
RC=0
for variant in default variant; do
  mkdir -p "$ROOT_OUT/$variant"
  if [ "$variant" = default ]; then defs=""; cache="$PWD/.cache/streamring"
  else defs="$AB_DEFINES"; cache="$PWD/.cache/streamring-variant"; fi
  say "=== $variant build (STREAMRING_NVCC_DEFINES='$defs', $(( $(date +%s) - T0 )) s)"
  OUT="$ROOT_OUT/$variant" STREAMRING_NVCC_DEFINES="$defs" STREAMRING_CACHE="$cache" EPM_BUDGET_S=$HALF \
    bash launch/ep_mps_bench.sh > "$ROOT_OUT/$variant/stdout.log" 2>&1
  rc=$?; [ $rc = 0 ] || RC=$rc
  say "rc=$rc"
  tail -45 "$ROOT_OUT/$variant/ep_mps.log" >> "$LOG" 2>/dev/null
done
exit $RC
