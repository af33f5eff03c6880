#!/usr/bin/env bash
# EPTuning(seal_by_expert=True), the default, against False (the seal after the full blocks) in ONE device call
# of at most $SEAL_AB_BUDGET_S (560 s):
#
#   bash launch/seal_layout_ab.sh        # carry .whl and .gemm-build
#
# 1. the GEMMs alone on the whole GPU (python -m bench.gemm_launches, CUTLASS on 128-row blocks, 32 experts: each
#    expert's rows those of one of a PE's 32 experts with 2 PEs of SEAL_AB_TOKENS tokens): the batch call and the
#    per-chunk calls with the allocator's order and expert by expert (its batch_e, chunk_e, b_e/b, c_e/c columns)
#    -> $OUT/gemm/;
# 2. the layer end to end, 2 PEs under MPS (launch/ep_mps_bench.sh): after_full_blocks (--seal-after-full-blocks)
#    and by_expert (the default) alternating, SEAL_AB_ROUNDS (1) rounds of SEAL_AB_RUN_S (150) s each, one chunk,
#    ready order, PEs 0 and 1 late 3 ms -> $OUT/<round>-<variant>/; then python -m bench.compare_runs prints them
#    side by side (-> $OUT/compare.log).
# Everything under $OUT is packed into $OUT/seal_ab.tgz (a device call brings back a few files only).
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE_NEEDS_MPI=1  # (ep_mps_bench.sh starts ranks with mpiexec)
. launch/device_env.sh seal_ab.log "${SEAL_AB_BUDGET_S:-560}"
export STREAMRING_CACHE="${STREAMRING_CACHE:-/tmp/streamring-cache}"  # one cubin build for every step
O="$OUT"
RUN_S="${SEAL_AB_RUN_S:-150}"
TOKENS="${SEAL_AB_TOKENS:-4096,8192}"
say "=== 1. GEMMs alone ($(left) s left)"
OUT="$O/gemm" GEMM_BUDGET_S="${SEAL_AB_GEMM_S:-120}" GEMM_DEEP_GEMM=off LAUNCHES_TOKENS="$TOKENS" LAUNCHES_CHUNKS=2 \
  LAUNCHES_IMPLS=cutlass LAUNCHES_ARGS="--block-m 128 --experts 32 --replays 15" bash launch/gemm_bench.sh launches
mkdir -p "$O/gemm"
tail -6 "$O/gemm/launches.log" 2>/dev/null | tee -a "$LOG"
ARGS="--orders ready --block-m 128 --straggler-ms 3 --straggler-ranks 0,1 --skew-ms= --replays 12"
PAIRS=()
for round in $(seq 1 "${SEAL_AB_ROUNDS:-1}"); do
  for v in after_full_blocks by_expert; do
    if [ "$(left)" -lt $(( RUN_S + 10 )) ]; then say "budget spent: round $round $v not run"; continue; fi
    extra=""; [ "$v" = after_full_blocks ] && extra="--seal-after-full-blocks"
    say "=== 2. round $round, $v ($(left) s left)"
    OUT="$O/$round-$v" EPM_BUDGET_S="$RUN_S" EPM_TESTS=0 EPM_RUN=0 EPM_TOKENS="$TOKENS" EPM_GEMMS=cutlass EPM_CHUNKS=1 \
      EPM_ARGS="$ARGS $extra" bash launch/ep_mps_bench.sh > /dev/null 2>&1
    say "rc=$?"
    [ -s "$O/$round-$v/ep-layer-mps.json" ] && PAIRS+=("$round-$v=$O/$round-$v/ep-layer-mps.json")
  done
done
if [ ${#PAIRS[@]} -gt 0 ]; then
  python3 -m bench.compare_runs "${PAIRS[@]}" | tee "$O/compare.log" | tee -a "$LOG"
fi
(cd "$O" && tar czf /tmp/seal_ab.tgz . && mv /tmp/seal_ab.tgz "$O/seal_ab.tgz")
