#!/usr/bin/env python3
"""The producer's routing (router logits -> top-k experts and weights) on one GPU: the one-kernel rule
(``blocks.select_experts_into``, what the producers run) against the same rule in torch ops
(``moe.routers.select_experts``: sigmoid, group top-2, group top-k, mask, top-k, gather, sums).

    python3 -m bench.routing [--tokens 1024,8192] [--json out/routing.json]

DeepSeek-V3 routing (256 experts in 8 groups, 4 groups kept, top-8, bias, scaling 2.5) on float32
logits drawn N(0, 1). Per token count, in the same run: every launch variant of the kernel (rows per
program x warps) and the torch rule, each a CUDA graph of ``--graph-calls`` calls replayed
``--replays`` times (interleaved); the median per call, and the ratio torch / variant (> 1: the kernel
is faster). Before timing, every variant's experts are compared with the torch rule's (equal) and its
weights (max relative difference printed; float32 rounding only). The router GEMM before it
(``moe_triton.router_logits``) is timed beside them in tile variants (each checked against float32
torch first); its tile must be one for every token count, so compare a variant across the sizes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from streamring.device import moe_triton as K
from streamring.moe.blocks import select_experts_into
from streamring.moe.routers import select_experts

from .common import dsv3_shape, event_times

VARIANTS = [{"rows": r, "num_warps": w} for r, w in ((16, 4), (8, 8), (4, 4), (8, 4), (32, 8), (2, 2))]
#: router GEMM tiles (bm, bn, bk, warps, stages); the first is the one in use until measured otherwise
ROUTER_VARIANTS = [dict(zip(("bm", "bn", "bk", "num_warps", "num_stages"), v)) for v in (
    (64, 128, 64, 4, 3), (64, 128, 128, 4, 4), (32, 64, 64, 4, 4), (32, 128, 128, 4, 4), (64, 64, 128, 4, 4),
    (64, 256, 64, 8, 3), (128, 128, 64, 8, 3), (32, 256, 64, 8, 4))]


def router_name(v: dict) -> str:
    return f"router_bm{v['bm']}_bn{v['bn']}_bk{v['bk']}_w{v['num_warps']}_s{v['num_stages']}"


def graph_of(fn, calls: int) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1024,4096,8192")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--graph-calls", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.routing: no CUDA GPU", file=sys.stderr)
        return 2
    shape = dsv3_shape(64)  # the router only: no block size enters
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(3)
    bias = (torch.randn(shape.num_experts, generator=gen) * 0.1).to(dev)
    results = []
    for T in (int(t) for t in args.tokens.split(",")):
        logits = torch.randn(T, shape.num_experts, generator=gen).to(dev)
        x = torch.randn(T, shape.hidden, generator=gen).to(dev, torch.bfloat16)
        router = (torch.randn(shape.num_experts, shape.hidden, generator=gen) / shape.hidden ** 0.5).to(dev, torch.bfloat16)
        lg_out = torch.empty(T, shape.num_experts, device=dev)
        ref_idx, ref_w = select_experts(logits, bias, shape)
        idx = torch.empty(T, shape.topk, dtype=torch.int64, device=dev)
        w = torch.empty(T, shape.topk, dtype=torch.float32, device=dev)
        fns = {"torch_rule": lambda: select_experts(logits, bias, shape)}
        ref_lg = x.float() @ router.float().t()
        for v in ROUTER_VARIANTS:
            K.router_logits(x, router, lg_out, launch=v)
            rel = float((lg_out - ref_lg).norm() / ref_lg.norm())
            print(f"bench.routing: T={T} {router_name(v)}: relative difference to float32 torch {rel:.1e}", flush=True)
            if rel > 1e-3:
                return 1
            fns[router_name(v)] = (lambda v=v: K.router_logits(x, router, lg_out, launch=v))
        for v in VARIANTS:
            name = f"kernel_r{v['rows']}_w{v['num_warps']}"
            select_experts_into(logits, bias, shape, idx, w, launch=v)
            torch.cuda.synchronize()
            same = torch.equal(idx, ref_idx)
            rel = float(((w - ref_w).abs() / ref_w.abs()).max())
            print(f"bench.routing: T={T} {name}: experts equal to the torch rule: {same}; weights max rel diff {rel:.2e}",
                  flush=True)
            if not same:
                return 1
            fns[name] = (lambda v=v: select_experts_into(logits, bias, shape, idx, w, launch=v))
        graphs = {k: graph_of(f, args.graph_calls) for k, f in fns.items()}
        times = {k: [] for k in graphs}
        for _ in range(args.replays):
            for k, ms in event_times([(k, g.replay) for k, g in graphs.items()], sync_each=True):
                times[k].append(ms / args.graph_calls)
        base = statistics.median(times["torch_rule"])
        print(f"bench.routing: T={T}: median ms per call (torch rule / this: > 1 = faster than the torch rule)")
        for k, ts in times.items():
            med = statistics.median(ts)
            print(f"  {k:32s} {med:8.4f} ms   x{base / med:6.2f}")
            results.append({"tokens": T, "impl": k, "ms": med, "ratio_vs_torch_rule": base / med,
                            "default": k in (f"kernel_r{K.SELECT_EXPERTS_LAUNCH['rows']}_w"
                                             f"{K.SELECT_EXPERTS_LAUNCH['num_warps']}",
                                             router_name(K.ROUTER_LOGITS_LAUNCH))})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": "deepseek_v3 256 experts, 8 groups, top-4 groups, top-8", "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
