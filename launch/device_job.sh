# Kept only for launch/ep_mps_bench.sh until it sources launch/device_env.sh itself (with the same
# arguments): the environment, the LOG/say/left/limit helpers and dg_start/dg_wait are device_env.sh's.
#   . launch/device_job.sh LOG_NAME BUDGET_S   ==   . launch/device_env.sh LOG_NAME BUDGET_S
. launch/device_env.sh "$@"
