#!/usr/bin/env bash
# compute-sanitizer over the device code on one PE (see docs/gpu.md, "Memory checker"):
#
#   bash launch/sanitize.sh            # summary lines "sanitize: ..." on stdout, full log $OUT/sanitize.log
#
# Targets: the ring self-test (`streamring gpu-check`, policy serialized, 3 graph replays), one EP forward
# (tests/helpers/ep_forward_once.py: batch and streamed, captured and replayed) and the device hostile-peer table
# (tests/helpers/mp_gpu_hostile.py: corrupt metadata must never lead to an out-of-bounds access). Tools: memcheck on
# the ring self-test and the EP forward, then synccheck and racecheck on both, then memcheck on the hostile table
# (the slowest), while the budget lasts
# (SANITIZE_BUDGET_S, default 300 s; SANITIZE_TIMEOUT_S per run, default 150 s).
#
# Each run is tried plain first. If it fails (errors reported, or the run itself failed), it is tried again
# with NVSHMEM_DISABLE_CUDA_VMM=1 (NVSHMEM's documented switch from the CUDA VMM heap, cuMemCreate/cuMemMap
# and imported peer handles, to plain cudaMalloc memory that every tool tracks); the line says which form
# passed. CUDA API return codes are not reported (--report-api-errors no: torch and NVSHMEM probe with calls
# that may fail); memory accesses, hazards and barrier misuse are.
# Exit 0 iff every memcheck run passed and every other run that ran passed (plain or with the switch);
# 3 if compute-sanitizer is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
LOG="$OUT/sanitize.log"
: > "$LOG"
say() { echo "$*" | tee -a "$LOG"; }
. launch/device_env.sh

SAN="$(command -v compute-sanitizer || true)"
[ -z "$SAN" ] && [ -x /usr/local/cuda/bin/compute-sanitizer ] && SAN=/usr/local/cuda/bin/compute-sanitizer
if [ -z "$SAN" ]; then
  say "sanitize: compute-sanitizer not found on this host (PATH, /usr/local/cuda/bin): nothing was checked"
  exit 3
fi
say "sanitize: $("$SAN" --version 2>&1 | grep -i version | head -1)"
BUDGET="${SANITIZE_BUDGET_S:-300}"
PER_RUN="${SANITIZE_TIMEOUT_S:-150}"
T0=$(date +%s)
TMPD="${STREAMRING_CHECK_TMP:-/tmp/streamring-check}/sanitize"
mkdir -p "$TMPD"

# PYTORCH_NO_CUDA_MEMORY_CACHING=1 gives every torch tensor its own cudaMalloc, so memcheck sees each
# tensor's bounds rather than a cached block's (not with graph capture: hence the eager EP forward).
# NVSHMEM's symmetric heap stays one allocation to the tool: an access outside the ring's region but
# inside the heap is invisible to memcheck (the kernels index the ring by the plan's counts only).
declare -A TARGETS=(
  [ring]="python3 -m streamring gpu-check --policies serialized --replays 3 --slots 2 --chunks 6 --deadline-s 60"
  [ep]="env PYTORCH_NO_CUDA_MEMORY_CACHING=1 python3 tests/helpers/ep_forward_once.py --policy serialized --eager --replays 2"
  [hostile]="env PYTORCH_NO_CUDA_MEMORY_CACHING=1 python3 tests/helpers/mp_gpu_hostile.py hostile_table"
)
RUNS=("memcheck ring" "memcheck ep" "synccheck ring" "racecheck ring" "synccheck ep" "racecheck ep"
      "memcheck hostile")

failed=0
for run in "${RUNS[@]}"; do
  read -r tool target <<<"$run"
  left=$(( BUDGET - ($(date +%s) - T0) ))
  if [ "$left" -lt 30 ]; then
    say "sanitize: $tool $target: NOT RUN (budget of ${BUDGET}s spent)"
    continue
  fi
  verdict=""
  plain_what=""
  for form in plain novmm; do
    left=$(( BUDGET - ($(date +%s) - T0) ))
    [ "$left" -lt 20 ] && break
    limit=$(( left < PER_RUN ? left : PER_RUN ))
    log="$TMPD/$tool-$target-$form.log"
    envs=()
    [ "$form" = novmm ] && envs=(NVSHMEM_DISABLE_CUDA_VMM=1)
    echo "=== $tool $target ($form, timeout ${limit}s): ${TARGETS[$target]}" >>"$LOG"
    # (timeout signals its whole process group: the Python target under the sanitizer goes too)
    # shellcheck disable=SC2086
    env "${envs[@]}" timeout --kill-after=10 "$limit" "$SAN" --tool "$tool" --report-api-errors no \
      --print-limit 20 --error-exitcode 97 ${TARGETS[$target]} >"$log" 2>&1
    rc=$?
    cat "$log" >>"$LOG"
    summary="$(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" | tail -1 | sed 's/^=* *//')"
    first="$(grep -m1 -E '^=+ +(Invalid|Race|Barrier|Error|Uninitialized|Program hit|Misaligned)' "$log" \
             | sed 's/^=* *//')"
    what="rc=$rc${summary:+, $summary}${first:+, first: $first}"
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then what="timed out after ${limit}s ($what)"; fi
    if [ "$rc" = 0 ]; then
      if [ "$form" = plain ]; then verdict="PASS (plain run) $summary"
      else verdict="PASS with NVSHMEM_DISABLE_CUDA_VMM=1 (the plain run: $plain_what) $summary"; fi
      break
    fi
    if [ "$form" = plain ]; then
      plain_what="$what"
      verdict="FAIL: plain run: $what (no time left to retry with NVSHMEM_DISABLE_CUDA_VMM=1)"
    else
      verdict="FAIL: plain run: $plain_what; with NVSHMEM_DISABLE_CUDA_VMM=1: $what"
    fi
  done
  [ -z "$verdict" ] && verdict="NOT RUN (budget of ${BUDGET}s spent)"
  say "sanitize: $tool $target: $verdict"
  # memcheck must run; synccheck and racecheck run where the budget allows (their NOT RUN is reported)
  case "$tool: $verdict" in *PASS*|synccheck:\ NOT\ RUN*|racecheck:\ NOT\ RUN*) ;; *) failed=1 ;; esac
done
say "sanitize: $( [ $failed = 0 ] && echo "clean" || echo "FAILED") (elapsed $(( $(date +%s) - T0 ))s, log $LOG)"
exit $failed
