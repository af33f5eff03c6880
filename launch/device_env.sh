# The ONE environment of a GPU machine run, sourced by every device script (launch/gpu_check.sh,
# gpu_ep_bench.sh, ep_mps_bench.sh, gemm_bench.sh, faults.sh, sanitize.sh, device_tracks.sh) from the
# repo root, after `set -uo pipefail`:
#
#   . launch/device_env.sh [LOG_NAME [BUDGET_S]]
#
# - installs the carried wheels (.whl/: nvshmem4py, pydantic, ...; made by launch/fetch_wheels.sh on a
#   machine with network) into .site (the GPU machine has none), puts .site and the repo on PYTHONPATH;
# - sets what every run needs: OUT (default ./out), NVLink multicast off, MPI as root, the cubin cache,
#   CUDA_DEVICE_MAX_CONNECTIONS, NGPU;
# - LOG and say: with LOG_NAME, LOG=$OUT/LOG_NAME (emptied) and say (echo, and append to LOG), and the GPUs
#   are listed into it; without, the caller's LOG and say (else $OUT/device.log and a plain say);
# - with BUDGET_S (the call's whole time): T0, DEADLINE, left (seconds to DEADLINE) and
#   `limit WANT RESERVE` (a step's time limit: what it asks for, at most what is left minus a reserve for
#   the steps after it, at least 5 s);
# - mps_start / mps_stop (below): an MPS daemon for several PEs on one GPU;
# - dg_start / dg_wait (below): DeepGEMM built from the carried .deepgemm/ (launch/build_deep_gemm.sh).
#
# First the tools (launch/preflight.sh: a missing one ends the script with status 2 and one line naming it
# and its fix): python3 with torch (the GPU image's), after the carried wheels are installed pydantic,
# streamring and nvshmem4py, mpiexec where the script sets DEVICE_NEEDS_MPI=1 before sourcing this, and an
# NVIDIA GPU. PREFLIGHT_ONLY=1 stops the script after them (status 0).
ROOT=${ROOT:-$PWD}
. launch/preflight.sh
need_cmd python3 "run it on the GPU machine, whose image has python3 with torch (here: bash tests/run.sh)"
miss=$(missing_modules python3 torch)
[ -z "$miss" ] || preflight_fail "python3 ($(command -v python3)) cannot import $miss" \
  "run it on the GPU machine, whose image has torch (a CPU machine runs the CPU suite: bash tests/run.sh)"
export OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
if [ -n "${1:-}" ]; then
  LOG="$OUT/$1"
  : > "$LOG"
  say() { echo "$*" | tee -a "$LOG"; }
else
  LOG="${LOG:-$OUT/device.log}"
  declare -F say >/dev/null || say() { echo "$*" | tee -a "$LOG"; }
fi
if [ -n "${2:-}" ]; then
  T0=$(date +%s)
  DEADLINE=$(( T0 + $2 ))
  left() { echo $(( DEADLINE - $(date +%s) )); }
  limit() { local want=$1 reserve=$2 l; l=$(( $(left) - reserve )); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 5 ] && want=5; echo "$want"; }
