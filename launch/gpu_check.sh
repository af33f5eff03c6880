#!/usr/bin/env bash
# The whole GPU check in ONE call on the GPU machine (see docs/gpu.md):
#
#   bash launch/gpu_check.sh            # logs and JSON under $OUT (default ./out)
#
# 1. installs the carried wheels (.whl/: nvshmem4py, pydantic, ...) into .site, puts .site and the
#    repo on PYTHONPATH (no pip install of the project: the machine has no network);
# 2. builds the cubin (nvcc -rdc + -dlink --cubin against the image's NVSHMEM 3.4.5);
# 3. one PE, no MPS: device-side graph replay (10^4 replays per progress policy + negative
#    controls), stress through the host verbs, tests/test_gpu.py, the latency benchmark;
# 4. starts the MPS daemon; 2, 3 and 4 PEs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/N) through
#    `mpiexec --allow-run-as-root --oversubscribe -n N python3 -m streamring ...`: graph replay,
#    stress on configs/stress-*.yaml, every --inject mode (must fail); stops MPS;
# 5. prints a table. Every step has a timeout; the steps share a time budget (default 520 s)
#    so the script ends within 9 minutes. Exit status 0 iff every expectation held.
# Env: GPU_CHECK_BUDGET_S (default 520), GPU_CHECK_ONLY=REGEX (run only matching steps),
#      STREAMRING_CACHE (cubin cache, default /tmp/streamring-cache).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
rm -f "$OUT/summary.json"
export GPU_CHECK_T0="$(date +%s)"
export GPU_CHECK_BUDGET_S="${GPU_CHECK_BUDGET_S:-520}"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off everywhere (shared machines): never remove these.
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_osc="^ucx"
# a cubin built ahead on the CPU machine (same nvcc and NVSHMEM: same cache key) travels in .cache/
export STREAMRING_CACHE="${STREAMRING_CACHE:-$PWD/.cache/streamring}"
# every stream its own hardware queue (a blocked cuStreamWaitValue64 must not share one with its producer)
export CUDA_DEVICE_MAX_CONNECTIONS=32

say() { echo "$*" | tee -a "$LOG"; }

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl >>"$LOG" 2>&1 \
    || { say "gpu_check: installing the carried wheels failed (see $LOG)"; exit 3; }
else
  say "gpu_check: no .whl/*.whl carried (run /work/shared/device/fetch-wheels.sh and carry .whl)"
fi
export PYTHONPATH="$PWD/.site:$PWD:${PYTHONPATH:-}"

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
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
if [ -z "${GPU_CHECK_PHASES:-}" ]; then
  if [ "$NGPU" -ge 2 ]; then GPU_CHECK_PHASES="single gpus"; else GPU_CHECK_PHASES="single mps"; fi
fi
say "gpu_check: $NGPU GPU(s), phases: $GPU_CHECK_PHASES"

MPS_STARTED=0
stop_mps() {
  if [ "$MPS_STARTED" = 1 ]; then
    echo quit | nvidia-cuda-mps-control >/dev/null 2>&1 || true
    MPS_STARTED=0
    say "gpu_check: MPS daemon stopped"
  fi
}
trap stop_mps EXIT
for phase in $GPU_CHECK_PHASES; do
  case "$phase" in
    single) python3 launch/gpu_check_steps.py --phase single ;;
    gpus) python3 launch/gpu_check_steps.py --phase gpus ;;
    mps)
      # -- several PEs on the one GPU: MPS --------------------------------------------------------
      export CUDA_MPS_PIPE_DIRECTORY="$(mktemp -d)" CUDA_MPS_LOG_DIRECTORY="$(mktemp -d)"
      if CUDA_VISIBLE_DEVICES=0 nvidia-cuda-mps-control -d >>"$LOG" 2>&1; then
        MPS_STARTED=1
        sleep 1
        say "gpu_check: MPS daemon started (pipe dir $CUDA_MPS_PIPE_DIRECTORY)"
        CUDA_VISIBLE_DEVICES=0 python3 launch/gpu_check_steps.py --phase multi
      else
        say "gpu_check: could not start the MPS daemon: multi-PE steps not run"
        python3 launch/gpu_check_steps.py --phase mps-failed
      fi
      stop_mps
      unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
      ;;
    *) say "gpu_check: unknown phase $phase (single | gpus | mps)"; exit 2 ;;
  esac
done

python3 launch/gpu_check_steps.py --phase report
rc=$?
say "gpu_check: exit $rc (elapsed $(( $(date +%s) - GPU_CHECK_T0 ))s)"
exit $rc
