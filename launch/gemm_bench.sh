#!/usr/bin/env bash
# The expert-GEMM measurements on one H200, in ONE device call of at most $GEMM_BUDGET_S (default 560 s):
#
#   bash launch/gemm_bench.sh [JOB...]     # carry .whl (and .gemm-build, .deepgemm where you have them)
#
# Jobs (default: bench), run in the order given, each with a time limit that keeps a minute for each
# job after it:
#   bench     tests/gpu/test_gemm_cutlass.py + tests/unit/test_gemm_choice.py natively, then python -m bench.gemm:
#             Triton, every CUTLASS variant, DeepGEMM and torch side by side at $GEMM_TOKENS, the whole
#             batch layer per GEMM at $GEMM_LAYER_TOKENS -> $OUT/gemm-<date>.json and the heuristic table
#             $OUT/gemm_table.json (commit them as docs/results/... and streamring/gemm/table.json);
#             then tests/unit/test_deep_gemm.py; a short table in $OUT/summary.txt
#   layer     python -m bench.routing (the routing kernel's launch variants against the torch rule), then
#             python -m bench.layer_replay: the batch layer at $LAYER_TOKENS with DeepGEMM, CUTLASS and
#             Triton in one process (graph replays interleaved, checked against eager bitwise),
#             $LAYER_RUNS processes, the first also listing the kernels of one forward
#   launches  python -m bench.gemm_launches: per-chunk GEMM launches against one launch over the same blocks
#   triton    python -m bench.triton_gemm_launch: the Triton GEMMs' launch variants (block_m x stages x warps)
#   ncu       Nsight Compute over python -m bench.gemm_profile: one launch of the CUTLASS L1/L2 variants
#             named and DeepGEMM's, at $NCU_TOKENS
#
# Before the jobs: the carried wheels (launch/device_env.sh); the CUTLASS library loads from .gemm-build/
# or is built here with a line per compile unit (about 2 minutes on 16 cores: carry .gemm-build to skip
# it; CUTLASS's headers come from `bash launch/fetch_wheels.sh --cutlass`); DeepGEMM is built from the
# carried .deepgemm/ in the background (launch/build_deep_gemm.sh) unless GEMM_DEEP_GEMM=off, and every
# job runs without it if that fails.
#
# Env (sizes, variants, extra arguments):
#   bench:    GEMM_TOKENS (128,1024,8192,32768), GEMM_BLOCK_M (64), GEMM_L1 / GEMM_L2 (CUTLASS variants,
#             bench.gemm's --l1/--l2; unset: its defaults, empty: none), GEMM_LAYER_TOKENS (8192; empty:
#             none), GEMM_TABLE (1: write the table), GEMM_ARGS (more bench.gemm options, e.g. --no-graphs)
#   layer:    LAYER_TOKENS (8192), LAYER_RUNS (2), LAYER_REPLAYS (30), LAYER_IMPLS (deep_gemm,cutlass,triton)
#   launches: LAUNCHES_TOKENS (1024,4096,8192), LAUNCHES_CHUNKS (2,4,8), LAUNCHES_IMPLS
#             (cutlass,triton,deep_gemm), LAUNCHES_ARGS
#   triton:   TRITON_TOKENS (128,1024), TRITON_BLOCK_M (16,32,64), TRITON_STAGES (3,4,5,6), TRITON_WARPS (4,8)
#   ncu:      NCU_TOKENS (32768), NCU_L1 (coop128:bf16:n), NCU_L2 (coop128:n:s4)
# e.g. the small sizes, where the weights dominate:
#   GEMM_TOKENS=128 GEMM_BLOCK_M=16 GEMM_L1= GEMM_L2= GEMM_LAYER_TOKENS= bash launch/gemm_bench.sh bench triton
# Logs: $OUT/gemm_bench.log (everything), $OUT/<job>*.log, $OUT/deep_gemm_build.log. Exit 0 iff every job did.
set -uo pipefail
cd "$(dirname "$0")/.."
JOBS=("$@")
[ ${#JOBS[@]} -gt 0 ] || JOBS=(bench)
for j in "${JOBS[@]}"; do
  case $j in bench|layer|launches|triton|ncu) ;; *) echo "gemm_bench: unknown job '$j' (bench | layer | launches | triton | ncu)"; exit 2 ;; esac
done
. launch/device_env.sh gemm_bench.log "${GEMM_BUDGET_S:-560}"
export STREAMRING_CACHE="${STREAMRING_CACHE:-/tmp/streamring-cache}"
DATE=$(date +%F)
FAILED=""
say "=== gemm_bench: jobs ${JOBS[*]} ($(left) s)"

# DeepGEMM in the background while the library loads and the first job starts
DG_RC=off
if [ "${GEMM_DEEP_GEMM:-auto}" != off ] && [ -d .deepgemm ]; then
  dg_start "${DG_BUILD_TIMEOUT:-300}"
  DG_RC=building
