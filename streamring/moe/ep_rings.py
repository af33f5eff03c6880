"""The two rings of an :class:`~streamring.moe.ep_buffer.EPBuffer` and how a forward runs on each: the batch path
(one slot holding the whole batch, one dispatch of every source, serialized) and the streamed path (the RFC's
``front_num_slots`` x ``front_tokens_per_slot`` ring, its progress policy and dispatch order)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..ring.device import DeviceRing
from ..ring.layout import RingLayout


@dataclass
class RingPath:
    """One ring and how a forward runs on it (the batch path or the streamed path)."""

    name: str
    ring: DeviceRing
    chunk: int  # tokens per chunk (per slot)
    num_chunks: int  # chunks of every forward on this path (the same on every PE)
    num_slots: int
    policy: str
    source_order: str
    steps: int  # dispatch steps per chunk: 1 (every source at once) or R (ready and arrival orders)
    order: list  # the dispatch steps (chunk c, step j of c) in the order they are enqueued
    step_index: dict  # (c, j) -> its position in ``order`` (the block consumer's ready index)
    slots: list  # typed views of my slots (DeviceRing.slot_views)
    chunk_base: torch.Tensor  # int64 [num_chunks]: c * chunk
    chunk_valid: torch.Tensor  # int64 [num_chunks]: this forward's valid tokens of my chunk c
    valid_tab: torch.Tensor  # int32 [num_chunks, R]: valid tokens of every source's chunk (learned)
    deltas: tuple  # where the data kernels read each source's slot (bytes, f32, i64 elements)
    mirror: Optional[torch.Tensor] = None  # nv transport: local copies of every source's ring

    def rows_of_chunk(self, c: int, rows: int) -> int:
        """Rows of a forward of ``rows`` rows per PE in its chunk ``c`` (static: the host's count)."""
        return max(0, min(rows, (c + 1) * self.chunk) - c * self.chunk)

    def close(self) -> None:
        self.ring.close()


def make_path(heap, shape, max_tokens: int, *, name: str, chunk: int, num_slots: int, policy: str,
              source_order: str, transport: str, wake: bool, deadline_s: float, ring_name: str) -> RingPath:
    """A path of ``ceil(max_tokens / chunk)`` chunks of ``chunk`` tokens on a ring of ``num_slots`` slots (at most
    one per chunk), allocated on every PE (collective)."""
    R, dev = heap.num_ranks, heap.device
    num_chunks = -(-max_tokens // chunk)
    S = min(num_slots, num_chunks)
    layout = RingLayout(num_ranks=R, num_slots=S, tokens_per_slot=chunk, hidden=shape.hidden, topk=shape.topk,
                        num_experts=shape.num_experts)
    ring = DeviceRing(heap, layout, num_chunks, transport=transport, wake=wake, deadline_s=deadline_s,
                      name=ring_name)
    mirror = None
    if ring.transport == "nv":  # NVSHMEM gets into a local mirror laid out like the ring, one copy per source
        mirror = torch.zeros(R, layout.nbytes, dtype=torch.uint8, device=dev)
    steps = 1 if source_order == "rank" else R
    # arrival: step j takes the j-th source to publish its first chunk, then that source's later chunks
    if source_order == "arrival":
        order = [(c, j) for j in range(steps) for c in range(num_chunks)]
    else:
        order = [(c, j) for c in range(num_chunks) for j in range(steps)]
    return RingPath(name=name, ring=ring, chunk=chunk, num_chunks=num_chunks, num_slots=S, policy=policy,
                    source_order=source_order, steps=steps, order=order,
                    step_index={cj: i for i, cj in enumerate(order)},
                    slots=[ring.slot_views(s) for s in range(S)],
                    chunk_base=torch.arange(num_chunks, dtype=torch.int64, device=dev) * chunk,
                    chunk_valid=torch.zeros(num_chunks, dtype=torch.int64, device=dev),
                    valid_tab=torch.zeros(num_chunks, R, dtype=torch.int32, device=dev),
                    deltas=ring.read_distances(mirror), mirror=mirror)
