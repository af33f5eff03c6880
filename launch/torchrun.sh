#!/usr/bin/env bash
# streamring under torchrun. Only the NVSHMEM backend bootstraps from torchrun (unique id broadcast
# through torch.distributed); the CPU backend refuses at once and names the launchers that work.
# Usage: launch/torchrun.sh NPROC COMMAND [ARGS...]   e.g. launch/torchrun.sh 4 run --backend nvshmem
set -euo pipefail
n=${1:?processes per node}; shift
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
exec torchrun --nproc-per-node "$n" ${NNODES:+--nnodes "$NNODES"} ${RDZV:+--rdzv-endpoint "$RDZV"} \
  -m streamring "$@"
