#!/usr/bin/env bash
# streamring under mpirun (one process per rank; the CPU backend or --backend nvshmem).
# Usage: launch/mpirun.sh NRANKS COMMAND [ARGS...]    e.g. launch/mpirun.sh 8 run --config configs/default.yaml
# The interpreter is the checkout's .venv/bin/python (else python3 / python on PATH, or $PYTHON) and the
# mpiexec the one beside it (the mpich wheel's, the MPI that mpi4py there uses; else PATH's, or $MPIEXEC),
# so the venv need not be on PATH; a missing one is named with its fix (exit 2).
# Multi-node: add your hostfile (MPICH: -f hosts; Open MPI: --hostfile hosts). Ranks that share no
# memory get MPI_Win_allocate windows automatically (cpu.window=auto).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
. "$ROOT/launch/preflight.sh"
[ $# -ge 2 ] && [[ $1 =~ ^[0-9]+$ ]] || preflight_fail "no NRANKS and COMMAND given (usage: launch/mpirun.sh NRANKS COMMAND [ARGS...])" \
  "bash launch/mpirun.sh 4 run"
n=$1; shift
PY=$(streamring_python torch numpy yaml pydantic mpi4py) || exit 2
MPIEXEC=$(mpiexec_for "$PY") || exit 2
preflight_done "python $PY, mpiexec $MPIEXEC"
extra=()
if "$MPIEXEC" --version 2>/dev/null | grep -q "Open MPI"; then
  extra=(--oversubscribe); export OMPI_MCA_osc=${OMPI_MCA_osc:-^ucx}
fi
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
exec "$MPIEXEC" "${extra[@]}" -n "$n" "$PY" -m streamring "$@"
