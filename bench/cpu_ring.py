#!/usr/bin/env python3
"""CPU benchmark: the ring's publish->acquire latency and chunk rate against raw verbs, in one run.

    python -m bench.cpu_ring                  # (from the repo root) runs 2 and 4 ranks itself
    mpiexec -n 4 python -m bench.cpu_ring     # one size, under your launcher

Baseline (same run, same ranks): a raw ``put_signal`` of one chunk's bytes
followed by a ``signal_wait_until`` on the receiver, timed as half a ping-pong
round trip between rank 0 and rank 1 (the others idle in a barrier).
Ring: every rank publishes ``--chunks`` chunks through the full protocol
(reserve, route + layout publish, acquire every source, read, acknowledge),
no artificial delays; latency = acquire time - publish time stamped in the
slot metadata (one host: CLOCK_MONOTONIC is shared by the processes).
Prints both and the ratio ring/raw.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.ring_loop import publish_acquire_latencies

ROOT = Path(__file__).resolve().parents[1]


def bench(args) -> None:
    from streamring.device.cpu import MpiHeap
    from streamring.device.verbs import Cmp, SignalOp

    heap = MpiHeap()
    R, me = heap.num_ranks, heap.rank
    H, K, C, S = args.hidden, 8, args.tokens_per_slot, args.num_slots
    chunk_bytes = C * (H + (H // 128) * 4 + K * 12)
    # -- baseline: raw put_signal ping-pong between ranks 0 and 1 -----------------------
    region = heap.alloc("raw", chunk_bytes + 64)
    payload = np.random.default_rng(0).integers(0, 255, chunk_bytes, dtype=np.uint8)
    sig = chunk_bytes
    sig = (sig + 7) // 8 * 8
    one_way = []
    heap.barrier()
    deadline = time.monotonic() + 120
    for i in range(1, args.iters + 1):
        if me == 0:
            t0 = time.perf_counter()
            heap.put_signal(region, 0, payload, region, sig, 2 * i - 1, SignalOp.SET, 1)
            heap.signal_wait_until(region, sig, Cmp.EQ, 2 * i, deadline)
            one_way.append((time.perf_counter() - t0) / 2)
        elif me == 1:
            heap.signal_wait_until(region, sig, Cmp.EQ, 2 * i - 1, deadline)
            heap.put_signal(region, 0, payload, region, sig, 2 * i, SignalOp.SET, 0)
    heap.barrier()
    heap.free(region)
    # -- ring ------------------------------------------------------------------------------
    lat, dt, num_chunks = publish_acquire_latencies(heap, S, C, H, K, args.chunks, counted=lambda src: src != me)
    res = heap.allgather_obj(dict(rank=me, lat=lat, dt=dt, one_way=one_way))
    if me == 0:
        raw = statistics.median(res[0]["one_way"])
        all_lat = [v for r in res for v in r["lat"]]
        ring_med = statistics.median(all_lat) if all_lat else float("nan")
        rate = statistics.median([num_chunks * R / r["dt"] for r in res])
        print(f"ranks={R} chunk={C} tokens x hidden {H} ({chunk_bytes} B) slots={S} chunks/rank={num_chunks}")
        print(f"  raw put_signal -> wait one-way (ranks 0->1), median : {raw * 1e6:9.1f} us")
        print(f"  ring publish -> acquire (all pairs), median         : {ring_med * 1e6:9.1f} us"
              f"   p90 {np.percentile(all_lat, 90) * 1e6:.1f} us")
        print(f"  ratio ring / raw                                    : {ring_med / raw:9.2f}x")
        print(f"  chunks consumed per second per rank (median)        : {rate:9.0f}"
              f"   ({rate * chunk_bytes / 1e6:.1f} MB/s of chunk payload)")
    heap.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--chunks", type=int, default=2000)
    ap.add_argument("--num-slots", type=int, default=4)
    ap.add_argument("--tokens-per-slot", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    args = ap.parse_args()
    if any(v in os.environ for v in ("PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")):
        return bench(args)
    mpiexec = Path(sys.executable).parent / "mpiexec"
    for n in args.ranks:
        cmd = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(n), sys.executable, "-m", "bench.cpu_ring",
               *sys.argv[1:]]
        subprocess.run(cmd, check=True, cwd=ROOT)


if __name__ == "__main__":
    main()
