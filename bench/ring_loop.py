"""The ring's publish->acquire loop that the CPU benchmarks time (one definition for all of them)."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np


def publish_acquire_latencies(heap, num_slots: int, tokens_per_slot: int, hidden: int, topk: int, chunks: int,
                              counted: Callable[[int], bool]) -> tuple[list[float], float, int]:
    """Every rank publishes ``chunks`` full chunks through the whole protocol (reserve, route +
    layout publish, acquire every source, read, acknowledge), with no artificial delays.

    Returns the publish->acquire latencies (s) of the sources ``counted(src)`` selects (acquire
    time minus the later of the two publish stamps in the slot metadata: the clocks must be
    comparable: one machine), this rank's wall time of the loop, and the chunks it published.
    The ring is closed before returning.
    """
    from streamring.ring.layout import META_LAYOUT_NS, META_ROUTE_NS, META_WORDS, RingLayout
    from streamring.ring.protocol import Ring

    R = heap.num_ranks
    C, S = tokens_per_slot, num_slots
    L = RingLayout(num_ranks=R, num_slots=S, tokens_per_slot=C, hidden=hidden, topk=topk, num_experts=64)
    ring = Ring(heap, L, wait_timeout_s=60)
    idx, w = np.zeros((C, topk), np.int64), np.ones((C, topk), np.float32)
    x, sf = np.zeros((C, hidden), np.uint8), np.ones((C, hidden // 128), np.float32)
    meta = np.empty(META_WORDS, np.int64)
    lat = []
    plan = ring.begin_stream(1, chunks * C)
    heap.barrier()
    t0 = time.perf_counter()
    for c in range(plan.num_chunks):
        ring.reserve(c)
        ring.publish_route(c, idx, w)
        ring.publish_layout(c, x, sf)
        for src in range(R):
            ring.acquire(src, c)
            t_acq = time.monotonic_ns()
            view = ring.read_chunk(src, c)
            heap.get(ring.buf, L.meta_off(c % S), meta, src)
            if counted(src):
                lat.append((t_acq - max(int(meta[META_ROUTE_NS]), int(meta[META_LAYOUT_NS]))) / 1e9)
            assert view.valid == C
            ring.ack(src, c)
    ring.end_stream()
    wall = time.perf_counter() - t0
    heap.barrier()
    ring.close()
    return lat, wall, plan.num_chunks
