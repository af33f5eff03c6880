#!/usr/bin/env python3
"""Why does the ``pdl`` progress policy give streamed != batch? A discriminating experiment (one GPU).

``pdl`` was the serialized order with the two Triton expert GEMMs launched with programmatic
dependent launch (``launch_pdl=True`` and ``gdc_wait()`` first in each kernel). Its streamed output
differed from batch (max |diff| 0.09) on one and on two H200s, with the same Triton GEMMs on both
sides. The GEMMs' PTX differs between the two variants only by the ``griddepcontrol.wait`` (checked
with Triton 3.6 on the CPU), so the numerics are the same: something reads data that is not there
yet. Each experiment runs the same small layer (the GPU check's FAST shape) with and without PDL on
the same inputs and reports whether the outputs are bitwise equal and, where not, which rows
(tokens) and chunks differ:

* ``blocks``: the block pipeline alone (router, quant, dispatch, seal, combine of ``moe.blocks``),
  chunk by chunk on one stream, no ring and no NVSHMEM; PDL on both GEMMs. Eager, then a CUDA graph
  replayed with new inputs.
* ``blocks-l1`` / ``blocks-l2``: PDL on one GEMM only.
* ``ring``: the same through :class:`~streamring.moe.ep_buffer.EPBuffer` (one PE, NVSHMEM ring
  kernels launched through cuda.core between the Triton kernels), PDL forced on both GEMMs; graph
  replays (each a new ring epoch).

    python -m bench.pdl_probe --json out/pdl-probe.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch

from streamring.device import moe_triton as K
from streamring.moe import blocks as B
from streamring.moe.math import MoEShape

SHAPE = MoEShape(hidden=512, intermediate=256, num_experts=16, topk=4, router="deepseek_v3", n_group=4, topk_group=2,
                 routed_scaling_factor=2.5, weight_dtype="fp8", block_m=16)
T, CHUNK = 300, 64


def xs(seed, dev):
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    return torch.randn(T, SHAPE.hidden, generator=g, device=dev).to(torch.bfloat16)


def compute_with(bc, pdl_l1: bool, pdl_l2: bool):
    """``bc.compute`` with PDL on the chosen GEMMs (the same kernels, the same buffers)."""
    def compute(lo, hi, max_items, fw, pdl=False, max_ctas=None, expect_items=None, out=None, direct=None):
        h1 = bc.h1.view(B.FP8)
        K.expert_l1(bc.ready_list, bc.ready_hi, lo, hi, max_items, bc.block_expert, bc.a.view(B.FP8), bc.a_sf, fw.w1,
                    fw.w1_sf, h1, bc.h1_sf, block_m=bc.block_m, pdl=pdl_l1, max_ctas=max_ctas,
                    expect_items=expect_items)
        K.expert_l2(bc.ready_list, bc.ready_hi, lo, hi, max_items, bc.block_expert, h1, bc.h1_sf, fw.w2, fw.w2_sf,
                    bc.row_weight, bc.y if out is None else out, bc.block_rows, block_m=bc.block_m, pdl=pdl_l2,
                    max_ctas=max_ctas, expect_items=expect_items, direct=direct)
    return compute


def blocks_forward(fw, x, y, pdl_l1, pdl_l2, parts):
    prod, bc, scratch = parts
    bc.compute = compute_with(bc, pdl_l1, pdl_l2)
    B.streamed_forward_serial(x, fw, SHAPE, prod, bc, scratch, CHUNK, y)


def diff_report(a, b) -> dict:
    same = bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))
    rows = (a.view(torch.int16) != b.view(torch.int16)).any(dim=1).nonzero().flatten().tolist()
    return {"bitwise_equal": same, "max_abs_diff": float((a.float() - b.float()).abs().max()),
            "rows_differ": len(rows), "chunks_differ": sorted({r // CHUNK for r in rows}), "first_rows": rows[:8]}


def exp_blocks(dev, pdl_l1, pdl_l2) -> dict:
    fw = B.FastWeights.random(SHAPE, 7, dev)

    def parts():
        return (B.Producer(SHAPE, fw, T, dev), B.BlockConsumer(SHAPE, T, -(-T // CHUNK) + 2, 16, dev),
                B.scratch_buffers(SHAPE, T, dev))
    ref_parts, pdl_parts = parts(), parts()
    out = {"eager": [], "graph": []}
    x = xs(1, dev)
    y0, y1 = torch.zeros_like(x), torch.zeros_like(x)
    blocks_forward(fw, x, y0, False, False, ref_parts)
    blocks_forward(fw, x, y1, pdl_l1, pdl_l2, pdl_parts)
    torch.cuda.synchronize()
    out["eager"].append(diff_report(y1, y0))
    g0, g1 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g0):
        blocks_forward(fw, x, y0, False, False, ref_parts)
    with torch.cuda.graph(g1):
        blocks_forward(fw, x, y1, pdl_l1, pdl_l2, pdl_parts)
    for seed in (2, 3, 4):
        x.copy_(xs(seed, dev))
        y0.fill_(float("nan"))
        y1.fill_(float("nan"))
        g0.replay()
        g1.replay()
        torch.cuda.synchronize()
        out["graph"].append(diff_report(y1, y0))
    return out


def exp_ring(dev) -> dict:
    from streamring.device.nvshmem import NvshmemHeap
    from streamring.moe.ep_buffer import EPBuffer
    from streamring.moe.tuning import EPTuning

    heap = NvshmemHeap.bootstrap(launcher="local")
    fw = B.FastWeights.random(SHAPE, 7, dev)
    bufs = {name: EPBuffer(heap, SHAPE, max_tokens_per_rank=T, num_slots=2, tokens_per_slot=CHUNK, gemm="triton",
                           tuning=EPTuning(block_m=16, policy="serialized"), name=name) for name in ("plain", "pdl")}
    bc = bufs["pdl"].pipeline.experts.bc
    bc.compute = compute_with(bc, True, True)
    out = {"eager": [], "graph": []}
    x = xs(1, dev)
    ys = {n: torch.zeros_like(x) for n in bufs}
    layers = {n: b.prepare_weights(fw) for n, b in bufs.items()}
    for n, b in bufs.items():
        b.forward(x, layers[n], streaming=True, out=ys[n])
    torch.cuda.synchronize()
    out["eager"].append(diff_report(ys["pdl"], ys["plain"]))
    graphs = {n: b.capture(x, layers[n], ys[n], streaming=True) for n, b in bufs.items()}
    for seed in (2, 3, 4):
        x.copy_(xs(seed, dev))
        for n in bufs:
            ys[n].fill_(float("nan"))
            graphs[n].replay()
        torch.cuda.synchronize()
        out["graph"].append(diff_report(ys["pdl"], ys["plain"]))
    out["status"] = {n: {k: v for k, v in b.status().items() if k in ("violations", "timeouts", "bad_routes")}
                     for n, b in bufs.items()}
    del graphs
    for b in bufs.values():
        b.close()
    heap.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-ring", action="store_true")
    args = ap.parse_args(argv)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    results = {}
    for name, fn in (("blocks", functools.partial(exp_blocks, dev, True, True)),
                     ("blocks-l1", functools.partial(exp_blocks, dev, True, False)),
                     ("blocks-l2", functools.partial(exp_blocks, dev, False, True)),
                     ("ring", functools.partial(exp_ring, dev))):
        if name == "ring" and args.skip_ring:
            continue
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001 - one experiment's failure must not hide the others
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        r = results[name]
        if "error" in r:
            print(f"{name:<10} ERROR {r['error']}", flush=True)
            continue
        for mode in ("eager", "graph"):
            for i, d in enumerate(r[mode]):
                print(f"{name:<10} {mode:<5} run {i}: bitwise {d['bitwise_equal']!s:<5} max|diff| "
                      f"{d['max_abs_diff']:.5f} rows {d['rows_differ']:>4} chunks {d['chunks_differ']} "
                      f"first rows {d['first_rows']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
