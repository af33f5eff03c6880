"""The owners' combine area of the expert-parallel layer (symmetric; shared by both paths and every layer) and
the owner's reduce.

Every result row of a token's k-th route lands in its owner's ``rows[token * topk + k]`` (stored over P2P by the
GEMMs, or put from a local ``y``), and the row count of each chunk is added to the owner's ``arrived[chunk]``
(release, after the rows). The owner waits until ``arrived == expected`` (acquire; ``expected`` is its producer's
count of the chunk's routed rows), sums each token's k rows in the order k = 0..K-1 (so the output is bitwise the
same whatever order the rows arrived in), and resets the counts before its next forward publishes anything:
neither rows nor counts are carried from one forward to the next (``ep_pipeline``'s ordering argument).
"""

from __future__ import annotations

import torch

from ..device import ep_triton as EK
from ..device import kernels as DK
from ..ring.layout import CombineLayout


class CombineArea:
    """``[capacity * topk, hidden]`` bf16 result rows and ``max_chunks`` arrival counts on every PE (collective).

    ``p2p``: the peers' rows and counts are reachable by loads and stores (:attr:`peers` and the deltas the
    kernels add to this PE's addresses); ``nv``: only through NVSHMEM puts (the deltas are None)."""

    def __init__(self, heap, *, capacity: int, topk: int, hidden: int, max_chunks: int, p2p: bool, name: str):
        self.heap = heap
        self.layout = CombineLayout(max_tokens=capacity, topk=topk, hidden=hidden, max_chunks=max_chunks)
        L = self.layout
        self.region = heap.alloc(f"{name}-combine", L.nbytes)
        self.base = self.region.handle.ptr
        loc = self.region.local
        self.arrived = loc[L.off_arrived: L.off_arrived + 8 * max_chunks].view(torch.int64)
        self.rows = loc[L.off_rows: L.off_rows + L.rows_bytes].view(torch.bfloat16).view(-1, hidden)
        self.peers = 0
        self.row_delta = self.arrived_delta = None
        if p2p:
            self._peers_t = heap.peer_table(self.region)
            self.peers = int(self._peers_t.data_ptr())
            self.row_delta = ((self._peers_t - self.base) // 2).contiguous()  # bf16 elements
            self.arrived_delta = ((self._peers_t - self.base) // 8).contiguous()  # int64 words

    def reduce(self, path, out: torch.Tensor, my_idx: torch.Tensor, expected: torch.Tensor, stream, c0: int,
               c1: int, instrument) -> None:
        """The owner's reduce of ``path``'s chunks ``[c0, c1)`` into ``out`` on ``stream``: wait for every expected row
        (acquire, with the ring's deadline), sum each token's k rows (``my_idx``: -1 routes nothing); after the last
        chunk the counts are reset."""
        r = path.ring
        DK.ep_wait_arrivals(self.heap.lib, r.stream_ref(stream), d=r.desc, comb=self.base,
                            off_arrived=self.layout.off_arrived, expected=int(expected.data_ptr()), first_chunk=c0,
                            num_chunks=c1 - c0)
        T, Kk = out.shape[0], self.layout.topk
        a, b = min(T, c0 * path.chunk), min(T, c1 * path.chunk)
        if b > a:
            EK.combine_owner(self.rows[a * Kk: b * Kk], my_idx[a:b], out[a:b], topk=Kk)
        if c1 == path.num_chunks:
            # reset before my next forward publishes anything: no count carried from one forward to the next
            self.arrived[:path.num_chunks].zero_()
            instrument.stamp(path.num_chunks, 3)

    def close(self) -> None:
        self.heap.free(self.region)