fi
need_dg() {  # waits for the DeepGEMM build once (at most what the jobs after it can spare)
  if [ "$DG_RC" = building ]; then dg_wait "$(limit 300 $(( 60 * $1 + 60 )))"; fi
  [ "$DG_RC" = 0 ]
}

say "=== the CUTLASS library ($(left) s left)"
if ! timeout 60 python3 -c "from streamring.gemm import cutlass as C; C.load_library(build=False)" >>"$LOG" 2>&1; then
  say "gemm_bench: no CUTLASS library built from this source carried (.gemm-build/): building it here"
  timeout "$(limit 300 120)" python3 -m streamring.gemm.build --out .gemm-build 2>&1 | tee -a "$LOG"
fi
timeout 60 python3 - <<'EOF' 2>&1 | tee -a "$LOG"
import json
from streamring.gemm import cutlass as C
try:
    C.load_library(build=False)  # built above or carried: never a second build attempt here
    info = C.library_info()
except Exception as exc:  # noqa: BLE001
    print(f"gemm_bench: the CUTLASS library does not load ({exc}): the CUTLASS rows fail")
    raise SystemExit(1)
print(json.dumps({k: v for k, v in info.items() if k != "variants"}, indent=1))
print("TILE_TABLE vs library:", C.table_mismatches(info["variants"]) or "agree")
EOF
LIB=${PIPESTATUS[0]}

job_bench() {  # $1: jobs after this one
  say "--- tests/gpu/test_gemm_cutlass.py tests/unit/test_gemm_choice.py ($(left) s left)"
  timeout "$(limit 150 $(( 60 * $1 + 300 )))" python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_gemm_cutlass.py \
    tests/unit/test_gemm_choice.py > "$OUT/bench_tests.log" 2>&1
  local tests=$?
  tail -6 "$OUT/bench_tests.log" | tee -a "$LOG"
  need_dg $(( $1 + 1 ))
  local t; t=$(limit 400 $(( 60 * $1 + 40 )))
  local args=(--tokens "${GEMM_TOKENS:-128,1024,8192,32768}" --block-m "${GEMM_BLOCK_M:-64}" --budget-s $(( t - 70 ))
              --json "$OUT/gemm-$DATE.json")
  [ -n "${GEMM_L1+x}" ] && args+=(--l1 "$GEMM_L1")
  [ -n "${GEMM_L2+x}" ] && args+=(--l2 "$GEMM_L2")
  [ -n "${GEMM_LAYER_TOKENS+x}" ] && args+=(--layer-tokens "$GEMM_LAYER_TOKENS")
  [ "${GEMM_TABLE:-1}" = 1 ] && args+=(--table "$OUT/gemm_table.json")
  [ "$DG_RC" = 0 ] || args+=(--deep-gemm off)
  say "--- python -m bench.gemm ${args[*]} ${GEMM_ARGS:-} (limit $t s)"
  # shellcheck disable=SC2086  # GEMM_ARGS: several options
  timeout "$t" python3 -m bench.gemm "${args[@]}" ${GEMM_ARGS:-} > "$OUT/bench.log" 2>&1
  local bench=$?
  [ "$bench" = 124 ] && say "bench.gemm ran past $t s and was stopped (the JSON holds the sizes done)"
  grep -v "^\[.*check " "$OUT/bench.log" | tail -150 >> "$LOG"
  say "--- tests/unit/test_deep_gemm.py ($(left) s left)"
  timeout "$(limit 120 $(( 60 * $1 + 12 )))" python3 -m pytest -q -rs -p no:cacheprovider tests/unit/test_deep_gemm.py \
    > "$OUT/bench_tests_deep_gemm.log" 2>&1
  local tests_dg=$?
  tail -6 "$OUT/bench_tests_deep_gemm.log" | tee -a "$LOG"
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
  say "bench: tests=$tests bench=$bench tests_deep_gemm=$tests_dg"
  [ "$tests" = 0 ] && [ "$bench" = 0 ] && [ "$tests_dg" = 0 ]
}

