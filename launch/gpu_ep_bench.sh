#!/usr/bin/env bash
# The expert-parallel layer benchmark in ONE device call (see docs/gpu.md):
#
#   bash launch/gpu_ep_bench.sh        # logs, JSON, timelines and PNG under $OUT (default ./out)
#
# One PE per GPU (mpiexec -n <GPUs>): bench/ep_layer.py (EPBuffer batch vs streamed vs the torch +
# NCCL baseline, with and without a straggler, publish->acquire vs the flag floor), then the
# timeline PNG of the first streamed plan per size (streamring timeline).
# Env: EP_TOKENS (default 128,1024,4096,8192), EP_ARGS (extra bench arguments),
#      EP_BUDGET_S (default 480: the bench stops starting new sizes after it, minus 90 s).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${OUT:-$PWD/out}/ep_bench.log"
mkdir -p "$(dirname "$LOG")"
: > "$LOG"
say() { echo "$*" | tee -a "$LOG"; }
DEVICE_NEEDS_MPI=1  # (its steps start ranks with mpiexec)
. launch/device_env.sh
T0=$(date +%s)
BUDGET=${EP_BUDGET_S:-480}
say "=== EP layer benchmark on $NGPU GPU(s), tokens ${EP_TOKENS:-128,1024,4096,8192}"
timeout "$BUDGET" mpiexec --allow-run-as-root --bind-to none -n "$NGPU" python3 -m bench.ep_layer \
  --tokens "${EP_TOKENS:-128,1024,4096,8192}" --budget-s $(( BUDGET - 90 )) \
  --json "$OUT/ep-layer.json" --timeline-json "$OUT/ep-timelines.json" ${EP_ARGS:-} 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
say "ep_bench: bench exit $rc at $(( $(date +%s) - T0 )) s"
if [ -s "$OUT/ep-timelines.json" ]; then
  python3 -m streamring timeline "$OUT/ep-timelines.json" --out "$OUT/ep-timeline.png" 2>&1 | tail -8 | tee -a "$LOG"
fi
exit $rc
