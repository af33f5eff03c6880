#!/usr/bin/env bash
# The expert-parallel layer with the last dispatch step's blocks in the seal's GEMM call (EPBuffer's
# last_step_with_seal, the default) against a call per step (--separate-seal-gemms), side by side in ONE
# device call on one H200, at most $EPS_BUDGET_S (560 s):
#
#   bash launch/ep_seal_bench.sh     # carry .whl .cache .gemm-build .deepgemm
#
# 1. in the background: DeepGEMM built from .deepgemm/;
# 2. 1 PE: bench.ep_layer at $EPS_TOKENS (1024,4096,8192), uniform routing, chunks 1/2, per-chunk consumer,
#    Triton and CUTLASS, merged then separate -> $OUT/ep-1pe-{merged,separate}.json;
# 3. 1 PE, gemm deep_gemm (block_m 128), merged then separate -> $OUT/ep-1pe-dg-{merged,separate}.json;
# 4. tests/test_gpu_ep.py (1 PE; its multi-PE cases under MPS where it starts them);
# 5. 2 PEs under MPS (50 % of the SMs each): the step-2 runs at 1024,4096 -> $OUT/ep-mps-{merged,separate}.json.
set -uo pipefail
cd "$(dirname "$0")/.."
. launch/device_job.sh eps.log "${EPS_BUDGET_S:-560}"
TOK=${EPS_TOKENS:-1024,4096,8192}
COMMON="--routings uniform --chunks 1,2 --consumers per_chunk --no-baseline --replays 10"

dg_start 240

bench() {  # <name> <launcher prefix...> -- <bench args...>
  local name=$1; shift
  local pre=()
  while [ "$1" != "--" ]; do pre+=("$1"); shift; done
  shift
  local lim=$(( $(left) - 60 )); [ "$lim" -gt 150 ] && lim=150
  [ "$lim" -lt 20 ] && { say "$name: no time left"; return; }
  timeout "$lim" "${pre[@]}" python3 -m bench.ep_layer $COMMON --budget-s $(( lim - 30 )) \
    --json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  say "=== $name rc=$? ($(( $(date +%s) - T0 )) s)"
  grep -E "^ +[0-9]+ uniform" "$OUT/$name.log" | grep -E " - " | tee -a "$LOG"
}
say "=== 2. 1 PE, Triton and CUTLASS"
bench ep-1pe-merged -- --tokens "$TOK" --gemms triton,cutlass
bench ep-1pe-separate -- --tokens "$TOK" --gemms triton,cutlass --separate-seal-gemms

say "=== 3. 1 PE, DeepGEMM ($(( $(date +%s) - T0 )) s)"
dg_wait "$(limit 240 150)"
if [ "$DG_RC" = 0 ]; then
  bench ep-1pe-dg-merged -- --tokens "$TOK" --gemms deep_gemm --block-m 128
  bench ep-1pe-dg-separate -- --tokens "$TOK" --gemms deep_gemm --block-m 128 --separate-seal-gemms
fi

say "=== 4. tests/test_gpu_ep.py ($(( $(date +%s) - T0 )) s)"
lim=$(( $(left) - 130 )); [ "$lim" -gt 150 ] && lim=150
timeout "$lim" python3 -m pytest -q -rs tests/test_gpu_ep.py -p no:cacheprovider > "$OUT/tests_gpu_ep.log" 2>&1
say "tests rc=$?"
tail -6 "$OUT/tests_gpu_ep.log" | tee -a "$LOG"

say "=== 5. 2 PEs under MPS ($(( $(date +%s) - T0 )) s)"
export CUDA_MPS_PIPE_DIRECTORY="$(mktemp -d)" CUDA_MPS_LOG_DIRECTORY="$(mktemp -d)"
if nvidia-cuda-mps-control -d >>"$LOG" 2>&1; then
  sleep 1
  export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50
  MPI=(mpiexec --allow-run-as-root --bind-to none -n 2)
  bench ep-mps-merged "${MPI[@]}" -- --tokens 1024,4096 --gemms triton,cutlass
  bench ep-mps-separate "${MPI[@]}" -- --tokens 1024,4096 --gemms triton,cutlass --separate-seal-gemms
  echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
else
  say "could not start the MPS daemon"
fi
say "=== done ($(( $(date +%s) - T0 )) s)"
