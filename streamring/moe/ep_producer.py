"""The producer side of the expert-parallel layer: per chunk, the one producer step
(:class:`~streamring.moe.blocks.Producer`: the router and top-k, or the caller's routing, and the FP8 layout) written
into the chunk's ring slot, this PE's own view of its routes, and the two publications of the chunk in its slot.

Ordering (the RFC's release/acquire): the payload kernels run before ``ring_publish`` in stream order, and its
release precedes the generation SET; the slot's valid count is a metadata word written before that release, so
the same handoff covers it. A consumer checks the count against ``[0, tokens_per_slot]`` before indexing.
Before chunk ``c >= num_slots`` rewrites its slot, ``reuse_wait`` acquires every acknowledgement of chunk
``c - num_slots`` (the protocol's rules 3 and 4).
"""

from __future__ import annotations

import torch

from ..device import ep_triton as EK
from ..device.ranges import annotate as nvtx_range
from ..device.ringdesc import RING_LAYOUT, RING_ROUTE
from .blocks import Producer


class EPProducer:
    """This PE's producer state around the one :class:`~streamring.moe.blocks.Producer` (its router scratch): the
    forward's valid count, its own routes (the owner's reduce reads them) and the expected row count per chunk (what
    the owner waits for)."""

    def __init__(self, heap, *, capacity: int, max_chunk: int, max_chunks: int, topk: int, num_experts: int):
        dev = heap.device
        self.heap = heap
        self.num_tokens_t = torch.zeros(1, dtype=torch.int64, device=dev)
        #: this forward's routes of my tokens (int64 [capacity, topk], -1: none), for the owner's reduce
        self.my_idx = torch.full((capacity, topk), -1, dtype=torch.int64, device=dev)
        self.my_w = torch.zeros(capacity, topk, dtype=torch.float32, device=dev)
        #: the routed rows the owner expects per chunk (zeroed at every forward's start)
        self.expected = torch.zeros(max_chunks, dtype=torch.int64, device=dev)
        self.step = Producer(max_chunk, num_experts, dev)
        #: device counts outside [0, T] that were clamped (forwards since the buffer was built)
        self.bad_counts = torch.zeros(1, dtype=torch.int32, device=dev)

    def begin(self, path, num_tokens, rows: int) -> None:
        """This forward's valid tokens (device: :attr:`num_tokens_t` and every chunk's count) and empty views."""
        nt = self.num_tokens_t
        if num_tokens is None:
            nt.fill_(rows)
        elif isinstance(num_tokens, int):
            nt.fill_(num_tokens)
        else:
            if not isinstance(num_tokens, torch.Tensor) or num_tokens.numel() != 1 or num_tokens.is_floating_point() \
                    or num_tokens.device != nt.device:
                raise ValueError(f"num_tokens must be None, an int or a one-element integer tensor on {nt.device}, "
                                 f"got {num_tokens!r}")
            nt.copy_(num_tokens.reshape(1))
            # a device count outside [0, T] cannot be refused without a host sync: count it, clamp it
            self.bad_counts.add_(((nt < 0) | (nt > rows)).to(torch.int32))
            nt.clamp_(0, rows)
        torch.sub(nt, path.chunk_base, out=path.chunk_valid)
        path.chunk_valid.clamp_(0, path.chunk)
        C = path.num_chunks
        self.my_idx[: C * path.chunk].fill_(-1)
        self.expected[:C].zero_()

    def produce(self, path, layer, x, c: int, routing, stream, instrument) -> None:
        """Chunk ``c`` of ``x`` (this PE's rows) into slot ``c % num_slots`` of ``path``'s ring on ``stream`` (None:
        the heap's order), published: routes first, then the layout."""
        with nvtx_range(f"streamring produce chunk {c}", color="blue"):
            r = path.ring
            slot = path.slots[c % path.num_slots]
            a = c * path.chunk
            n = path.rows_of_chunk(c, x.shape[0])
            instrument.stamp(c, 5)
            if c == 0:
                instrument.delay(self.heap.lib, r.stream_ref(stream), stream)
            if c >= path.num_slots:
                r.reuse_wait(stream, c, inject=instrument.inject_bits)
            instrument.stamp(c, 6)
            valid = path.chunk_valid[c:c + 1]
            early = instrument.inject == "signal-before-payload"  # mutation: the generations before the payload
            if early:
                r.publish(stream, c, RING_ROUTE, valid=valid)
                r.publish(stream, c, RING_LAYOUT, valid=valid)
                instrument.delay(self.heap.lib, r.stream_ref(stream), stream)
            idx = w = None
            copy = {}
            if n:
                if routing is None:
                    self.step.route(x[a:a + n], layer.fw, layer.routing, slot["topk_idx"][:n],
                                    slot["topk_weights"][:n])
                    idx, w = slot["topk_idx"][:n], slot["topk_weights"][:n]
                else:
                    idx, w = routing[0][a:a + n], routing[1][a:a + n]
                    copy = {"slot_idx": slot["topk_idx"][:n], "slot_w": slot["topk_weights"][:n]}
            instrument.stamp(c, 7)
            if n:
                # my own view for the reduce (rows at and past this forward's count route nowhere) and the
                # owner's expected row count of the chunk (zeroed at the forward's start)
                EK.own_routes(idx, w, self.my_idx[a:a + n], self.my_w[a:a + n], self.num_tokens_t,
                              self.expected[c:c + 1], row0=a, **copy)
            instrument.stamp(c, 8)
            if not early:
                r.publish(stream, c, RING_ROUTE, valid=valid)
            instrument.stamp(c, 0)
            if n:
                self.layout(x[a:a + n], slot, n)
            instrument.stamp(c, 9)
            if not early:
                r.publish(stream, c, RING_LAYOUT, valid=valid)
            instrument.stamp(c, 1)

    def layout(self, x_rows, slot: dict, n: int) -> None:
        """The layout of one chunk (:meth:`Producer.layout`: FP8 rows with 1x128 scales) into my slot (a test
        hooks here to act between the two publications)."""
        self.step.layout(x_rows, slot["x"][:n], slot["x_sf"][:n])
