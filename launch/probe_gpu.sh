#!/usr/bin/env bash
# One GPU's share of a device call (launch/device_tracks.sh runs it beside another track): the
# discriminating experiments of issue 23 (MPS contexts, pdl), the GPU tests of the layer on one PE,
# the Hugging Face swap on the GPU layer, and the memory checker with what time is left.
#   bash launch/probe_gpu.sh          # logs under $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET="${PROBE_BUDGET_S:-520}"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
step() {  # step NAME SECONDS CMD...: run with a timeout (never past the budget), log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local l; l=$(left)
  [ "$l" -gt 20 ] || { echo "=== $name: SKIPPED (budget)"; return; }
  [ "$limit" -lt "$l" ] || limit=$(( l - 10 ))
  echo "=== $name (limit ${limit}s, t=$(( $(date +%s) - T0 ))s)"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -15 "$OUT/$name.log"
  echo "=== $name: rc=$rc ($(( $(date +%s) - T0 ))s)"
}
step mps_probe 120 env MPS_GPU="${CUDA_VISIBLE_DEVICES:-0}" bash launch/mps_probe.sh
step pdl_probe 120 python3 -m bench.pdl_probe --json "$OUT/pdl-probe.json"
step pytest_gpu 300 python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_ep.py tests/test_gpu_persistent.py \
  tests/test_gpu_ep_rules.py tests/test_gpu_hostile.py tests/test_gpu.py
step hf_gpu 120 mpiexec --allow-run-as-root -n 1 python3 tests/mp_hf.py drop_in_gpu
step sanitize "$(left)" env SANITIZE_BUDGET_S=$(( $(left) - 20 )) bash launch/sanitize.sh
echo "probe_gpu: done in $(( $(date +%s) - T0 ))s"
