"""What GEMM grids sized beyond their ready blocks cost: the grouped ready steps' schedule, on one GPU.

A grouped dispatch step's GEMM grid is one CTA per (block, tile) up to a host bound for every source the
step may take (``EPPipeline._max_ready_per_step``), since the host does not know how many the device will
take; after the step that takes every source and seals, each later step of the chunk is a call over an
empty range with its own bound. This script times, with the Triton expert GEMMs over the blocks a PE gets
at ``--tokens`` tokens per PE from ``--ranks`` sources (DeepSeek-V3 expert shapes, ``--experts-per-pe``
experts, uniform top-8: one BlockConsumer dispatched once, sealed; only the GEMM calls are timed):

* ``exact``: one call over the ready blocks with the tight bound (the blocks of one forward's rows). The
  batch path's own call has the buffer's whole capacity as its bound, as the first grouped call does, so
  ``grouped - exact`` also holds that first call's excess, which batch pays too;
* ``grouped``: the on-time grouped schedule: the first call over the same blocks with the bound for all
  ``R`` sources, then ``R - 1`` calls over an empty range with the bounds for ``R - 1 .. 1`` sources.

``grouped - exact`` is what the oversized grids cost. ``exact_persistent`` and ``grouped_persistent`` are the
same calls on a persistent grid of one CTA per SM the process sees (``max_ctas``; an MPS client sees its
share): the grid a device-sized schedule would launch. Each form is a CUDA graph; their replays are
interleaved (``bench.common.time_interleaved``); medians. Run it as an MPS client with
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` = 100 / PEs to see a PE's share of the SMs
(``launch/empty_grid_mps.sh``).

    python -m bench.empty_grid --ranks 2,4 --tokens 1024 --json out/empty-grid.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.common import capture, dsv3_shape, log, time_interleaved, uniform_inputs
from streamring.moe import blocks as B
from streamring.moe.grid_bounds import grouped_step_bound, seal_bound


def grouped_bounds(ranks: int, tokens: int, topk: int, block_m: int, experts: int, max_blocks: int) -> list[int]:
    """The GEMM grid bound (blocks) of each grouped step j = 0 .. R-1 of a one-chunk forward (the pipeline's)."""
    return [grouped_step_bound(ranks, j, tokens, topk, block_m, experts, max_blocks) for j in range(ranks)]


def measure(ranks: int, tokens: int, epp: int, args, dev) -> dict:
    shape = dsv3_shape(args.block_m, num_experts=epp)
    # the rows a PE gets: tokens * topk / R routes from each of R sources, as many as `tokens` tokens routed
    # over its `epp` experts; the consumer is sized for R sources (its block bound, as the pipeline's)
    bc = B.BlockConsumer(shape, ranks * tokens, 1, args.block_m, dev)
    fw = B.FastWeights.random(shape, 7, dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed + 97 * ranks + tokens)
    idx, w, q, sf = uniform_inputs(tokens, shape, gen, dev)
    bc.begin()
    bc.dispatch(0, idx, w, q, sf, 0)
    bc.seal(1)
    torch.cuda.synchronize()
    ready = int(bc.ready_hi[2])
    tight = seal_bound(bc.max_ready(tokens), epp, bc.max_blocks)  # one dispatch of the tokens and the seal
    bounds = grouped_bounds(ranks, tokens, shape.topk, args.block_m, epp, bc.max_blocks)

    sms = torch.cuda.get_device_properties(dev).multi_processor_count  # an MPS client's share of them

    def exact(ctas=None):
        bc.compute(0, 2, tight, fw, impl="triton", max_ctas=ctas)

    def grouped(ctas=None):
        bc.compute(0, 2, bounds[0], fw, impl="triton", max_ctas=ctas)
        for b in bounds[1:]:
            bc.compute(2, 2, b, fw, impl="triton", max_ctas=ctas)  # an empty range: ready_hi[2] .. ready_hi[2]

    graphs = {}
    for name, fn in (("exact", exact), ("grouped", grouped), ("exact_persistent", lambda: exact(sms)),
                     ("grouped_persistent", lambda: grouped(sms))):
        g, mode = capture(fn)
        if mode != "graph":
            raise RuntimeError(f"{name}: captured as {mode}, not a graph: the forms would not compare")
        graphs[name] = g
    t = time_interleaved(graphs, 1, lambda s: None, args.replays)
    ms = {k: v["median_ms"] for k, v in t.items()}
    row = {"ranks": ranks, "tokens_per_rank": tokens, "experts_per_pe": epp, "block_m": args.block_m,
           "ready_blocks": ready, "tight_bound": tight, "grouped_bounds": bounds,
           "empty_blocks": sum(bounds) - ready, "times": t, "ms": ms,
           "grouped_minus_exact_ms": ms["grouped"] - ms["exact"],
           "grouped_persistent_minus_exact_ms": ms["grouped_persistent"] - ms["exact"],
           "us_per_empty_block": 1e3 * (ms["grouped"] - ms["exact"]) / max(1, sum(bounds) - ready)}
    log(f"R={ranks} T={tokens} E/PE={epp}: {ready} ready blocks; exact (bound {tight}) {ms['exact']:.3f} ms, "
        f"grouped (bounds {bounds}) {ms['grouped']:.3f} ms: +{row['grouped_minus_exact_ms']:.3f} ms over "
        f"{row['empty_blocks']} empty blocks ({row['us_per_empty_block']:.2f} us each); on a persistent grid of "
        f"{sms} CTAs: exact {ms['exact_persistent']:.3f} ms, grouped {ms['grouped_persistent']:.3f} ms")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    ap.add_argument("--ranks", type=ints, default=[2, 4], help="PEs (sources) of the grouped schedule")
    ap.add_argument("--tokens", type=ints, default=[1024], help="tokens per PE")
    ap.add_argument("--experts-per-pe", type=int, default=32)
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--label", default="", help="a note for the rows (e.g. the MPS share)")
    ap.add_argument("--json", help="append the rows to this JSON file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    rows = [dict(measure(R, T, args.experts_per_pe, args, dev), label=args.label,
                 sms=torch.cuda.get_device_properties(dev).multi_processor_count)
            for R in args.ranks for T in args.tokens]
    if args.json:
        try:
            with open(args.json) as f:
                old = json.load(f)["rows"]
        except (OSError, ValueError, KeyError):
            old = []
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                       "rows": old + rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
