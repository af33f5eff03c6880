#!/usr/bin/env bash
# One GPU's share of a device call (launch/device_tracks.sh runs it beside another track): the
# discriminating experiments of issue 23 (MPS contexts, pdl), then the GPU check's single-PE and MPS
# phases (the layer under every policy, the GPU tests natively, the HF swap, 2/3/4 PEs under MPS).
#   bash launch/probe_gpu.sh          # logs under $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET="${PROBE_BUDGET_S:-530}"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
step() {  # step NAME SECONDS CMD...: run with a timeout (never past the budget), log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local l; l=$(left)
  [ "$l" -gt 20 ] || { echo "=== $name: SKIPPED (budget)"; return; }
  [ "$limit" -lt "$l" ] || limit=$(( l - 10 ))
  echo "=== $name (limit ${limit}s, t=$(( $(date +%s) - T0 ))s)"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -${TAIL:-12} "$OUT/$name.log"
  echo "=== $name: rc=$rc ($(( $(date +%s) - T0 ))s)"
}
step mps_probe 60 env MPS_GPU="${CUDA_VISIBLE_DEVICES:-0}" bash launch/mps_probe.sh
step pdl_probe 100 python3 -m bench.pdl_probe --json "$OUT/pdl-probe.json"
TAIL=60 step gpu_check "$(left)" env GPU_CHECK_PHASES="${PROBE_PHASES:-single mps}" \
  GPU_CHECK_BUDGET_S=$(( $(left) - 25 )) GPU_CHECK_REPLAYS=2000 bash launch/gpu_check.sh
echo "probe_gpu: done in $(( $(date +%s) - T0 ))s"
