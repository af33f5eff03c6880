#!/usr/bin/env bash
# The whole batch layer at $LAYER_TOKENS (8192) tokens on one H200 (issue 21's layer target, <= 7.5 ms),
# in ONE device call, at most $LAYER_BUDGET_S (560 s):
#
#   bash launch/layer_h200.sh     # carry .gemm-build .deepgemm .whl .cache
#
# 1. DeepGEMM built from .deepgemm/ (launch/build_deep_gemm.sh);
# 2. the GPU tests of what the layer runs: the producer's routing kernel against the rule
#    (tests/test_blocks.py -k routing), tests/test_gpu_ep.py and tests/test_deep_gemm.py;
# 3. bench/routing.py: the routing kernel's launch variants against the torch form of the rule;
# 4. launch/layer_probe.py with DeepGEMM, CUTLASS and Triton in one process (replays interleaved, each
#    graph checked against its eager forward bitwise), $LAYER_RUNS (3) processes; the first also lists
#    the kernels of one forward (device time per kernel: the layer's phases).
# Logs: $OUT/layer.log (everything), $OUT/tests.log, $OUT/routing.{log,json}, $OUT/layer_run<i>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
. launch/device_job.sh layer.log "${LAYER_BUDGET_S:-560}"
TOK=${LAYER_TOKENS:-8192}
RUNS=${LAYER_RUNS:-3}

say "=== 1. DeepGEMM build ($(( $(date +%s) - T0 )) s)"
dg_start "$(limit 200 300)"
dg_wait "$(limit 200 300)"
IMPLS=cutlass,triton
[ "$DG_RC" = 0 ] && IMPLS=deep_gemm,cutlass,triton

say "=== 2. GPU tests ($(( $(date +%s) - T0 )) s)"
timeout "$(limit 200 200)" python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_ep.py tests/test_deep_gemm.py \
  tests/test_blocks.py::test_routing_kernel_equals_the_rule tests/test_blocks.py::test_routing_kernel_refuses_a_bad_group_limit \
  > "$OUT/tests.log" 2>&1
say "tests rc=$?"
tail -6 "$OUT/tests.log" | tee -a "$LOG"

say "=== 3. bench.routing ($(( $(date +%s) - T0 )) s)"
timeout "$(limit 90 200)" python3 -m bench.routing --json "$OUT/routing.json" > "$OUT/routing.log" 2>&1
say "bench.routing rc=$?"
grep -vE "^bench.routing: T=[0-9]+ (kernel_|router_)" "$OUT/routing.log" | tee -a "$LOG"

say "=== 4. the batch layer at $TOK tokens, $IMPLS interleaved, $RUNS processes ($(( $(date +%s) - T0 )) s)"
for i in $(seq 1 "$RUNS"); do
  kernels=0
  [ "$i" = 1 ] && kernels=1
  LAYER_PROBE_KERNELS=$kernels timeout "$(limit 120 10)" python3 launch/layer_probe.py "$IMPLS" "$TOK" 30 \
    > "$OUT/layer_run$i.log" 2>&1
  say "layer_probe run $i rc=$?"
  grep -E "median|bitwise|psum|Error|error" "$OUT/layer_run$i.log" | tee -a "$LOG"
done
say "=== done ($(( $(date +%s) - T0 )) s)"
