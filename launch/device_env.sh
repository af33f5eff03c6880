# Sourced by the device-run scripts (launch/gpu_*.sh): the environment of a GPU machine run.
# Installs the carried wheels (.whl/: nvshmem4py, pydantic, ...) into .site (the machine has no
# network), puts .site and the repo on PYTHONPATH, and sets what every run needs.
# Expects: the repo root as the current directory, $LOG, and a `say` function.
export OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
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
else
  say "device_env: no .whl/*.whl carried (run ../shared/device/fetch-wheels.sh and carry .whl)"
fi
export PYTHONPATH="$PWD/.site:$PWD:${PYTHONPATH:-}"
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
export NGPU
