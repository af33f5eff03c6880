#!/usr/bin/env bash
# Why do 4 PEs under MPS run out of memory at context creation (torch.cuda.set_device) when 2 and 3
# do not? One discriminating run on one GPU (GPU $MPS_GPU, default 0):
#
#   bash launch/mps_probe.sh          # prints a table; logs under $OUT (default ./out)
#
# Under one MPS daemon, N processes each create a context (torch.cuda.set_device + a 1-element
# tensor), hold it 3 s, and report ok or the error, for N in $MPS_PROBE_NS (default 3 4) and each value of
# CUDA_DEVICE_MAX_CONNECTIONS in $MPS_PROBE_CONNS (default 32 8; launch/device_env.sh sets 32 for every device run). Before
# each case the GPU's compute processes are listed, so leftovers of an earlier step would show.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
LOG="$OUT/mps_probe.log"
: > "$LOG"
GPU="${MPS_GPU:-0}"
export CUDA_MPS_PIPE_DIRECTORY="$(mktemp -d)" CUDA_MPS_LOG_DIRECTORY="$(mktemp -d)"
if ! CUDA_VISIBLE_DEVICES=$GPU nvidia-cuda-mps-control -d >>"$LOG" 2>&1; then
  echo "mps_probe: could not start the MPS daemon" | tee -a "$LOG"
  exit 3
fi
trap 'echo quit | nvidia-cuda-mps-control >/dev/null 2>&1 || true' EXIT
sleep 1
cat > /tmp/mps_client.py <<'EOF'
import os, sys, time
try:
    import torch
    torch.cuda.set_device(0)
    t = torch.zeros(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    print(f"ok pid {os.getpid()} free {free >> 20} MiB of {total >> 20}", flush=True)
    time.sleep(3)
except Exception as exc:
    print(f"FAIL pid {os.getpid()} {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", flush=True)
    sys.exit(1)
EOF
printf '%-8s %-4s %-8s %s\n' conns N ok detail | tee -a "$LOG"
for conns in ${MPS_PROBE_CONNS:-32 8}; do
  for n in ${MPS_PROBE_NS:-3 4}; do
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader >>"$LOG" 2>&1
    pids=()
    for i in $(seq 1 "$n"); do
      if [ "$conns" = unset ]; then
        env -u CUDA_DEVICE_MAX_CONNECTIONS CUDA_VISIBLE_DEVICES=$GPU CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / n)) \
          timeout 60 python3 /tmp/mps_client.py >"$OUT/mps_${conns}_${n}_$i.txt" 2>&1 &
      else
        CUDA_DEVICE_MAX_CONNECTIONS=$conns CUDA_VISIBLE_DEVICES=$GPU CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / n)) \
          timeout 60 python3 /tmp/mps_client.py >"$OUT/mps_${conns}_${n}_$i.txt" 2>&1 &
      fi
      pids+=($!)
    done
    wait "${pids[@]}"
    ok=$(cat "$OUT"/mps_${conns}_${n}_*.txt | grep -c '^ok')
    detail=$(cat "$OUT"/mps_${conns}_${n}_*.txt | grep -m1 '^FAIL' || true)
    printf '%-8s %-4s %-8s %s\n' "$conns" "$n" "$ok/$n" "$detail" | tee -a "$LOG"
    cat "$OUT"/mps_${conns}_${n}_*.txt >>"$LOG"
    rm -f "$OUT"/mps_${conns}_${n}_*.txt
  done
done
echo "--- MPS server log (tail)" >>"$LOG"
tail -30 "$CUDA_MPS_LOG_DIRECTORY"/server.log >>"$LOG" 2>/dev/null || true
tail -30 "$CUDA_MPS_LOG_DIRECTORY"/control.log >>"$LOG" 2>/dev/null || true
