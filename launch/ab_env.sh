#!/usr/bin/env bash
# A/B of run-time switches in ONE device call: launch/ep_mps_bench.sh once per (PE count, variant, round), the
# variants alternating so that drift of the card falls on both alike; each run under $OUT/pes<P>-<i>-<variant>,
# its printed table appended to $OUT/ab.log.
#
#   AB_VARIANTS="STREAMRING_PUT_ROWS_PARTS=1 default" AB_PES="1 2" AB_ROUNDS=2 AB_RUN_S=110 EPM_TESTS=0 EPM_RUN=0 \
#     EPM_TOKENS=128,256 EPM_GEMMS=cutlass EPM_CHUNKS=1 \
#     EPM_ARGS="--orders ready --block-m 128 --floor --straggler-ms= --skew-ms= --replays 20" \
#     bash launch/ab_env.sh               # carry .whl and .gemm-build
#
# AB_VARIANTS: space-separated words, each `default` (the environment as is), NAME=VALUE (exported for that run
# only; local MPI ranks inherit it) or tree=DIR: another tree's own launch/ep_mps_bench.sh and package (DIR inside
# this one, e.g. an older commit's `git archive <rev> streamring bench launch pyproject.toml | tar -x -C DIR`;
# it gets this tree's .whl and .gemm-build): the same bench before and after a change, paired in one call.
# AB_RUN_S (110): each run's EPM_BUDGET_S; ep_mps_bench.sh gives the bench what is left of it less about 90 s
# and refuses the run (status 3) where that is under 10 s. AB_BUDGET_S (560): the whole call.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE_NEEDS_MPI=1  # (ep_mps_bench.sh starts ranks with mpiexec)
. launch/device_env.sh ab.log "${AB_BUDGET_S:-560}"
[ -n "${AB_VARIANTS:-}" ] || { say "ab_env.sh: AB_VARIANTS is empty: give words NAME=VALUE or default"; exit 2; }
ROOT_OUT="$OUT"
RUN_S="${AB_RUN_S:-110}"
RC=0
for pes in ${AB_PES:-2}; do
  for round in $(seq 1 "${AB_ROUNDS:-1}"); do
    for v in $AB_VARIANTS; do
      if [ "$(left)" -lt $(( RUN_S + 10 )) ]; then say "budget spent: $v, $pes PEs, round $round not run"; RC=3; continue; fi
      dir="$ROOT_OUT/pes$pes-$round-${v//[^A-Za-z0-9_]/_}"
      mkdir -p "$dir"
      say "=== $pes PEs, round $round, $v ($(( $(date +%s) - T0 )) s)"
      tree=.
      if [ "$v" = default ]; then set -- ; elif [ "${v#tree=}" != "$v" ]; then set -- ; tree="${v#tree=}"
      else set -- "$v"; fi
      if [ "$tree" != . ]; then
        [ -f "$tree/launch/ep_mps_bench.sh" ] || { say "no $tree/launch/ep_mps_bench.sh: $v not run"; RC=2; continue; }
        for d in .whl .gemm-build; do [ -e "$d" ] && ln -sfn "$PWD/$d" "$tree/$d"; done
      fi
      env "$@" OUT="$dir" EPM_PES="$pes" EPM_BUDGET_S="$RUN_S" bash "$tree/launch/ep_mps_bench.sh" > "$dir/stdout.log" 2>&1
      rc=$?; [ $rc = 0 ] || RC=$rc
      say "rc=$rc"
      tail -40 "$dir/ep_mps.log" >> "$LOG" 2>/dev/null
    done
  done
done
exit $RC
