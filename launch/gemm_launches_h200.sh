#!/usr/bin/env bash
# Per-chunk expert-GEMM launches against one launch over the same blocks (bench/gemm_launches.py;
# issue 20, deliverable 1's CUTLASS side), in ONE device call of at most $LAUNCHES_BUDGET_S (540 s):
#
#   bash launch/gemm_launches_h200.sh     # carry .gemm-build .deepgemm .whl
#
# 1. DeepGEMM built in the background from .deepgemm/ (launch/build_deep_gemm.sh);
# 2. CUTLASS and Triton at $LAUNCHES_TOKENS (1024,4096,8192) tokens, $LAUNCHES_CHUNKS (2,4,8) chunks;
# 3. DeepGEMM at the same sizes when it built.
# Env: LAUNCHES_IMPLS (cutlass,triton,deep_gemm), LAUNCHES_ARGS (more bench.gemm_launches options, e.g.
# "--cutlass-l1 cutlass:pingpong64:bf16:m").
# Logs: $OUT/launches.log (everything), $OUT/gemm-launches{,-deep-gemm}.json.
set -uo pipefail
cd "$(dirname "$0")/.."
. launch/device_job.sh launches.log "${LAUNCHES_BUDGET_S:-540}"
TOK=${LAUNCHES_TOKENS:-1024,4096,8192}
CH=${LAUNCHES_CHUNKS:-2,4,8}
IMPLS=${LAUNCHES_IMPLS:-cutlass,triton,deep_gemm}
OURS=$(echo "$IMPLS" | tr , '\n' | grep -v '^deep_gemm$' | paste -sd, -)

# time kept for the DeepGEMM step when it runs, else a small margin for the summary
KEEP=10
case ",$IMPLS," in *,deep_gemm,*) say "=== 1. DeepGEMM build in the background"; dg_start 200; KEEP=120 ;; esac

if [ -n "$OURS" ]; then
  say "=== 2. $OURS ($(left) s left)"
  # shellcheck disable=SC2086  # LAUNCHES_ARGS: several options
  timeout "$(limit 330 $(( KEEP - 5 )))" python3 -m bench.gemm_launches --tokens "$TOK" --chunks "$CH" \
    --impls "$OURS" --budget-s "$(limit 300 $(( KEEP + 30 )))" --json "$OUT/gemm-launches.json" ${LAUNCHES_ARGS:-} \
    2>&1 | tee -a "$LOG"
  say "rc=${PIPESTATUS[0]}"
fi
if [ -n "${DG_PID:-}" ]; then
  say "=== 3. DeepGEMM ($(left) s left)"
  dg_wait "$(limit 100 60)"
  if [ "$DG_RC" = 0 ]; then
    timeout "$(limit 200 10)" python3 -m bench.gemm_launches --tokens "$TOK" --chunks "$CH" --impls deep_gemm \
      --budget-s "$(limit 150 40)" --json "$OUT/gemm-launches-deep-gemm.json" 2>&1 | tee -a "$LOG"
    say "rc=${PIPESTATUS[0]}"
  fi
fi
say "done in $(( $(date +%s) - T0 )) s"
