#!/usr/bin/env bash
# streamring under torchrun. Only the NVSHMEM backend bootstraps from torchrun (unique id broadcast
# through torch.distributed); the CPU backend refuses at once and names the launchers that work.
# Usage: launch/torchrun.sh NPROC COMMAND [ARGS...]   e.g. launch/torchrun.sh 4 run --backend nvshmem
# torchrun is `python -m torch.distributed.run` of the interpreter that imports streamring (the checkout's
# .venv/bin/python, else python3 / python on PATH, or $PYTHON); a missing one is named with its fix (exit 2).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
. "$ROOT/launch/preflight.sh"
[ $# -ge 2 ] && [[ $1 =~ ^[0-9]+$ ]] || preflight_fail \
  "no NPROC and COMMAND given (usage: launch/torchrun.sh NPROC COMMAND [ARGS...])" "bash launch/torchrun.sh 2 run --backend nvshmem"
n=$1; shift
PY=$(streamring_python torch torch.distributed.run numpy yaml pydantic) || exit 2
preflight_done "python $PY (torchrun: $PY -m torch.distributed.run)"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
exec "$PY" -m torch.distributed.run --nproc-per-node "$n" ${NNODES:+--nnodes "$NNODES"} ${RDZV:+--rdzv-endpoint "$RDZV"} \
  -m streamring "$@"
