#!/usr/bin/env bash
# The CUTLASS expert GEMMs (issue 15) in ONE device call on an H200:
#
#   bash launch/gemm_h200.sh          # carry .gemm-build (the prebuilt library); logs + JSON under $OUT
#
# 1. loads the prebuilt library (.gemm-build/libsr_gemm-*.so, built on the CPU machine with
#    `python -m streamring.device.build_gemm --out .gemm-build`) and prints its variants;
# 2. tests/test_gemm_cutlass.py natively (float64 reference, bitwise block contract, graphs, status);
# 3. python -m bench.gemm: L1 and L2 of Triton, CUTLASS and torch._scaled_grouped_mm at
#    $GEMM_TOKENS tokens -> $OUT/gemm-<date>.json (copy it to docs/results/).
# Env: GEMM_TOKENS (default 128,1024,8192,32768), GEMM_ARGS (extra bench arguments).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
LOG="$OUT/gemm.log"
: > "$LOG"
export PYTHONUNBUFFERED=1
export STREAMRING_CACHE="${STREAMRING_CACHE:-/tmp/streamring-cache}"
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
say() { echo "$*" | tee -a "$LOG"; }
T0=$(date +%s)
nvidia-smi -L | tee -a "$LOG"

say "=== the prebuilt CUTLASS library"
python3 - <<'EOF' 2>&1 | tee -a "$LOG"
import json
from streamring.device import cutlass_gemm as C
print(json.dumps(C.library_info(), indent=1))
EOF
[ "${PIPESTATUS[0]}" = 0 ] || { say "gemm_h200: the library does not load (carry .gemm-build?)"; exit 3; }

say "=== tests/test_gemm_cutlass.py on the GPU ($(( $(date +%s) - T0 )) s)"
timeout 240 python3 -m pytest -q -rs tests/test_gemm_cutlass.py -p no:cacheprovider 2>&1 | tail -40 | tee -a "$LOG"
TESTS=${PIPESTATUS[0]}

say "=== bench.gemm ($(( $(date +%s) - T0 )) s)"
timeout 330 python3 -m bench.gemm --tokens "${GEMM_TOKENS:-128,1024,8192,32768}" \
  --json "$OUT/gemm-$(date +%F).json" ${GEMM_ARGS:-} 2>&1 | tee -a "$LOG"
BENCH=${PIPESTATUS[0]}
say "=== done in $(( $(date +%s) - T0 )) s: tests rc=$TESTS bench rc=$BENCH"
[ "$TESTS" = 0 ] && [ "$BENCH" = 0 ]
