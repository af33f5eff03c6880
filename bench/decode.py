#!/usr/bin/env python3
"""Decode-sized forwards from ONE captured graph per path: every token count 1..128 per rank, replayed.

An engine captures its forward once and replays it with a different batch every decode step. Here each
path of one :class:`~streamring.moe.ep_buffer.EPBuffer` (``max_tokens_per_rank`` = 128, DeepSeek-V3
shape, experts split over the PEs) is captured once with a device token count; the graph is then replayed
for every count of ``--counts`` (the same count on every PE), without re-capture or host work; each
replay's output is checked bitwise against the batch path's for the same count, and the slowest PE's
median replay time is reported per count and path::

    mpiexec -n 2 python3 -m bench.decode --json out/decode.json     # one PE per GPU; -n 1 on one GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from bench.common import dsv3_shape, log, stats, timed
from streamring.moe.ep_buffer import EPBuffer
from streamring.moe.tuning import EPTuning
from streamring.moe.weights import MoEWeights


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", type=lambda s: [int(v) for v in s.split(",")],
                    default=[1, 2, 4, 8, 16, 32, 64, 96, 128])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tokens-per-slot", type=int, default=64)
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--gemm", default="auto")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", "4G")
    from streamring.device.nvshmem import NvshmemHeap
    from streamring.host.launch import detect_launcher

    heap = NvshmemHeap.bootstrap(launcher=detect_launcher().value)
    R, me, dev = heap.num_ranks, heap.rank, heap.device
    shape = dsv3_shape(args.block_m)
    full = MoEWeights.random_fp8(shape, 5, dev)
    buf = EPBuffer(heap, shape, max_tokens_per_rank=args.max_tokens, num_slots=2,
                   tokens_per_slot=args.tokens_per_slot, gemm=args.gemm, tuning=EPTuning(block_m=args.block_m),
                   name="decode")
    layer = buf.prepare_weights(full)
    g = torch.Generator(device=dev)
    g.manual_seed(100 + me)
    x = torch.randn(args.max_tokens, shape.hidden, generator=g, device=dev).to(torch.bfloat16)
    n_dev = torch.tensor([args.max_tokens], dtype=torch.int64, device=dev)
    outs, graphs = {}, {}
    for path in ("batch", "stream"):
        outs[path] = torch.zeros_like(x)
        buf.forward(x, layer, streaming=(path == "stream"), num_tokens=n_dev, out=outs[path])
        heap.barrier()
        graphs[path] = buf.capture(x, layer, outs[path], streaming=(path == "stream"), num_tokens=n_dev)
        heap.barrier()
    rows = []
    for n in args.counts:
        n_dev.fill_(n)
        row = {"ranks": R, "max_tokens_per_rank": args.max_tokens, "tokens_per_rank": n, "gemm": buf.gemm,
               "chunks": buf.paths["stream"].num_chunks}
        for path in ("batch", "stream"):
            row[path] = stats(timed(heap, graphs[path].replay, args.replays))
        same = bool(torch.equal(outs["stream"][:n].view(torch.int16), outs["batch"][:n].view(torch.int16)))
        row["bitwise_equal_to_batch"] = all(heap.allgather_obj(same))
        row["streamed_over_batch"] = row["stream"]["median_ms"] / row["batch"]["median_ms"]
        rows.append(row)
        if me == 0:
            log(f"T={n:>4}: batch {row['batch']['median_ms']:.3f} ms, streamed {row['stream']['median_ms']:.3f} ms "
                f"({row['streamed_over_batch']:.3f}x), bitwise {row['bitwise_equal_to_batch']}")
    st = buf.status()
    ok = all(heap.allgather_obj(not (st["violations"] or st["timeouts"] or st["bad_routes"] or st["bad_counts"])))
    if me == 0 and args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ring_ok": ok, "args": vars(args),
                                               "memory": buf.memory_report()}, indent=1))
    del graphs
    torch.cuda.synchronize()
    heap.barrier()
    buf.close()
    heap.close()
    return 0 if ok and all(r["bitwise_equal_to_batch"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
