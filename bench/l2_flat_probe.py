"""Probe: the L2 expert GEMM as a persistent kernel whose tile loop and K loop are flattened into one
software pipeline (Triton's ``tl.range(..., flatten=True)``), so that a CTA loads its next tile's first
K steps while it finishes the current one. L2's K is short (2048: 16 steps of 128), so the pipeline's fill
at every tile start is a visible share of a weight-bound tile. Timed against the shipped L2
(``moe_triton.expert_l2``) over the same ready blocks, interleaved; the output is compared bit for bit.

    python -m bench.l2_flat_probe --tokens 128:16,1024:64 --ctas 132,264 --stages 3,4,5
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import triton
import triton.language as tl

from bench.common import FP8, HBM_GBS, dsv3_shape, log
from bench.triton_gemm_launch import consumer, l1, l2, routed_set, time_back_to_back
from streamring.moe import blocks as B


@triton.jit
def _l2_flat_kernel(ready_list_ptr, ready_hi_ptr, block_expert_ptr, h1_ptr, h1sf_ptr, w2_ptr, w2sf_ptr, roww_ptr,
                    y_ptr, H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, STAGES: tl.constexpr,
                    NUM_CTAS: tl.constexpr):
    BN: tl.constexpr = 128
    BK: tl.constexpr = 128
    NT: tl.constexpr = H // BN
    KS: tl.constexpr = I // BK
    lo = tl.load(ready_hi_ptr + 0)
    hi = tl.load(ready_hi_ptr + 2)
    total = (hi - lo) * NT
    kk = tl.arange(0, BK)
    for t in tl.range(tl.program_id(0), total, NUM_CTAS, flatten=True, num_stages=STAGES):
        i = t // NT
        nt = t % NT
        bid = tl.load(ready_list_ptr + lo + i)
        e = tl.load(block_expert_ptr + bid).to(tl.int64)
        rows = bid.to(tl.int64) * BM + tl.arange(0, BM)
        ncol = nt * BN + tl.arange(0, BN)
        w_e = w2_ptr + e * (H * I)
        s_e = w2sf_ptr + e * (NT * KS)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ks in range(KS):
            a = tl.load(h1_ptr + rows[:, None] * I + ks * BK + kk[None, :])
            a_s = tl.load(h1sf_ptr + rows * KS + ks)
            w = tl.load(w_e + ncol.to(tl.int64)[:, None] * I + ks * BK + kk[None, :])
            ws = tl.load(s_e + nt * KS + ks)
            acc += tl.dot(a, tl.trans(w)) * (a_s[:, None] * ws)
        rw = tl.load(roww_ptr + rows)
        y = (acc * rw[:, None]).to(tl.bfloat16)
        tl.store(y_ptr + rows[:, None] * H + ncol[None, :], y)


def l2_flat(bc, fw, ctas, stages, warps):
    _, h, i = fw.w2.shape
    return lambda: _l2_flat_kernel[(ctas,)](bc.ready_list, bc.ready_hi, bc.block_expert, bc.h1.view(FP8), bc.h1_sf,
                                            fw.w2, fw.w2_sf, bc.row_weight, bc.y, H=h, I=i, BM=bc.block_m,
                                            STAGES=stages, NUM_CTAS=ctas, num_warps=warps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="128:16,1024:64", help="tokens:block_m pairs")
    ap.add_argument("--ctas", default="132,264")
    ap.add_argument("--stages", default="3,4,5")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    shape = dsv3_shape(64)  # each consumer takes its own block_m (--tokens' pairs)
    fw = B.FastWeights.random(shape, 7, dev)
    for pair in args.tokens.split(","):
        T, bm = (int(x) for x in pair.split(":"))
        routed = routed_set(T, shape, dev, 1234)
        bc = consumer(T, shape, bm, dev, routed)
        experts = int(torch.unique(routed[0]).numel())
        wbytes = experts * shape.hidden * shape.intermediate
        l1(bc, fw, None)()
        l2(bc, fw, None)()
        torch.cuda.synchronize()
        ref = bc.y.clone()
        fns = {"shipped": l2(bc, fw, None)}
        for c in (int(x) for x in args.ctas.split(",")):
            for s in (int(x) for x in args.stages.split(",")):
                for w in (int(x) for x in args.warps.split(",")):
                    fn = l2_flat(bc, fw, c, s, w)
                    bc.y.fill_(float("nan"))
                    try:
                        fn()
                        torch.cuda.synchronize()
                    except Exception as exc:  # noqa: BLE001
                        log(f"T={T} flat c{c} s{s} w{w}: {type(exc).__name__}: {str(exc)[:120]}")
                        continue
                    rows = bc.tok_row.reshape(-1)
                    same = torch.equal(bc.y[rows].view(torch.int16), ref[rows].view(torch.int16))
                    log(f"T={T} flat c{c} s{s} w{w}: output {'bitwise equal to' if same else 'DIFFERS from'} the shipped L2's")
                    fns[f"flat c{c} s{s} w{w}"] = fn
        times = time_back_to_back(fns, args.rounds, args.replays)
        base = statistics.median(times["shipped"])
        print(f"\nT={T} block_m={bm} L2 ({experts} experts, {wbytes / 1e9:.2f} GB of weights)")
        for k, v in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
            ms = statistics.median(v)
            gbs = wbytes / (ms * 1e-3) / 1e9
            print(f"  {k:18s} {ms:7.3f} ms {gbs:6.0f} GB/s {100 * gbs / HBM_GBS:5.1f}% HBM  {base / ms:6.3f}x shipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
