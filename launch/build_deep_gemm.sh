#!/usr/bin/env bash
# Builds DeepGEMM 54e2261 (deep_gemm 2.6.1) on the GPU host, offline, from the carried .deepgemm/
# (made by launch/pack_deep_gemm.sh), against the host's torch and g++; installs it into $DG_PREFIX
# and writes $DG_PREFIX/deep_gemm_env.sh (CUDA_HOME, torch's nvidia/*/lib on LD_LIBRARY_PATH,
# DG_JIT_CACHE_DIR, PYTHONPATH). Recipe and reasons: docs/deep_gemm.md.
#
#   bash launch/build_deep_gemm.sh && . .dg-site/deep_gemm_env.sh && python3 -c "import deep_gemm"
#
# Env: DG_PREFIX (default .dg-site), DG_BUILD_TIMEOUT (default 300 s for the whole build),
#      CUDA_HOME (default /usr/local/cuda), DG_JIT_CACHE_DIR (default /tmp/streamring-deep-gemm-jit).
# Exit 0 only when `import deep_gemm` works afterwards; every step has a time limit.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
. launch/preflight.sh
DG_PREFIX=${DG_PREFIX:-$PWD/.dg-site}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/streamring-deep-gemm-jit}
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
T0=$(date +%s)
[ -d .deepgemm ] || preflight_fail "no .deepgemm/ here (DeepGEMM's sources)" \
  "bash launch/pack_deep_gemm.sh where the git repositories are, and carry .deepgemm"
need_cmd python3 "use the GPU host's image (its python3 has torch), or put a python3 with torch on PATH"
miss=$(missing_modules python3 torch streamring)
[ -z "$miss" ] || preflight_fail "python3 cannot import $miss" \
  "run it on the GPU host, whose python3 has torch, from the checkout (it puts the checkout on PYTHONPATH)"
need_cmd g++ "install a C++ compiler (apt-get install g++)"
[ -x "$CUDA_HOME/bin/nvcc" ] || preflight_fail "no nvcc at CUDA_HOME=$CUDA_HOME" \
  "set CUDA_HOME to the CUDA toolkit (the one with bin/nvcc)"
preflight_done "python3 $(command -v python3), g++, $CUDA_HOME/bin/nvcc, .deepgemm"
mkdir -p "$DG_PREFIX" "$DG_JIT_CACHE_DIR"
timeout "${DG_BUILD_TIMEOUT:-300}" python3 -m streamring.gemm.build_deep_gemm --src .deepgemm --prefix "$DG_PREFIX" \
  --build-dir /tmp/streamring-deep-gemm-build --cuda-home "$CUDA_HOME" --jit-cache "$DG_JIT_CACHE_DIR"
rc=$?
if [ "$rc" != 0 ]; then
  [ "$rc" = 124 ] && echo "build_deep_gemm: the build ran past ${DG_BUILD_TIMEOUT:-300} s and was stopped"
  echo "build_deep_gemm: FAILED (rc=$rc) after $(( $(date +%s) - T0 )) s"
  exit 1
fi
# shellcheck disable=SC1091
. "$DG_PREFIX/deep_gemm_env.sh"
timeout 120 python3 - <<'EOF'
import deep_gemm
print(f"build_deep_gemm: import deep_gemm {deep_gemm.__version__} from {deep_gemm.__file__} works")
from streamring.gemm.deep_gemm import deep_gemm_available
a = deep_gemm_available()
print(f"build_deep_gemm: deep_gemm_available() = {a.ok}: {a.reason}")
raise SystemExit(0 if a else 1)
EOF
rc=$?
echo "build_deep_gemm: $([ "$rc" = 0 ] && echo ok || echo "import FAILED (rc=$rc)") after $(( $(date +%s) - T0 )) s"
exit $rc
