#!/usr/bin/env bash
# The whole GPU check in ONE call on the GPU machine (see docs/gpu.md):
#
#   bash launch/gpu_check.sh            # logs and JSON under $OUT (default ./out)
#
# 1. installs the carried wheels (.whl/: nvshmem4py, pydantic, ...) into .site, puts .site and the
#    repo on PYTHONPATH (no pip install of the project: the machine has no network);
# 2. builds the cubin (nvcc -rdc + -dlink --cubin against the image's NVSHMEM 3.4.5);
# 3. phase single (1 PE, no MPS): `streamring gpu-check` (10^4 graph replays per progress policy +
#    negative controls), stress through the host verbs, the EP layer run, the native GPU tests,
#    the latency benchmark;
# 4. phase gpus (one PE per GPU when the machine has several; no MPS): gpu-check, the
#    expert-parallel layer under every policy and transport, uneven/empty ranks, a straggler,
#    every protocol mutation (must fail), host-verb layer and stress, torchrun bootstrap;
#    or phase mps (one GPU): 2, 3 and 4 PEs under MPS (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/N);
#    phases not run by default (about 8 minutes together: a call of their own, e.g.
#    GPU_CHECK_PHASES="faults mutate sanitize"): faults (the device hostile-peer table, the EP handoff
#    rules, a rank killed or stopped mid-forward under mpirun, the local launcher and torchrun),
#    mutate (tests/mutate.py --gpu), sanitize (launch/sanitize.sh: compute-sanitizer);
# 5. prints a table. Every step has a timeout; the steps share a time budget (default 520 s)
#    so the script ends within 9 minutes. Exit status 0 iff every expectation held.
# Env: GPU_CHECK_BUDGET_S (default 520), GPU_CHECK_ONLY=REGEX (run only matching steps),
#      GPU_CHECK_PHASES ("single gpus" on several GPUs, else "single mps"; also: faults mutate sanitize),
#      STREAMRING_CACHE (cubin cache, default .cache/streamring: built ahead and carried).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${OUT:-$PWD/out}/gpu_check.log"
mkdir -p "$(dirname "$LOG")"
: > "$LOG"
say() { echo "$*" | tee -a "$LOG"; }
DEVICE_NEEDS_MPI=1  # (its steps start ranks with mpiexec)
. launch/device_env.sh
rm -f "$OUT/summary.json"
export GPU_CHECK_T0="$(date +%s)"
export GPU_CHECK_BUDGET_S="${GPU_CHECK_BUDGET_S:-520}"

{
  echo "=== environment"
  nvidia-smi -L 2>&1
  nvcc --version 2>&1 | tail -1
  python3 - <<'EOF' 2>&1
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpus", torch.cuda.device_count())
try:
    import nvshmem, nvshmem.core as nv
    v = nv.get_version()
    print("nvshmem4py", v.nvshmem4py_version, "libnvshmem", v.libnvshmem_version)
except Exception as e:
    print("nvshmem4py import failed:", e)
try:
    import cuda.core, cuda.bindings, cuda.pathfinder
    print("cuda.core", cuda.core.__version__, "cuda.bindings", cuda.bindings.__version__,
          "nvshmem headers", cuda.pathfinder.find_nvidia_header_directory("nvshmem"))
except Exception as e:
    print("cuda python:", e)
try:
    from mpi4py import MPI
    print("mpi4py", MPI.Get_library_version().splitlines()[0])
except Exception as e:
    print("mpi4py:", e)
import pydantic
print("pydantic", pydantic.VERSION)
EOF
} | tee -a "$LOG"

# Phases (GPU_CHECK_PHASES, default: single, then gpus on a machine with several GPUs, else mps):
#   single - 1 PE;  gpus - one PE per GPU (no MPS);  mps - 2, 3 and 4 PEs on one GPU under MPS
if [ -z "${GPU_CHECK_PHASES:-}" ]; then
  if [ "$NGPU" -ge 2 ]; then GPU_CHECK_PHASES="single gpus"; else GPU_CHECK_PHASES="single mps"; fi
fi
say "gpu_check: $NGPU GPU(s), phases: $GPU_CHECK_PHASES"

trap mps_stop EXIT
# several PEs on the one GPU: the steps of phase $1 under an MPS daemon started for them (launch/device_env.sh)
under_mps() {
  if mps_start; then
    CUDA_VISIBLE_DEVICES=$MPS_GPU python3 launch/gpu_check_steps.py --phase "$1"
  else
    say "gpu_check: could not start the MPS daemon: multi-PE steps not run"
    python3 launch/gpu_check_steps.py --phase mps-failed
  fi
  mps_stop
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
for phase in $GPU_CHECK_PHASES; do
  case "$phase" in
    single) python3 launch/gpu_check_steps.py --phase single ;;
    gpus) python3 launch/gpu_check_steps.py --phase gpus ;;
    mps) under_mps multi ;;
    faults)
      # 1 PE first (no MPS), then 2 PEs: one per GPU, or both on GPU 0 under MPS
      python3 launch/gpu_check_steps.py --phase faults1
      if [ "$NGPU" -ge 2 ]; then python3 launch/gpu_check_steps.py --phase faults; else under_mps faults; fi
      ;;
    mutate|sanitize) python3 launch/gpu_check_steps.py --phase "$phase" ;;
    *) say "gpu_check: unknown phase $phase (single | gpus | mps | faults | mutate | sanitize)"; exit 2 ;;
  esac
done

python3 launch/gpu_check_steps.py --phase report
rc=$?
say "gpu_check: exit $rc (elapsed $(( $(date +%s) - GPU_CHECK_T0 ))s)"
exit $rc
