"""What GEMM grids sized beyond their ready blocks cost, and what sizing them for the expected blocks saves, on
one GPU.

A GEMM call's grid is sized on the host before the device knows how many blocks are ready. With one CTA per
(block, tile) up to the call's bound (every block it could have, whatever the routing), the CTAs past the
ready blocks read the range and exit: the batch call's bound covers every source routing all its rows to this
PE, and after the grouped ready step that takes every source, each later step of the chunk is a call over an
empty range with its own bound. ``expect_items`` sizes the grid for the blocks the call is expected to have
under even routing and adds a small looping tail for any past them (``moe_triton._grid``). This script times,
with the Triton expert GEMMs over the blocks a PE gets at ``--tokens`` tokens per PE from ``--ranks`` sources
(DeepSeek-V3 expert shapes, ``--experts-per-pe`` experts, uniform top-8: one BlockConsumer dispatched once,
sealed; only the GEMM calls are timed), each with the pipeline's bounds and expectations
(``streamring.moe.grid_bounds``):

* ``exact``: one call over the ready blocks with the tight bound (the blocks of one forward's rows): the
  floor;
* ``batch`` / ``batch_expect``: the batch path's call (its bound), one CTA per tile of the bound / sized for
  the expected blocks;
* ``grouped`` / ``grouped_expect``: the on-time grouped schedule: the first call over the same blocks with the
  bound for all ``R`` sources, then ``R - 1`` calls over an empty range with the bounds for ``R - 1 .. 1``
  sources; one CTA per tile of the bounds / sized for the expected blocks (every source in the first
  step, one late source in each other);
* ``exact_cap{k}`` (``--cap-waves``): the exact call on ``k`` CTAs per SM looping over every tile: what the
  looping tail costs the work it takes.

Each form is a CUDA graph; their replays are interleaved (``bench.common.time_interleaved``); medians. Run it
as an MPS client with ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` = 100 / PEs to see a PE's share of the SMs
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
from streamring.moe.weights import MoEWeights
from streamring.moe.grid_bounds import grouped_step_bound, grouped_step_expect, seal_bound, step_bound, step_expect


def grouped_bounds(ranks: int, tokens: int, topk: int, block_m: int, experts: int, max_blocks: int) -> list[int]:
    """The GEMM grid bound (blocks) of each grouped step j = 0 .. R-1 of a one-chunk forward (the pipeline's)."""
    return [grouped_step_bound(ranks, j, tokens, topk, block_m, experts, max_blocks) for j in range(ranks)]


def measure(ranks: int, tokens: int, epp: int, args, dev) -> dict:
    shape = dsv3_shape(args.block_m, num_experts=epp)
    # the rows a PE gets: tokens * topk / R routes from each of R sources, as many as `tokens` tokens routed
    # over its `epp` experts; the consumer is sized for R sources (its block bound, as the pipeline's)
    bc = B.BlockConsumer(shape, ranks * tokens, 1, args.block_m, dev)
    fw = MoEWeights.random_fp8(shape, 7, dev).fp8_blocks()
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed + 97 * ranks + tokens)
    idx, w, q, sf = uniform_inputs(tokens, shape, gen, dev)
    bc.begin()
    bc.dispatch(0, idx, w, q, sf, 0)
    bc.seal(1)
    torch.cuda.synchronize()
    ready = int(bc.ready_hi[2])
    E, topk, bm, cap = epp, shape.topk, args.block_m, bc.max_blocks
    tight = seal_bound(bc.max_ready(tokens), E, cap)  # one dispatch of the tokens and the seal
    batch_bound = seal_bound(step_bound(ranks, 1, tokens, topk, bm, E, cap), E, cap)
    batch_expect = seal_bound(step_expect(ranks, 1, tokens, topk, bm, E), E, cap)
    bounds = grouped_bounds(ranks, tokens, topk, bm, E, cap)
    expects = [grouped_step_expect(ranks, j, tokens, topk, bm, E) for j in range(ranks)]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count  # an MPS client's share of them

    def one_call(bound, expect=None, ctas=None):
        return lambda: bc.compute(0, 2, bound, fw, impl="triton", max_ctas=ctas, expect_items=expect)

    def grouped(with_expect):
        def run():
            for j, b in enumerate(bounds):  # j > 0: an empty range, ready_hi[2] .. ready_hi[2]
                bc.compute(2 * (j > 0), 2, b, fw, impl="triton", expect_items=expects[j] if with_expect else None)
        return run

    forms = [("exact", one_call(tight)), ("batch", one_call(batch_bound)),
             ("batch_expect", one_call(batch_bound, batch_expect)), ("grouped", grouped(False)),
             ("grouped_expect", grouped(True))]
    forms += [(f"exact_cap{k}", one_call(tight, ctas=k * sms)) for k in args.cap_waves]
    graphs = {}
    for name, fn in forms:
        g, mode = capture(fn)
        if mode != "graph":
            raise RuntimeError(f"{name}: captured as {mode}, not a graph: the forms would not compare")
        graphs[name] = g
    t = time_interleaved(graphs, 1, lambda s: None, args.replays)
    ms = {k: v["median_ms"] for k, v in t.items()}
    row = {"ranks": ranks, "tokens_per_rank": tokens, "experts_per_pe": epp, "block_m": bm, "sms": sms,
           "ready_blocks": ready, "tight_bound": tight, "batch_bound": batch_bound, "batch_expect": batch_expect,
           "grouped_bounds": bounds, "grouped_expects": expects, "empty_blocks": sum(bounds) - ready,
           "times": t, "ms": ms, "over_exact": {k: v / ms["exact"] for k, v in ms.items()},
           "grouped_minus_exact_ms": ms["grouped"] - ms["exact"],
           "grouped_expect_minus_exact_ms": ms["grouped_expect"] - ms["exact"],
           "us_per_empty_block": 1e3 * (ms["grouped"] - ms["exact"]) / max(1, sum(bounds) - ready),
           "cap_ctas": {k: k * sms for k in args.cap_waves}}
    ox = row["over_exact"]
    log(f"R={ranks} T={tokens} E/PE={epp} ({sms} SMs): {ready} ready blocks; exact (bound {tight}) "
        f"{ms['exact']:.3f} ms; over exact: batch (bound {batch_bound}) x{ox['batch']:.3f}, sized for "
        f"{batch_expect} x{ox['batch_expect']:.3f}; grouped (bounds {bounds}) x{ox['grouped']:.3f}, sized for "
        f"{expects} x{ox['grouped_expect']:.3f}"
        + "".join(f"; {k}/SM looping x{ox[f'exact_cap{k}']:.3f}" for k in args.cap_waves))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    ap.add_argument("--ranks", type=ints, default=[2, 4], help="PEs (sources) of the grouped schedule")
    ap.add_argument("--tokens", type=ints, default=[1024], help="tokens per PE")
    ap.add_argument("--experts-per-pe", type=int, default=32)
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--cap-waves", type=ints, default=[],
                    help="also the exact call on this many CTAs per SM looping over the tiles, e.g. 1,2,4,8")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--label", default="", help="a note for the rows (e.g. the MPS share)")
    ap.add_argument("--json", help="append the rows to this JSON file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    rows = [dict(measure(R, T, args.experts_per_pe, args, dev), label=args.label)
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
