#!/usr/bin/env bash
# The expert GEMMs (issues 15 and 21) in ONE device call on one H200, at most $GEMM_BUDGET_S (520 s):
#
#   bash launch/gemm_h200.sh     # carry .gemm-build and .deepgemm (and .whl if it holds wheels)
#
# 0. the carried wheels into .site (launch/device_env.sh, if .whl/ holds any);
# 1. in the background: DeepGEMM built from .deepgemm/ with the host's g++ and torch
#    (launch/build_deep_gemm.sh, at most DG_BUILD_TIMEOUT = 300 s); if it fails the rest runs without it;
# 2. the prebuilt CUTLASS library (.gemm-build/, `python -m streamring.device.build_gemm --out .gemm-build`)
#    loads; its variants are printed;
# 3. tests/test_gemm_cutlass.py and tests/test_gemm_choice.py natively;
# 4. python -m bench.gemm at $GEMM_TOKENS: Triton, every CUTLASS variant, DeepGEMM and torch side by side,
#    the whole batch layer at 8192 tokens per GEMM implementation -> $OUT/gemm-<date>.json and the
#    heuristic table $OUT/gemm_table.json (commit them as docs/results/gemm-<date>.json and
#    streamring/moe/gemm_table.json);
# 5. tests/test_deep_gemm.py (its GPU tests skip with the reason when deep_gemm did not build);
# 6. a short final table ($OUT/summary.txt).
# The bench comes before the DeepGEMM tests (the bench checks every kernel it times, DeepGEMM's too,
# against float64 and Triton, and the layer's streamed == batch bitwise); each step's time limit keeps
# enough for the steps after it.
# Logs: $OUT/gemm.log (everything), $OUT/deep_gemm_build.log, $OUT/tests_*.log, $OUT/bench.log.
# Env: GEMM_TOKENS (default 128,1024,8192,32768), GEMM_ARGS (extra bench arguments), GEMM_BUDGET_S.
set -uo pipefail
cd "$(dirname "$0")/.."
. launch/device_job.sh gemm.log "${GEMM_BUDGET_S:-520}"
export STREAMRING_CACHE="${STREAMRING_CACHE:-/tmp/streamring-cache}"

say "=== 1. DeepGEMM build in the background ($(( $(date +%s) - T0 )) s)"
dg_start "${DG_BUILD_TIMEOUT:-300}"

say "=== 2. the prebuilt CUTLASS library ($(( $(date +%s) - T0 )) s)"
timeout 60 python3 - <<'EOF' 2>&1 | tee -a "$LOG"
import json
from streamring.device import cutlass_gemm as C
info = C.library_info()
print(json.dumps(info, indent=1))
bad = C.table_mismatches(info["variants"])
print("TILE_TABLE vs library:", bad or "agree")
EOF
LIB=${PIPESTATUS[0]}
[ "$LIB" = 0 ] || say "gemm_h200: the CUTLASS library does not load (carry .gemm-build built from this source?)"

say "=== 3. tests/test_gemm_cutlass.py tests/test_gemm_choice.py ($(( $(date +%s) - T0 )) s)"
timeout "$(limit 150 330)" python3 -m pytest -q -rs tests/test_gemm_cutlass.py tests/test_gemm_choice.py \
  -p no:cacheprovider > "$OUT/tests_cutlass.log" 2>&1
TESTS=$?
tail -25 "$OUT/tests_cutlass.log" | tee -a "$LOG"

say "=== waiting for the DeepGEMM build ($(( $(date +%s) - T0 )) s)"
# it has its own 300 s limit; never wait past what the bench needs (without it the bench runs without it)
dg_wait "$(limit 300 260)"

