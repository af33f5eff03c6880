#!/usr/bin/env bash
# One device call for the rank-failure checks of issue 23 (docs/gpu.md, "A GPU rank fails"):
#  1. what the machine's mpiexec returns when a rank calls MPI_Abort or is SIGKILLed, with and without
#     OMPI_MCA_orte_enable_recovery=1 (the GPU check sets it for its SIGKILL steps under mpirun);
#  2. the GPU check's faults phase: the device hostile-peer table on 1 PE, then on 2 PEs (one per GPU,
#     or under MPS on one GPU) the hostile table across PEs and rank 1 SIGSTOPped / SIGKILLed mid-forward
#     under mpirun, the local launcher and torchrun.
# Logs: $OUT/mpi_exit_probe.log, $OUT/gpu_check.log, $OUT/summary.json.
#   bash launch/faults.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
LOG="$OUT/mpi_exit_probe.log"
: > "$LOG"
say() { echo "$*" | tee -a "$LOG"; }
DEVICE_NEEDS_MPI=1  # (its steps start ranks with mpiexec)
. launch/device_env.sh

say "mpiexec: $(command -v mpiexec) $(mpiexec --version 2>&1 | head -1)"
ABORT='from mpi4py import MPI; import time; c = MPI.COMM_WORLD; c.Abort(1) if c.rank == 0 else time.sleep(4)'
KILL='from mpi4py import MPI; import os, signal, time; c = MPI.COMM_WORLD; c.Barrier()
if c.rank == 1: os.kill(os.getpid(), signal.SIGKILL)
time.sleep(4); print("rank", c.rank, "survived to its end", flush=True)'
for recovery in "" 1; do
  for what in ABORT KILL; do
    t0=$(date +%s.%N)
    if [ -n "$recovery" ]; then
      OMPI_MCA_orte_enable_recovery=1 timeout 60 mpiexec --allow-run-as-root --oversubscribe --bind-to none -n 2 \
        python3 -c "${!what}" >>"$LOG" 2>&1
    else
      timeout 60 mpiexec --allow-run-as-root --oversubscribe --bind-to none -n 2 python3 -c "${!what}" >>"$LOG" 2>&1
    fi
    rc=$?
    say "mpi_exit_probe: $what, orte_enable_recovery=${recovery:-unset}: mpiexec rc=$rc after $(python3 -c "import time; print(f'{time.time() - $t0:.1f}')") s"
  done
done
grep -a "survived to its end" "$LOG" | sed 's/^/mpi_exit_probe: /'

GPU_CHECK_PHASES="faults" GPU_CHECK_BUDGET_S="${GPU_CHECK_BUDGET_S:-420}" bash launch/gpu_check.sh

# 3. the ring and EP-layer GPU tests on 1 PE (the wait beacon is in every device wait): bounded
timeout "${GPU_TESTS_TIMEOUT_S:-200}" python3 -m pytest -q -x -rs tests/unit/test_gpu.py tests/gpu/test_gpu_ep.py \
  -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests: rc=$? $(tail -1 "$OUT/gpu_tests.log")"