fi
[ -n "${1:-}" ] && command -v nvidia-smi >/dev/null && nvidia-smi -L 2>&1 | tee -a "$LOG"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off everywhere (shared machines): never remove these.
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_osc="^ucx"
# a cubin built ahead on the CPU machine (same nvcc and NVSHMEM: same cache key) travels in .cache/
export STREAMRING_CACHE="${STREAMRING_CACHE:-$PWD/.cache/streamring}"
# every stream its own hardware queue: a blocked cuStreamWaitValue64 (stream_wait policy) must not
# share one with its producer
export CUDA_DEVICE_MAX_CONNECTIONS=32
if ls .whl/*.whl >/dev/null 2>&1; then
  if [ ! -d .site ] || [ -n "$(find .whl -newer .site -name '*.whl' 2>/dev/null)" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target .site .whl/*.whl >>"$LOG" 2>&1 \
      || { say "device_env: installing the carried wheels failed (see $LOG)"; exit 3; }
  fi
fi
export PYTHONPATH="$PWD/.site:$PWD:${PYTHONPATH:-}"
miss=$(missing_modules python3 pydantic streamring nvshmem.core)
if [ -n "$miss" ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    preflight_fail "python3 cannot import $miss, and the carried .whl/ does not provide it" \
      "bash launch/fetch_wheels.sh where there is network (it fetches nvshmem4py and pydantic), and carry .whl"
  fi
  preflight_fail "python3 cannot import $miss, and no .whl/*.whl is carried" \
    "bash launch/fetch_wheels.sh where there is network, and carry .whl (launch/device_env.sh installs it into .site)"
fi
if [ "${DEVICE_NEEDS_MPI:-0}" = 1 ]; then need_cmd mpiexec "use the GPU machine's image (Open MPI's mpiexec), or put an mpiexec on PATH"; fi
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
[ "$NGPU" -ge 1 ] || preflight_fail "no NVIDIA GPU (nvidia-smi lists none)" \
  "run it on the GPU machine (the device tool's run); here the CPU suite runs: bash tests/run.sh"
export NGPU
preflight_done "python3 $(command -v python3) with torch, pydantic, streamring and nvshmem4py; $NGPU GPU(s)"

# MPS, several PEs on one GPU (the clients choose their SM share, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE):
#   mps_start   starts a daemon on the first GPU this run may use (MPS_GPU), in fresh pipe and log
#               directories (exported for the clients); status 1 when it cannot (its reason is in $LOG)
#   mps_stop    stops it, if one was started (idempotent: a script runs `trap mps_stop EXIT` so an early
#               exit never leaves a daemon holding the GPU)
MPS_STARTED=0
mps_start() {
  # the first GPU this run may use (a device call can give each of its GPUs to another job)
  MPS_GPU="${CUDA_VISIBLE_DEVICES:-0}"
  MPS_GPU="${MPS_GPU%%,*}"
  local pipe logs
  pipe="$(mktemp -d)" && logs="$(mktemp -d)" || { say "mps_start: mktemp -d failed (is TMPDIR writable?)"; return 1; }
  export CUDA_MPS_PIPE_DIRECTORY="$pipe" CUDA_MPS_LOG_DIRECTORY="$logs"
  # MPS_STATIC=1: static SM partitioning mode (-S), for mps_partitions below
  local static=(); [ "${MPS_STATIC:-0}" = 1 ] && static=(-S)
  if ! CUDA_VISIBLE_DEVICES=$MPS_GPU nvidia-cuda-mps-control -d "${static[@]}" >>"$LOG" 2>&1; then
    rm -rf "$pipe" "$logs"
    return 1
  fi
  MPS_STARTED=1
  sleep 1
  say "MPS daemon started on GPU $MPS_GPU (pipe dir $CUDA_MPS_PIPE_DIRECTORY)"
}
# mps_partitions N: under a daemon started with MPS_STATIC=1, N static SM partitions of equal size (disjoint
# SM sets: each PE on SMs of its own, as on GPUs of its own, where CUDA_MPS_ACTIVE_THREAD_PERCENTAGE only caps
# how many SMs a client holds at once); exports MPS_SM_PARTITIONS (their ids, comma-separated) for
# launch/mps_rank_env.sh, which gives rank i the i-th. Status 1 (the daemon's answers in $LOG) when it cannot.
mps_partitions() {
  local n=$1 uuid free chunks id ids=()
  uuid=$(nvidia-smi -i "$MPS_GPU" --query-gpu=uuid --format=csv,noheader 2>/dev/null | head -1)
  { echo "--- lspart"; echo lspart | nvidia-cuda-mps-control; } >>"$LOG" 2>&1
  # the free chunks of the GPU: the lspart line of its UUID, the last number on it
  free=$(echo lspart | nvidia-cuda-mps-control 2>/dev/null | grep -i "$uuid" | grep -o '[0-9]\+' | tail -1)
  chunks=$(( ${free:-0} / n ))
  say "mps_partitions: GPU $uuid, free chunks '${free:-?}', $chunks per partition"
  [ "$chunks" -ge 1 ] || return 1
  for _ in $(seq "$n"); do
    id=$(echo "sm_partition add $uuid $chunks" | nvidia-cuda-mps-control 2>>"$LOG" | tail -1 | awk '{print $NF}')
    say "mps_partitions: add -> '$id'"
    [ -n "$id" ] || return 1
    ids+=("$id")
  done
  { echo "--- lspart after"; echo lspart | nvidia-cuda-mps-control; } >>"$LOG" 2>&1
  MPS_SM_PARTITIONS=$(IFS=,; echo "${ids[*]}")
  export MPS_SM_PARTITIONS
}
mps_stop() {
  [ "$MPS_STARTED" = 1 ] || return 0
  echo quit | nvidia-cuda-mps-control >/dev/null 2>&1 || true
  MPS_STARTED=0
  # the daemon's log holds the reason of a client's failure: its tail goes to $LOG, then the directories go
  { echo "--- MPS control.log (last 20 lines)"; tail -20 "$CUDA_MPS_LOG_DIRECTORY/control.log"; } >>"$LOG" 2>/dev/null || true
  rm -rf "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  say "MPS daemon stopped"
}

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
