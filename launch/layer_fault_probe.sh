#!/usr/bin/env bash
# Narrows the open fault of bench.gemm's whole-layer rows (docs/deep_gemm.md, "Open"): after a run's
# per-GEMM rows with DeepGEMM on, a layer graph's first replay ends with cudaErrorInvalidAddressSpace or
# an illegal address; a fresh process runs the same layers cleanly. ONE device call, each case in its
# own process, every case's verdict in $OUT/layer_fault.log (exit status 0 iff every case passed):
#   a. DeepGEMM per-GEMM rows only (no CUTLASS variant), then the layer rows     (CUTLASS plans involved?)
#   b. CUTLASS per-GEMM rows at another size (1024), DeepGEMM on, then the layer  (the same size involved?)
#   c. a, with every captured graph replaced by eager calls (--no-graphs): graph replay involved?
#   bash launch/layer_fault_probe.sh      # carry .whl, .gemm-build and .deepgemm
# Env: PROBE_BUDGET_S (default 400), PROBE_CASES (default "a b c").
set -uo pipefail
cd "$(dirname "$0")/.."
. launch/device_job.sh layer_fault.log "${PROBE_BUDGET_S:-400}"
dg_start 200
dg_wait "$(limit 200 150)"
[ "$DG_RC" = 0 ] || { say "layer_fault_probe: DeepGEMM did not build (see deep_gemm_build.log)"; exit 1; }
common=(--sets 1 --replays 3 --layer-replays 3 --layer-tokens 8192)
failed=""
for c in ${PROBE_CASES:-a b c}; do
  case $c in
    a) args=(--tokens 8192 --l1= --l2=) ;;
    b) args=(--tokens 1024 --l1 coop128:bf16,pingpong64:bf16 --l2 coop128,pingpong64) ;;
    c) args=(--tokens 8192 --l1= --l2= --no-graphs) ;;
    *) say "unknown case $c"; failed="$failed $c"; continue ;;
  esac
  say "=== case $c: python -m bench.gemm ${args[*]} ${common[*]} ($(left) s left)"
  timeout "$(limit 150 10)" python3 -m bench.gemm "${args[@]}" "${common[@]}" \
    --json "$OUT/case-$c.json" > "$OUT/case-$c.log" 2>&1
  rc=$?
  grep -E "layer T=|cannot run|first timed call failed|Error:" "$OUT/case-$c.log" | grep -v "check " | head -12 | tee -a "$LOG"
  say "case $c: rc=$rc"
  [ "$rc" = 0 ] || failed="$failed $c"
done
say "=== done in $(( $(date +%s) - T0 )) s; cases that failed:${failed:- none}"
[ -z "$failed" ]
