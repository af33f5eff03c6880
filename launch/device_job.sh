# Sourced by the one-call device scripts (launch/gemm_h200.sh, gemm_small_h200.sh, layer_h200.sh,
# deep_gemm_layer.sh, ep_mps_bench.sh, ep_seal_bench.sh) from the repo root, after `set -uo pipefail`:
#
#   . launch/device_job.sh LOG_NAME BUDGET_S
#
# Sets OUT (default ./out), LOG=$OUT/LOG_NAME (emptied), say (echo and append to LOG), T0 and
# DEADLINE (T0 + BUDGET_S: the call's whole time), left (seconds to DEADLINE) and limit WANT RESERVE
# (a step's time limit: what it asks for, at most what is left minus a reserve for the steps after
# it, at least 5 s); prints the GPUs and sources launch/device_env.sh (the carried wheels, PYTHONPATH);
# dg_start / dg_wait (below) build DeepGEMM.
export OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
LOG="$OUT/$1"
: > "$LOG"
say() { echo "$*" | tee -a "$LOG"; }
T0=$(date +%s)
DEADLINE=$(( T0 + $2 ))
left() { echo $(( DEADLINE - $(date +%s) )); }
limit() { local want=$1 reserve=$2 l; l=$(( $(left) - reserve )); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 5 ] && want=5; echo "$want"; }
nvidia-smi -L 2>&1 | tee -a "$LOG"
. launch/device_env.sh

# DeepGEMM from the carried .deepgemm/ (launch/build_deep_gemm.sh with the host's g++ and torch):
#   dg_start TIMEOUT_S   starts the build in the background, in its own process group (its own limit)
#   dg_wait MAX_WAIT_S   waits at most that long (then stops the build's whole group), sources the built
#                        package's environment; DG_RC=0 when deep_gemm imports, else the build's status
# A script that needs DeepGEMM before anything else runs `dg_start T; dg_wait T`.
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export DG_PREFIX="$PWD/.dg-site" DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/streamring-deep-gemm-jit}
dg_start() {
  DG_BUILD_TIMEOUT=$1 setsid bash launch/build_deep_gemm.sh > "$OUT/deep_gemm_build.log" 2>&1 &
  DG_PID=$!
}
dg_wait() {
  # polls instead of a background `sleep; kill` watchdog, whose orphaned sleep would hold the call's
  # output open after the script ends
  local waited=0
  while kill -0 "$DG_PID" 2>/dev/null && [ "$waited" -lt "$1" ]; do sleep 1; waited=$(( waited + 1 )); done
  kill -0 "$DG_PID" 2>/dev/null && kill -- -"$DG_PID" 2>/dev/null
  wait "$DG_PID"
  DG_RC=$?
  tail -4 "$OUT/deep_gemm_build.log" | tee -a "$LOG"
  if [ "$DG_RC" = 0 ] && [ -f "$DG_PREFIX/deep_gemm_env.sh" ]; then
    . "$DG_PREFIX/deep_gemm_env.sh"
    say "DeepGEMM: built and imports"
  else
    [ "$DG_RC" = 0 ] && DG_RC=1
    say "DeepGEMM: NOT available (build rc=$DG_RC, see $OUT/deep_gemm_build.log)"
  fi
}
