#!/usr/bin/env bash
# streamring under mpirun (one process per rank; the CPU backend or --backend nvshmem).
# Usage: launch/mpirun.sh NRANKS COMMAND [ARGS...]    e.g. launch/mpirun.sh 8 run --config configs/default.yaml
# Multi-node: add your hostfile (MPICH: -f hosts; Open MPI: --hostfile hosts). Ranks that share no
# memory get MPI_Win_allocate windows automatically (cpu.window=auto).
set -euo pipefail
n=${1:?number of ranks}; shift
MPIEXEC=${MPIEXEC:-$(command -v mpiexec || command -v mpirun)}
extra=()
if "$MPIEXEC" --version 2>/dev/null | grep -q "Open MPI"; then
  extra=(--oversubscribe); export OMPI_MCA_osc=${OMPI_MCA_osc:-^ucx}
fi
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
exec "$MPIEXEC" "${extra[@]}" -n "$n" python -m streamring "$@"
