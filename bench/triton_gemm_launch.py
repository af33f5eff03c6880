"""The Triton expert GEMMs' launch (``moe_triton.GEMM_LAUNCH``): block_m x pipeline depth x warps, timed.

Where the weights dominate (few rows per expert) a GEMM is a stream of weight bytes; how close it comes to
HBM bandwidth depends on how many bytes each SM keeps in flight (pipeline stages, CTAs per SM) and how
much of each tile is padding. This script times, on one H200, the L1 (+ SwiGLU + re-quantization) and L2
kernels of the block consumer over the same routed rows for each (block_m, STAGES, num_warps), interleaved
in one run, side by side with the shipped launch (the ``shipped`` rows; ratio = shipped time / this time),
and reports weight GB/s and % of nominal HBM (4.8 TB/s). Every variant's output is first checked equal to
the shipped launch's output of the same block_m (bitwise: the launch does not change the arithmetic),
the outputs filled with NaN before each check run.

    python -m bench.triton_gemm_launch --tokens 128,1024 --json docs/results/triton-gemm-launch-<date>.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys

import torch

from bench.common import FP8, HBM_GBS, dsv3_shape, event_times, log, poison, uniform_inputs
from streamring.device import moe_triton as K
from streamring.moe import blocks as B
from streamring.moe.weights import MoEWeights
from streamring.moe.bitwise import same_bits


def routed_set(T, shape, dev, seed):
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed + T)
    return uniform_inputs(T, shape, gen, dev)


def consumer(T, shape, block_m, dev, routed):
    bc = B.BlockConsumer(shape, T, 1, block_m, dev)
    bc.begin()
    bc.dispatch(0, *routed, 0)
    bc.seal(1)
    return bc


def l1(bc, fw, launch):
    return lambda: K.expert_l1(bc.ready_list, bc.ready_hi, 0, 2, bc.max_blocks, bc.block_expert, bc.a.view(FP8),
                               bc.a_sf, fw.w1, fw.w1_sf, bc.h1.view(FP8), bc.h1_sf, block_m=bc.block_m, launch=launch)


def l2(bc, fw, launch):
    return lambda: K.expert_l2(bc.ready_list, bc.ready_hi, 0, 2, bc.max_blocks, bc.block_expert, bc.h1.view(FP8),
                               bc.h1_sf, fw.w2, fw.w2_sf, bc.row_weight, bc.y, bc.block_rows, block_m=bc.block_m,
                               launch=launch)


def time_back_to_back(fns: dict, rounds: int, replays: int) -> dict:
    """Every call's milliseconds, per key of ``fns``: each function ``replays`` times in a row (eager
    launches, CUDA events around each), all of them in turn, ``rounds`` times."""
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, ms in event_times([(k, fn) for k, fn in fns.items() for _ in range(replays)]):
            times[k].append(ms)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="128,1024")
    ap.add_argument("--block-m", default="16,32,64")
    ap.add_argument("--stages", default="3,4,5,6")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each times every variant)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    shape = dsv3_shape(64)  # each consumer takes its own block_m (the sweep's)
    H, I = shape.hidden, shape.intermediate
    fw = MoEWeights.random_fp8(shape, 7, dev).fp8_blocks()
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        routed = routed_set(T, shape, dev, args.seed)
        experts = int(torch.unique(routed[0]).numel())
        wbytes = {"l1": experts * 2 * I * H, "l2": experts * H * I}
        fns, outs = {}, {}
        for bm in (int(b) for b in args.block_m.split(",")):
            bc = consumer(T, shape, bm, dev, routed)
            shipped = {g: K._gemm_cfg(bm, gemm=g) for g in ("l1", "l2")}
            variants = [("shipped", None)] + [
                (f"s{s}w{w}", {"STAGES": s, "num_warps": w})
                for s, w in itertools.product((int(x) for x in args.stages.split(",")),
                                              (int(x) for x in args.warps.split(",")))]
            for name, launch in variants:
                ok = True
                for gemm, make in (("l1", l1), ("l2", l2)):
                    fn = make(bc, fw, launch)
                    try:
                        if gemm == "l1":
                            poison(bc.h1, bc.h1_sf)
                        else:
                            l1(bc, fw, None)()  # L2's input: the shipped L1's h1
                            poison(bc.y)
                        fn()
                        torch.cuda.synchronize()
                    except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: recorded, not timed
                        log(f"T={T} bm={bm} {name} {gemm}: {type(exc).__name__}: {str(exc)[:120]}")
                        ok = False
                        break
                    out = (bc.h1.clone(), bc.h1_sf.clone()) if gemm == "l1" else (bc.y.clone(),)
                    ref = outs.setdefault((T, bm, gemm), out) if name == "shipped" else outs[(T, bm, gemm)]
                    if not all(same_bits(a, b) for a, b in zip(out, ref)):
                        log(f"T={T} bm={bm} {name} {gemm}: output differs from the shipped launch's; not timed")
                        ok = False
                        break
                    fns[(T, bm, name, gemm)] = fn  # eager: a launch costs microseconds against milliseconds
                if not ok:
                    for gemm in ("l1", "l2"):
                        fns.pop((T, bm, name, gemm), None)
            log(f"T={T} bm={bm}: shipped launch {shipped}; {len(variants)} variants")
        times = time_back_to_back(fns, args.rounds, args.replays)
        base = {(T2, bm, gemm): statistics.median(v) for (T2, bm, name, gemm), v in times.items() if name == "shipped"}
        best_shipped = {gemm: min(v for (t2, _, g), v in base.items() if g == gemm and t2 == T) for gemm in ("l1", "l2")}
        for (T2, bm, name, gemm), v in times.items():
            ms = statistics.median(v)
            gbs = wbytes[gemm] / (ms * 1e-3) / 1e9
            rows.append({"tokens": T, "gemm": gemm, "block_m": bm, "launch": name, "median_ms": ms, "min_ms": min(v),
                         "weight_gbs": gbs, "pct_hbm": 100 * gbs / HBM_GBS, "experts": experts,
                         "speed_vs_shipped_same_bm": base[(T, bm, gemm)] / ms,
                         "speed_vs_best_shipped": best_shipped[gemm] / ms})
        for gemm in ("l1", "l2"):
            mine = sorted((r for r in rows if r["tokens"] == T and r["gemm"] == gemm), key=lambda r: r["median_ms"])
            print(f"\nT={T} {gemm} ({experts} experts, {wbytes[gemm] / 1e9:.2f} GB of weights): fastest first")
            print(f"{'block_m':>7s} {'launch':>8s} {'ms':>8s} {'GB/s':>7s} {'%HBM':>6s} {'vs shipped(bm)':>14s} "
                  f"{'vs best shipped':>15s}")
            for r in mine[:12]:
                print(f"{r['block_m']:7d} {r['launch']:>8s} {r['median_ms']:8.3f} {r['weight_gbs']:7.0f} "
                      f"{r['pct_hbm']:6.1f} {r['speed_vs_shipped_same_bm']:13.3f}x {r['speed_vs_best_shipped']:14.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
                       "hbm_gbs": HBM_GBS, "shipped": {str(k): v for k, v in K.GEMM_LAUNCH.items()}, "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
