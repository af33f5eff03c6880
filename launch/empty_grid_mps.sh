#!/usr/bin/env bash
# What the grouped ready steps' oversized GEMM grids cost (bench.empty_grid), on ONE H200, as one process
# with all the SMs and as an MPS client with a 2-PE and a 4-PE share (50 and 25 %), in one device call:
#
#   bash launch/empty_grid_mps.sh     # carry .whl (launch/fetch_wheels.sh)
#
# -> $OUT/empty-grid.json, $OUT/empty_grid.log
#
# Env: EG_ARGS (extra bench.empty_grid arguments), EG_BUDGET_S (the call's time, default 240).
set -uo pipefail
cd "$(dirname "$0")/.."
. launch/device_env.sh empty_grid.log "${EG_BUDGET_S:-240}"
rm -f "$OUT/empty-grid.json"
RUN=(python3 -m bench.empty_grid --ranks 2,4 --tokens 1024 --json "$OUT/empty-grid.json" ${EG_ARGS:-})
say "=== no MPS, all SMs ($(( $(date +%s) - T0 )) s)"
timeout "$(limit 90 120)" "${RUN[@]}" --label "no MPS" >> "$LOG" 2>&1; say "rc=$?"
trap mps_stop EXIT
mps_start || { say "could not start the MPS daemon"; exit 3; }
for P in 50 25; do
  say "=== an MPS client at $P % ($(( $(date +%s) - T0 )) s)"
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$P timeout "$(limit 60 20)" "${RUN[@]}" --label "MPS $P %" >> "$LOG" 2>&1
  say "rc=$?"
done
mps_stop
grep -a "R=.*ready blocks" "$LOG"
say "=== done ($(( $(date +%s) - T0 )) s)"
