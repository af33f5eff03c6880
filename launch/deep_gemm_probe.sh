#!/usr/bin/env bash
# Why deep_gemm's first call segfaulted on the H200 host (2026-12-01): builds it (launch/build_deep_gemm.sh)
# and makes its first grouped call in three forms, each in its own process (a crash ends only that one):
#   native   - a_sf row-major float32 [M, K/128]: DeepGEMM transposes it itself (its own tests' form)
#   mn_major - a_sf as the block consumer passes it (deep_gemm_ops.mn_major_scales: MN-major, TMA-aligned)
#   ours     - tests/test_deep_gemm.py's GPU test
# with DG_JIT_DEBUG=1, stdout line-buffered, and the native backtrace of a crash: launch/segv_backtrace.c
# (LD_PRELOAD; the host has no gdb) prints each frame's module and offset; _C*.so is copied to $OUT so
# that `addr2line -f -C -e _C*.so OFFSET` can name them elsewhere. Each form also runs with
# DG_USE_PYTORCH_CUBLASLT_HANDLE=1 (DeepGEMM's runtime then creates no cuBLASLt handle of its own).
# Log: $OUT/deep_gemm_probe.log
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
LOG="$OUT/deep_gemm_probe.log"
: > "$LOG"
say() { echo "$*" | tee -a "$LOG"; }
. launch/device_env.sh
bash launch/build_deep_gemm.sh >>"$LOG" 2>&1 || { say "deep_gemm_probe: build failed (see log)"; exit 1; }
. .dg-site/deep_gemm_env.sh
export DG_JIT_DEBUG=1
unset PYTHONFAULTHANDLER  # its handler would replace the native one
SHIM=/tmp/segv_backtrace.so
CC=$(command -v cc || command -v gcc || command -v /opt/gcc/bin/gcc)
if "$CC" -shared -fPIC -O1 -o "$SHIM" launch/segv_backtrace.c -ldl >>"$LOG" 2>&1; then PRELOAD=$SHIM; else PRELOAD=; fi
say "deep_gemm_probe: cc $CC ($("$CC" --version 2>&1 | head -1)); g++ $(command -v g++) ($(g++ --version 2>&1 | head -1)); shim ${PRELOAD:-not built}"
DGC=$(ls .dg-site/deep_gemm/_C*.so 2>/dev/null | head -1)
cp "$DGC" "$OUT/" 2>/dev/null
{ echo "=== ldd $DGC"; ldd "$DGC"; } >>"$LOG" 2>&1
cat > /tmp/dg_call.py <<'PY'
import sys, torch, deep_gemm
from streamring.device import deep_gemm_ops as DG
form = sys.argv[1]
torch.manual_seed(0)
E, n, k, bm, nb = 2, 512, 768, 128, 4
a = torch.randn(nb * bm, k, device="cuda").to(torch.float8_e4m3fn)
sf = torch.rand(nb * bm, k // 128, device="cuda") + 0.5
w = torch.randn(E, n, k, device="cuda").to(torch.float8_e4m3fn)
w_sf = torch.rand(E, n // 128, k // 128, device="cuda")
m_idx = torch.tensor([0] * bm + [1] * bm + [0] * bm + [-1] * bm, dtype=torch.int32, device="cuda")
d = torch.empty(nb * bm, n, dtype=torch.bfloat16, device="cuda")
if form == "mn_major":
    s2 = DG.mn_major_scales(nb * bm, k // 128, "cuda"); s2.copy_(sf); sf = s2
print(form, "a_sf", tuple(sf.shape), sf.stride(), sf.dtype, flush=True)
print(form, "get_num_sms", deep_gemm.get_num_sms(), flush=True)
print(form, "mn-major sf", tuple(deep_gemm.get_mn_major_tma_aligned_tensor(sf).stride()), flush=True)
deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, sf), (w, w_sf), d, m_idx)
torch.cuda.synchronize()
print(form, "OK: |d| mean", float(d.float().abs().mean()), flush=True)
PY
for form in native mn_major; do
  for lt in 0 1; do
    DG_USE_PYTORCH_CUBLASLT_HANDLE=$lt LD_PRELOAD=$PRELOAD timeout 120 stdbuf -oL -eL python3 /tmp/dg_call.py $form >>"$LOG" 2>&1
    say "deep_gemm_probe: $form DG_USE_PYTORCH_CUBLASLT_HANDLE=$lt rc=$? ($(grep -a "^$form \|signal \|Segmentation\|Error" "$LOG" | tail -1 | cut -c1-200))"
  done
done
say "deep_gemm_probe: gdb $(command -v gdb || echo 'not on this host')"
LD_PRELOAD=$PRELOAD timeout 150 python3 -m pytest -q -x tests/test_deep_gemm.py -p no:cacheprovider >>"$LOG" 2>&1
say "deep_gemm_probe: tests/test_deep_gemm.py rc=$? $(tail -1 "$LOG")"
