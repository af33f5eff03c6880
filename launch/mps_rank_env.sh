#!/usr/bin/env bash
# Runs its arguments as MPI rank i with CUDA_MPS_SM_PARTITION set to the i-th id of MPS_SM_PARTITIONS
# (launch/device_env.sh mps_partitions); without MPS_SM_PARTITIONS, unchanged.
i="${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-${PMI_RANK:-0}}}"
if [ -n "${MPS_SM_PARTITIONS:-}" ]; then
  IFS=, read -r -a parts <<< "$MPS_SM_PARTITIONS"
  export CUDA_MPS_SM_PARTITION="${parts[$i]}"
fi
exec "$@"
