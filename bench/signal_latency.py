#!/usr/bin/env python3
"""Per-chunk publish -> acquire latency of each progress policy vs raw nvshmem4py put_signal -> signal_wait.

Run one process per PE, from the repo root (the GPU check runs it with 1 and 2 PEs)::

    mpiexec -n 2 python3 -m bench.signal_latency --json out/bench.json

What is measured, in one run:

* ``raw``: nvshmem4py host-enqueued ``put_signal`` (8 bytes, SIGNAL_SET of i to the next PE)
  then ``signal_wait(GE i)`` on our own signal, on one stream, host clock around
  enqueue + stream sync; median over ``--iters`` (the notes measured ~19 us on one PE).
* per policy: the synthetic stream (``streamring.gpu_selftest``) of ``--chunks`` chunks captured in
  a CUDA graph and replayed ``--replays`` times with the device epoch. Two numbers:
  - ``pub->acq``: device %globaltimer from the producer's publish to the consumer's
    successful acquire of the same chunk (our own PE's chunks; the consumer is enqueued
    before the producer, so this is the policy's wake-up latency), median over every
    chunk of every replay;
  - ``per chunk``: host wall time of back-to-back replays / (replays * chunks).
Both are printed with their ratio to ``raw``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from streamring.ring.policies import progress
from streamring.ring.device import DeviceRing
from streamring.gpu_selftest import POLICIES, StreamedSequence, _agree
from streamring.ring.layout import RingLayout


def bench_raw(heap, iters: int) -> dict:
    import nvshmem.core as nv
    import torch

    me, R = heap.rank, heap.num_ranks
    sig_t = nv.tensor((1,), dtype=torch.int64)
    src_t = nv.tensor((8,), dtype=torch.uint8)
    dst_t = nv.tensor((8,), dtype=torch.uint8)
    sig_t.zero_()
    torch.cuda.synchronize()
    heap.barrier()
    sig_buf = nv.tensor_get_buffer(sig_t)[0]
    SET = nv.SignalOp.SIGNAL_SET
    # GE, not EQ: the peer may already have SET i+1 (it runs ahead once it saw our i), and an EQ
    # wait would then never see i (this hung with 2 PEs, one per GPU)
    GE = nv.ComparisonType.CMP_GE
    s = heap.sref
    times = []
    peer = (me + 1) % R
    for i in range(1, iters + 1):
        t0 = time.perf_counter()
        nv.put_signal(dst_t, src_t, sig_buf, i, SET, peer, stream=s)
        nv.signal_wait(sig_buf, i, GE, stream=s)
        heap.stream.synchronize()
        times.append(time.perf_counter() - t0)
    heap.barrier()
    for t in (sig_t, src_t, dst_t):
        nv.free_tensor(t)
    warm = times[min(50, len(times) // 10):]
    return {"p50_us": statistics.median(warm) * 1e6, "p90_us": float(np.percentile(warm, 90)) * 1e6, "n": len(warm)}


def bench_policy(heap, policy: str, replays: int, chunks: int, slots: int, producer_sms: int) -> dict:
    import torch

    R = heap.num_ranks
    layout = RingLayout(num_ranks=R, num_slots=slots, tokens_per_slot=32, hidden=128, topk=4, num_experts=64)
    ring = DeviceRing(heap, layout, chunks, transport="p2p" if policy == "green_ctx" else "nv",
                      wake=progress(policy).doorbells, timestamps=True, name="latency-ring")
    out = {"policy": policy}
    seq = None
    try:
        err = None
        try:
            seq = StreamedSequence(heap, ring, policy, producer_sms=producer_sms)
            seq.warm_up()
        except Exception as exc:  # noqa: BLE001
            err = f"{type(exc).__name__}: {exc}"
        if not _agree(heap, err is None):
            out["error"] = err or "not available on another PE"
            return out
        ring.set_epoch(1)
        origin = torch.cuda.Stream(device=heap.device)
        heap.barrier()
        with torch.cuda.stream(origin):
            seq.enqueue(origin)
        origin.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=origin, capture_error_mode="thread_local"):
                seq.enqueue(origin)
            captured = True
        except Exception as exc:  # noqa: BLE001
            captured, out["capture_error"] = False, f"{type(exc).__name__}: {exc}"
        captured = _agree(heap, captured)
        out["mode"] = "graph" if captured else "eager"
        me = heap.rank
        lat = []
        heap.barrier()
        # (1) one replay at a time, read the device stamps after each
        with torch.cuda.stream(origin):
            for _ in range(replays):
                ring.t_pub_t.zero_()
                ring.t_acq_t.zero_()
                if captured:
                    graph.replay()
                else:
                    seq.enqueue(origin)
                origin.synchronize()
                pub = ring.t_pub_t.cpu().numpy()
                acq = ring.t_acq_t.cpu().numpy().reshape(R, chunks)[me]
                ok = (pub > 0) & (acq > 0)
                lat.extend(((acq[ok] - pub[ok]) / 1e3).tolist())
        heap.barrier()
        # (2) back-to-back replays: per-chunk throughput
        with torch.cuda.stream(origin):
            origin.synchronize()
            t0 = time.perf_counter()
            for _ in range(replays):
                if captured:
                    graph.replay()
                else:
                    seq.enqueue(origin)
            origin.synchronize()
            wall = time.perf_counter() - t0
        st = ring.status()
        out.update({
            "pub_acq_p50_us": statistics.median(lat) if lat else float("nan"),
            "pub_acq_p90_us": float(np.percentile(lat, 90)) if lat else float("nan"),
            "pub_acq_n": len(lat),
            "per_chunk_us": wall / (replays * chunks) * 1e6,
            "violations": st["violations"], "timeouts": st["timeouts"],
            "green": getattr(seq, "green_how", ""),
        })
        del graph
        return out
    finally:
        torch.cuda.synchronize()
        heap.barrier()
        ring.close()
        if seq is not None:
            seq.progress.close()  # the sequence's own streams


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=2000, help="raw put_signal/signal_wait iterations")
    ap.add_argument("--replays", type=int, default=300)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--producer-sms", type=int, default=16)
    ap.add_argument("--policies", default="all")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from streamring.device.nvshmem import NvshmemHeap
    from streamring.host.launch import detect_launcher

    heap = NvshmemHeap.bootstrap(launcher=detect_launcher().value)
    raw = bench_raw(heap, args.iters)
    policies = POLICIES if args.policies == "all" else tuple(args.policies.split(","))
    rows = [bench_policy(heap, p, args.replays, args.chunks, args.slots, args.producer_sms) for p in policies]
    code = 0
    if heap.rank == 0:
        print(f"signal latency, {heap.num_ranks} PE(s): raw nvshmem4py put_signal->signal_wait "
              f"(host enqueue + sync) p50 {raw['p50_us']:.2f} us, p90 {raw['p90_us']:.2f} us")
        head = (f"{'policy':<12} {'mode':<6} {'pub->acq p50 us':>16} {'p90':>8} {'per-chunk us':>13} "
                f"{'pub->acq/raw':>13} {'per-chunk/raw':>14} {'viol':>5}")
        print(head)
        print("-" * len(head))
        for r in rows:
            if "error" in r:
                print(f"{r['policy']:<12} n/a    ({r['error'][:100]})")
                continue
            print(f"{r['policy']:<12} {r['mode']:<6} {r['pub_acq_p50_us']:>16.2f} {r['pub_acq_p90_us']:>8.2f} "
                  f"{r['per_chunk_us']:>13.2f} {r['pub_acq_p50_us'] / raw['p50_us']:>13.3f} "
                  f"{r['per_chunk_us'] / raw['p50_us']:>14.3f} {r['violations'] + r['timeouts']:>5}")
            if r["violations"] or r["timeouts"]:
                code = 1
        if args.json:
            Path(args.json).write_text(json.dumps({"pes": heap.num_ranks, "raw": raw, "policies": rows}, indent=1))
    code = max(heap.allgather_int(code))
    heap.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
