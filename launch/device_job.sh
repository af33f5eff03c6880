# Sourced by the one-call device scripts (launch/gemm_h200.sh, layer_h200.sh, deep_gemm_layer.sh,
# ep_mps_bench.sh, ep_seal_bench.sh) from the repo root, after `set -uo pipefail`:
#
#   . launch/device_job.sh LOG_NAME BUDGET_S
#
# Sets OUT (default ./out), LOG=$OUT/LOG_NAME (emptied), say (echo and append to LOG), T0 and
# DEADLINE (T0 + BUDGET_S: the call's whole time), left (seconds to DEADLINE) and limit WANT RESERVE
# (a step's time limit: what it asks for, at most what is left minus a reserve for the steps after
# it, at least 5 s); prints the GPUs and sources launch/device_env.sh (the carried wheels, PYTHONPATH).
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