say "=== 4. bench.gemm ($(( $(date +%s) - T0 )) s, $(left) s left)"
DATE=$(date +%F)
BENCH_T=$(limit 330 60)
timeout "$BENCH_T" python3 -m bench.gemm --tokens "${GEMM_TOKENS:-128,1024,8192,32768}" \
  --budget-s $(( BENCH_T - 70 )) --json "$OUT/gemm-$DATE.json" --table "$OUT/gemm_table.json" ${GEMM_ARGS:-} \
  > "$OUT/bench.log" 2>&1
BENCH=$?
[ "$BENCH" = 124 ] && say "bench.gemm ran past ${BENCH_T} s and was stopped (the JSON holds the sizes done)"
grep -v "^\[.*check " "$OUT/bench.log" | tail -150 >> "$LOG"

say "=== 5. tests/test_deep_gemm.py ($(( $(date +%s) - T0 )) s)"
timeout "$(limit 120 12)" python3 -m pytest -q -rs tests/test_deep_gemm.py -p no:cacheprovider \
  > "$OUT/tests_deep_gemm.log" 2>&1
TESTS_DG=$?
[ "$TESTS_DG" = 124 ] && say "tests/test_deep_gemm.py ran out of time"
tail -15 "$OUT/tests_deep_gemm.log" | tee -a "$LOG"

say "=== 6. summary ($(( $(date +%s) - T0 )) s)"
timeout 20 python3 - "$OUT/gemm-$DATE.json" <<'EOF' 2>&1 | tee "$OUT/summary.txt" | tee -a "$LOG"
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as exc:
    print(f"no bench JSON: {exc}")
    raise SystemExit(0)
rows = [r for r in d["rows"] if r.get("median_ms") is not None]
print(f"DeepGEMM: {d['meta'].get('deep_gemm')}")
print(f"{'tokens':>6s} {'gemm':4s} {'best of ours':34s} {'ms':>7s} {'DeepGEMM':>8s} {'torch':>7s} {'x DG':>6s} {'x torch':>7s} {'TFLOP/s':>7s}")
for (t, g) in sorted({(r["tokens"], r["gemm"]) for r in rows if r["gemm"] in ("l1", "l2")}):
    rs = [r for r in rows if r["tokens"] == t and r["gemm"] == g]
    ours = [r for r in rs if r.get("ours")]
    dgs = [r["median_ms"] for r in rs if r["impl"] in ("deep_gemm", "deep_gemm_m_indices", "deep_gemm_exact_m")]
    dg = min(dgs) if dgs else None  # DeepGEMM's own speed: the fastest of the consumer's calls and exact M
    tt = next((r["median_ms"] for r in rs if r["impl"] == "torch_scaled_grouped_mm"), None)
    b = min(ours, key=lambda r: r["median_ms"]) if ours else None
    if b is None:
        continue
    f = lambda v: f"{v:.3f}" if v else "-"
    print(f"{t:6d} {g:4s} {b['impl']:34s} {b['median_ms']:7.3f} {f(dg):>8s} {f(tt):>7s} "
          f"{f(dg / b['median_ms'] if dg else None):>6s} {f(tt / b['median_ms'] if tt else None):>7s} {b['tflops']:7.0f}")
for r in rows:
    if r["gemm"] == "layer":
        print(f"layer T={r['tokens']} {r['impl']:10s} block_m {r['block_m']:3d} {r['median_ms']:7.3f} ms  "
              f"streamed==batch {r.get('bitwise_streamed_equals_batch')}  check {r['check']['ok']}  {r['variant']}")
for m in d["meta"].get("layer", []):
    if "auto" in m:
        print(f"layer T={m['tokens']}: gemm='auto' picks {m['auto']['impl']} ({m['auto']['source']})")
for line in d["meta"].get("targets", []):
    print(line)
EOF
say "=== done in $(( $(date +%s) - T0 )) s: library=$LIB tests=$TESTS deep_gemm_build=$DG_RC tests_deep_gemm=$TESTS_DG bench=$BENCH"
[ "$LIB" = 0 ] && [ "$TESTS" = 0 ] && [ "$TESTS_DG" = 0 ] && [ "$BENCH" = 0 ]
