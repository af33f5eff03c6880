#!/usr/bin/env bash
# Do two MPS clients share SMs? One device call: the driver's and MPS's versions, then bench.sm_ids as two
# clients at once (a) under CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 (how every MPS figure of docs/performance.md
# was measured) and (c) on two static SM partitions (nvidia-cuda-mps-control -S, launch/device_env.sh
# mps_partitions); each line: SMs reported, distinct SM ids its CTAs ran on, the ids. And (b) whether two
# clients' heavy grids share SMs, timed: bf16 matmuls (bench.sm_ids --matmul) by one client alone at 50 %, by
# two clients at once at 50 % each, and by one client alone without a percentage (the whole GPU); the same time
# alone and together means SMs of their own. Logs: $OUT/probe.log.
#   [PROBE_STATIC=0] [PROBE_MATMUL_N=8192] bash launch/mps_partition_probe.sh
set -uo pipefail
cd "$(dirname "$0")/.."
. launch/device_env.sh probe.log "${PROBE_BUDGET_S:-200}"
{ nvidia-smi | head -12; echo "mps control -v: $(nvidia-cuda-mps-control -v 2>&1 | head -3)"; } >> "$LOG" 2>&1
two_clients() {  # label, then env words for client 0 and 1 (as "K=V K=V|K=V")
  local label=$1 at; at=$(python3 -c "import time; print(time.time() + 12)")
  IFS='|' read -r -a envs <<< "$2"
  for i in 0 1; do
    env ${envs[$i]} timeout 90 python3 -m bench.sm_ids --label "$label client $i" --start-at "$at" \
      > "$OUT/sm_ids_${label// /_}_$i.log" 2>&1 &
  done
  wait
  for i in 0 1; do tail -3 "$OUT/sm_ids_${label// /_}_$i.log" | tee -a "$LOG"; done
  python3 - "$OUT/sm_ids_${label// /_}_0.log" "$OUT/sm_ids_${label// /_}_1.log" <<'PY' | tee -a "$LOG"
import json, sys
rows = []
for p in sys.argv[1:]:
    try:
        rows.append(json.loads(open(p).read().strip().splitlines()[-1]))
    except Exception as e:
        print("no result in", p, e); sys.exit(0)
for g in rows[0]["grids"]:
    a, b = set(rows[0]["grids"][g]["ids"]), set(rows[1]["grids"].get(g, {}).get("ids", []))
    print(f"grid of {g} CTAs: client 0 on {len(a)} SMs, client 1 on {len(b)}, shared {len(a & b)}, union {len(a | b)}")
PY
}
trap mps_stop EXIT
say "=== a. MPS, 50 % each"
mps_start && two_clients "pct50" "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50|CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50"
mps_stop
matmuls() {  # label, then env words per client ("K=V|K=V"; one entry: one client)
  local label=$1 at n=${PROBE_MATMUL_N:-8192}; at=$(python3 -c "import time; print(time.time() + 12)")
  IFS='|' read -r -a envs <<< "$2"
  for i in "${!envs[@]}"; do
    env ${envs[$i]} timeout 90 python3 -m bench.sm_ids --label "$label client $i" --matmul "$n" --start-at "$at" \
      > "$OUT/matmul_${label// /_}_$i.log" 2>&1 &
  done
  wait
  for i in "${!envs[@]}"; do tail -1 "$OUT/matmul_${label// /_}_$i.log" | tee -a "$LOG"; done
}
say "=== b. matmuls: alone at 50 %, two at once at 50 % each, alone at 100 %"
mps_start && {
  matmuls "alone50" "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50"
  matmuls "both50" "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50|CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50"
  matmuls "alone100" "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100"
}
mps_stop
[ "${PROBE_STATIC:-1}" = 0 ] && { say "=== done ($(( $(date +%s) - T0 )) s)"; exit 0; }
say "=== c. MPS static SM partitions (PROBE_STATIC=0: skipped)"
if MPS_STATIC=1 mps_start && mps_partitions 2; then
  IFS=, read -r -a P <<< "$MPS_SM_PARTITIONS"
  two_clients "static" "CUDA_MPS_SM_PARTITION=${P[0]}|CUDA_MPS_SM_PARTITION=${P[1]}"
else
  say "static partitions not made"; echo "--- log tail"; tail -30 "$LOG"
fi
mps_stop
say "=== done ($(( $(date +%s) - T0 )) s)"
