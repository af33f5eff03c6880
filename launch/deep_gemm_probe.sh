#!/usr/bin/env bash
# Why deep_gemm's first call segfaulted on the H200 host (2026-12-01): builds it (launch/build_deep_gemm.sh)
# and makes its first grouped call in three forms, each in its own process (a crash ends only that one):
#   native   - a_sf row-major float32 [M, K/128]: DeepGEMM transposes it itself (its own tests' form)
#   mn_major - a_sf as the block consumer passes it (deep_gemm_ops.mn_major_scales: MN-major, TMA-aligned)
#   ours     - tests/test_deep_gemm.py's GPU test
# with DG_JIT_DEBUG=1 and, where gdb exists, the native backtrace of a crash. Log: $OUT/deep_gemm_probe.log
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
export DG_JIT_DEBUG=1 PYTHONFAULTHANDLER=1
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
deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, sf), (w, w_sf), d, m_idx)
torch.cuda.synchronize()
print(form, "OK: |d| mean", float(d.float().abs().mean()), flush=True)
PY
for form in native mn_major; do
  if command -v gdb >/dev/null; then
    timeout 120 gdb -q -batch -ex run -ex bt --args python3 /tmp/dg_call.py $form >>"$LOG" 2>&1
  else
    timeout 120 python3 /tmp/dg_call.py $form >>"$LOG" 2>&1
  fi
  say "deep_gemm_probe: $form rc=$? ($(grep -a "^$form OK\|Segmentation\|SIGSEGV\|Error" "$LOG" | tail -1 | cut -c1-200))"
done
say "deep_gemm_probe: gdb $(command -v gdb || echo 'not on this host')"
timeout 150 python3 -m pytest -q -x tests/test_deep_gemm.py -p no:cacheprovider >>"$LOG" 2>&1
say "deep_gemm_probe: tests/test_deep_gemm.py rc=$? $(tail -1 "$LOG")"