job_layer() {
  local impls=${LAYER_IMPLS:-deep_gemm,cutlass,triton} runs=${LAYER_RUNS:-2} tok=${LAYER_TOKENS:-8192} rc=0 i
  say "--- python -m bench.routing ($(left) s left)"
  timeout "$(limit 90 $(( 60 * $1 + 150 )))" python3 -m bench.routing --json "$OUT/routing.json" > "$OUT/routing.log" 2>&1 || rc=$?
  grep -vE "^bench.routing: T=[0-9]+ (kernel_|router_)" "$OUT/routing.log" | tail -30 | tee -a "$LOG"
  case ",$impls," in *,deep_gemm*) need_dg $(( $1 + 1 )) || impls=$(echo "$impls" | tr , '\n' | grep -v '^deep_gemm' | paste -sd, -) ;; esac
  for i in $(seq 1 "$runs"); do
    say "--- python -m bench.layer_replay $impls $tok ${LAYER_REPLAYS:-30}, process $i of $runs ($(left) s left)"
    LAYER_REPLAY_KERNELS=$([ "$i" = 1 ] && echo 1) timeout "$(limit 120 $(( 60 * $1 + 10 )))" \
      python3 -m bench.layer_replay "$impls" "$tok" "${LAYER_REPLAYS:-30}" > "$OUT/layer_run$i.log" 2>&1 || rc=$?
    grep -E "median|bitwise|psum|kernels|layer_replay:   |Error|error" "$OUT/layer_run$i.log" | tee -a "$LOG"
  done
  return $rc
}

job_launches() {
  local impls=${LAUNCHES_IMPLS:-cutlass,triton,deep_gemm} ours rc=0
  local tok=${LAUNCHES_TOKENS:-1024,4096,8192} ch=${LAUNCHES_CHUNKS:-2,4,8}
  ours=$(echo "$impls" | tr , '\n' | grep -v '^deep_gemm$' | paste -sd, -)
  case ",$impls," in *,deep_gemm,*) need_dg $(( $1 + 1 )) && ours="${ours:+$ours,}deep_gemm" ;; esac
  local t; t=$(limit 400 $(( 60 * $1 + 10 )))
  say "--- python -m bench.gemm_launches --impls $ours (limit $t s)"
  # shellcheck disable=SC2086  # LAUNCHES_ARGS: several options
  timeout "$t" python3 -m bench.gemm_launches --tokens "$tok" --chunks "$ch" --impls "$ours" \
    --budget-s $(( t - 30 )) --json "$OUT/gemm-launches.json" ${LAUNCHES_ARGS:-} > "$OUT/launches.log" 2>&1 || rc=$?
  tail -40 "$OUT/launches.log" | tee -a "$LOG"
  return $rc
}

job_triton() {
  local t rc=0; t=$(limit 420 $(( 60 * $1 + 10 )))
  say "--- python -m bench.triton_gemm_launch (limit $t s)"
  timeout "$t" python3 -m bench.triton_gemm_launch --tokens "${TRITON_TOKENS:-128,1024}" \
    --block-m "${TRITON_BLOCK_M:-16,32,64}" --stages "${TRITON_STAGES:-3,4,5,6}" --warps "${TRITON_WARPS:-4,8}" \
    --json "$OUT/triton-gemm-launch.json" > "$OUT/triton.log" 2>&1 || rc=$?
  grep -v CUDAEvent "$OUT/triton.log" | tail -60 | tee -a "$LOG"
  return $rc
}

job_ncu() {
  local ncu rc=0 t
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  [ -x "$ncu" ] || { say "gemm_bench: ncu not found"; return 1; }
  need_dg $(( $1 + 1 )) || say "gemm_bench: ncu without DeepGEMM (it did not build or was not carried)"
  t=$(limit 300 $(( 60 * $1 + 10 )))
  say "--- ncu python -m bench.gemm_profile ${NCU_TOKENS:-32768} (limit $t s)"
  # --profile-from-start off: gemm_profile brackets its profiled calls with cudaProfilerStart/Stop, so the
  # warm-up launches are left out whether or not DeepGEMM's two kernels are among them
  timeout "$t" "$ncu" --target-processes all -k regex:'device_kernel|sm90_fp8_gemm' \
    --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
    python3 -m bench.gemm_profile "${NCU_TOKENS:-32768}" "${NCU_L1:-coop128:bf16:n}" "${NCU_L2:-coop128:n:s4}" \
    > "$OUT/ncu.log" 2>&1 || rc=$?
  grep -E "gemm_profile|device_kernel|sm90_fp8|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Hit Rate|Duration|Waves Per SM|Issue Slots Busy|Executed Ipc Active|highest-utilized|stalled|Achieved Occupancy|Registers Per|Grid Size|Cluster Size|ERR|==PROF==|Warning" \
    "$OUT/ncu.log" | cut -c1-400 | head -160 >> "$LOG"
  return $rc
}

n=${#JOBS[@]}
for i in "${!JOBS[@]}"; do
  j=${JOBS[$i]}
  say "=== $j ($(( $(date +%s) - T0 )) s, $(left) s left)"
  "job_$j" $(( n - i - 1 )) || FAILED="$FAILED $j"
done
[ "$DG_RC" = building ] && dg_wait 1 >/dev/null  # a build no job waited for: stopped, not left running
say "=== gemm_bench: done in $(( $(date +%s) - T0 )) s: library=$LIB deep_gemm=$DG_RC failed:${FAILED:- none}"
[ "$LIB" = 0 ] && [ -z "$FAILED" ]
