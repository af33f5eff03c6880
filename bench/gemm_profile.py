"""One launch of each expert GEMM worth profiling, for Nsight Compute (``ncu``) to measure (issue 21:
what limits our CUTLASS kernels where DeepGEMM is faster).

At ``T`` tokens (default 8192; DeepSeek-V3 shape, uniform top-8 of 256, ``bench.gemm``'s inputs), after
one warm-up call each, calls once: the CUTLASS L1 and L2 variants named (default ``coop128:bf16:n`` and
``pingpong64``, the fastest at 8192 within run-to-run noise: docs/performance.md, session 10) and, when
``import deep_gemm`` works, DeepGEMM's L1 and L2 on the exact M (its own layout). Between the calls it
synchronises, so that each kernel is profiled alone; the profiled calls lie between
``cudaProfilerStart``/``Stop``, so ``ncu --profile-from-start off`` sees exactly them
(``bash launch/gemm_bench.sh ncu`` does), with or without DeepGEMM. Run under ncu, e.g.::

    ncu --target-processes all -k regex:'device_kernel|sm90_fp8_gemm' --launch-skip 4 --launch-count 4 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --section LaunchStats --section Occupancy python3 -m bench.gemm_profile 8192

Without ncu it prints each call's time (CUDA events, one call: a sanity check, not a benchmark).
"""

import sys
from types import SimpleNamespace

import torch

from bench.common import dsv3_shape, event_times
from bench.gemm_lib import Case, parse_variants
from streamring.gemm import cutlass as CG
from streamring.gemm import deep_gemm as DG
from streamring.moe.weights import MoEWeights

T = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
L1 = sys.argv[2] if len(sys.argv) > 2 else "coop128:bf16:n"
L2 = sys.argv[3] if len(sys.argv) > 3 else "pingpong64"
dev = torch.device("cuda")
shape = dsv3_shape(64)
H, I = shape.hidden, shape.intermediate
fw = MoEWeights.random_fp8(shape, 7, dev).fp8_blocks()
dg = DG.load() if DG.deep_gemm_available() else None
(n1, (t1, d1, r1, s1)), = parse_variants(L1, "l1").items()
(n2, (t2, _, r2, s2)), = parse_variants(L2, "l2").items()
# bench.gemm's 64-row blocks, or 128 where a tile takes one 128-row block per tile
BM = 128 if CG.TILE_TABLE[t1].block_tile or CG.TILE_TABLE[t2].block_tile else 64
c = Case(T, shape, fw, SimpleNamespace(block_m=BM, seed=1234, sets=1), dev, dg)
c.load(0)
p1 = CG.GroupedGemm(2 * I, H, out_dtype=d1, tile=t1, raster=r1, swizzle=s1, capacity=c.bc.max_blocks)
p2 = CG.GroupedGemm(H, I, out_dtype=torch.bfloat16, tile=t2, raster=r2, swizzle=s2, capacity=c.bc.max_blocks)
calls = {n1: lambda: c.cutlass_l1(p1), n2: lambda: c.cutlass_l2(p2)}
if dg is not None and c.m_exact > 0:
    calls["deep_gemm_exact_m_l1"] = c.deep_gemm_exact_l1
    calls["deep_gemm_exact_m_l2"] = c.deep_gemm_exact_l2
for fn in calls.values():  # warm-up (JIT compiles, plans): the first launches of each kernel
    fn()
torch.cuda.synchronize()
torch.cuda.profiler.start()
for name, ms in event_times(calls.items(), sync_each=True):
    print(f"gemm_profile: T={T} {name}: {ms:.3f} ms (one call)", flush=True)
torch.cuda.profiler.stop()
