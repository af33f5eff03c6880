#!/usr/bin/env python3
"""Does the producer of chunk 1 run while chunk 0's block GEMMs compute? Eager vs CUDA graph.

One PE, DeepSeek-V3 shape, 8192 tokens in 2 chunks (spin_kernel policy), device timestamps
(StreamedMoE timeline). For each mode prints when chunk 1's production started, when its
route was published and when chunk 0's blocks finished (us from the forward's start)::

    python3 -m bench.probe_overlap --json out/probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bench.layer_gpu import capture, dsv3_shape
from streamring.device import moe_triton as K
from streamring.moe import blocks as B
from streamring.moe.gpu_layer import StreamedMoE
from streamring.moe.plan import PlanChoice


def median_replay_ms(fn, n: int = 10) -> float:
    """Median of ``n`` calls of ``fn`` timed with CUDA events on the current stream."""
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ev)[n // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--eager-chunks", type=lambda v: [int(c) for c in v.split(",") if c], default=[2, 4])
    ap.add_argument("--eager-reps", type=int, default=15)
    ap.add_argument("--skip-timelines", action="store_true")
    ap.add_argument("--json", default="probe.json")
    args = ap.parse_args()
    from streamring.device.nvshmem import NvshmemHeap

    heap = NvshmemHeap.bootstrap("local")
    shape = dsv3_shape()
    fw = B.FastWeights.random(shape, 7, "cuda")
    K.stamp(torch.zeros(8, dtype=torch.int64, device="cuda"), 1)
    T = args.tokens
    x = torch.randn(T, shape.hidden, device="cuda").to(torch.bfloat16)
    y = torch.empty_like(x)
    out = []
    modes = () if args.skip_timelines else (("spin_kernel", True, "graph+node-prio"), ("spin_kernel", True, "eager"),
                                            ("spin_kernel", True, "graph"), ("spin_kernel", False, "graph"))
    for policy, prio, mode in modes:
        plan = PlanChoice(chunk_tokens=-(-T // args.chunks), num_slots=2, block_m=64, policy=policy,
                          high_priority=prio)
        sm = StreamedMoE(heap, shape, fw, T, plan, timeline=True)
        try:
            sm.warm_up(x, y)
            report = ""
            if mode.startswith("graph"):
                if mode == "graph+node-prio":
                    g = sm.capture(x, y, node_priority=True)
                    report = sm.node_priority_report
                else:
                    g = capture(lambda: sm.enqueue(x, y))
                for _ in range(3):
                    g.replay()
                torch.cuda.synchronize()
                report += f"; graph median {median_replay_ms(g.replay):.3f} ms"
            else:
                for _ in range(3):
                    sm.enqueue(x, y)
            torch.cuda.synchronize()
            tl = sm.timeline()
            c0, c1 = tl["chunks"][0], tl["chunks"][1]
            rec = {"policy": policy, "high_priority": prio, "mode": mode,
                   "c1_produce_start": c1["produce_start"], "c1_route_published": c1["route_published"],
                   "c0_blocks_done": c0["blocks_done"], "forward_us": tl["tail"]["combine_done"], "timeline": tl,
                   "report": report}
            print(f"{policy:<12} prio={prio!s:<5} {mode:<5}: chunk 1 produce start {c1['produce_start']:8.1f} us, "
                  f"route published {c1['route_published']:8.1f} us; chunk 0 blocks done {c0['blocks_done']:8.1f} us; "
                  f"forward {tl['tail']['combine_done']:8.1f} us {report}", flush=True)
        except Exception as exc:  # noqa: BLE001
            rec = {"policy": policy, "high_priority": prio, "mode": mode, "error": f"{type(exc).__name__}: {exc}"}
            print(rec, flush=True)
        finally:
            sm.close()
        out.append(rec)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    # the batch path in the same run, for reference
    prod = B.Producer(shape, fw, T, "cuda")
    bc = B.BlockConsumer(shape, T, 1, 64, "cuda")
    sc = B.scratch_buffers(shape, T, "cuda")
    g = capture(lambda: B.batch_forward(x, fw, shape, prod, bc, sc, y))
    med = median_replay_ms(g.replay)
    print(f"batch path graph median {med:.3f} ms", flush=True)
    out.append({"mode": "batch graph", "median_ms": med})
    # eager streamed forwards (high-priority producer/dispatch streams overlap there) against the
    # batch graph, interleaved replay by replay, CUDA events on the caller's stream
    for C in args.eager_chunks:
        plan = PlanChoice(chunk_tokens=-(-T // C), num_slots=min(4, C), block_m=64, policy="spin_kernel",
                          high_priority=True)
        sm = StreamedMoE(heap, shape, fw, T, plan)
        try:
            y2 = torch.empty_like(x)
            sm.warm_up(x, y2)
            sm.enqueue(x, y2)
            torch.cuda.synchronize()
            tb, ts = [], []
            for _ in range(args.eager_reps):
                for which in ("batch", "eager"):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    if which == "batch":
                        g.replay()
                    else:
                        sm.enqueue(x, y2)
                    b.record()
                    torch.cuda.synchronize()
                    (tb if which == "batch" else ts).append(a.elapsed_time(b))
            st = sm.status()
            same = bool(torch.equal(y, y2))
            mb, ms = sorted(tb)[len(tb) // 2], sorted(ts)[len(ts) // 2]
            print(f"eager streamed C={C}: {ms:.3f} ms vs batch graph {mb:.3f} ms -> {ms / mb:.3f}; "
                  f"bitwise={same} violations={st.get('violations')} timeouts={st.get('timeouts')}", flush=True)
            out.append({"mode": "eager streamed vs batch graph", "chunks": C, "streamed_ms": ms, "batch_ms": mb,
                        "ratio": ms / mb, "bitwise_equal_batch": same, "ring": st})
        finally:
            sm.close()
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    heap.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
