"""The dispatch of the expert-parallel layer: per dispatch step, acquire the chunk of the step's sources (the ring's
generations, with the deadline), gather their routes to this PE's experts, copy the routed rows out of their slots
into the expert blocks, and acknowledge the slots right after the copy (the RFC's early ``input_consumed``: nothing
reads the slot after it; ``ring_ack`` releases before its fetch_or, and the owner's ``reuse_wait`` acquires the
full mask before rewriting the slot).

Dispatch orders (``EPTuning.source_order``): ``rank`` takes chunk c of every source in one step; ``ready`` takes, in
each of R steps of chunk c, every source of c that is ready together: the first one pending to become ready, then
those ready within ``EPTuning.ready_window_us`` of it (``ring_wait_any``; grouped steps) or one per step; a step
after the one that took the last source takes none and waits for nothing. With grouped steps, the step that leaves
no source of the last chunk pending seals (decided on the device), so sources that arrive together share one GEMM
call with the partial blocks, as the batch path does, and a late source delays only its own rows. A grouped step is
trace-equivalent to one source per step, the model checker's ready order (``streamring.verify.ep``; the argument
is beside ``ring_wait_any``). ``arrival`` takes, per step j, the j-th source to publish its chunk 0, then that
source's later chunks (a one-bit pending mask: the same acquire, check and deadline); every chunk of a forward has
its own slot there (checked), so no producer waits for an acknowledgement a consumer holding another source
would owe it.
"""

from __future__ import annotations

import torch

from ..device import ep_triton as EK
from ..device import kernels as DK
from ..ring.policies import progress
from ..device.ranges import annotate as nvtx_range


class EPDispatch:
    """The dispatch's device scratch (the sources each step took, the routes it gathered) and counters."""

    def __init__(self, heap, *, entries: int, experts_per_pe: int, shape, ready_window_us: float):
        R, dev = heap.num_ranks, heap.device
        self.heap, self.R, self.me = heap, R, heap.rank
        self.E_loc, self.shape = experts_per_pe, shape
        self.window_ns = int(round(ready_window_us * 1000))
        self.flat_e = torch.zeros(entries, dtype=torch.int32, device=dev)
        self.flat_w = torch.zeros(entries, dtype=torch.float32, device=dev)
        self.pending = torch.zeros(1, dtype=torch.int64, device=dev)  # ready order: sources not yet taken
        # one source per step (arrival order; ungrouped ready order): the source of step j
        self.chosen = torch.zeros(R, dtype=torch.int32, device=dev)
        # grouped ready steps: row j = the sources step j took, -1 padded (ring_wait_any writes it)
        self.taken = torch.full((R, R), -1, dtype=torch.int32, device=dev)
        # arrival order, chunks after the first: the one source a step waits for, and where its wait writes it
        self.one_bit = torch.ones(1, dtype=torch.int64, device=dev)
        self.pending_one = torch.zeros(1, dtype=torch.int64, device=dev)
        self.chosen_again = torch.zeros(1, dtype=torch.int32, device=dev)
        self.src_all = torch.arange(R, dtype=torch.int32, device=dev)
        #: corrupt routes the dispatch dropped (an expert id outside [-1, num_experts)) since the buffer was built
        self.bad_routes = torch.zeros(1, dtype=torch.int32, device=dev)
        #: bytes the dispatch read from peers' slots (last forward): [0] one row per route, [1] one per token
        self.pull_bytes = torch.zeros(2, dtype=torch.int64, device=dev)

    def _acquire(self, path, c: int, j: int, grouped: bool, stream, inject: int):
        """Wait (acquire, deadline) for step j of chunk c's sources; returns the device int32 list of them."""
        r = path.ring
        if j == 0 and progress(path.policy).doorbells:  # no SM held until the doorbells ring
            r.wait_doorbells(stream, c)
        if grouped:
            # every source of chunk c ready together: the first one pending (acquire, deadline), then those ready
            # within the window; the rest of the R places are -1 (the data kernels skip them)
            srcs = self.taken[j]
            r.wait_any(stream, c, path.valid_tab, self.pending, j == 0, srcs, inject=inject, max_take=self.R,
                       window_ns=self.window_ns)
        elif path.source_order != "rank":
            srcs = self.chosen[j:j + 1]
            if path.source_order == "arrival" and c > 0:
                # the source is the one step j took at chunk 0: wait for exactly that one (a one-bit pending mask),
                # with the same acquire, metadata check and deadline as any ready wait
                torch.bitwise_left_shift(self.one_bit, srcs.to(torch.int64), out=self.pending_one)
                r.wait_any(stream, c, path.valid_tab, self.pending_one, False, self.chosen_again, inject=inject)
            else:
                r.wait_any(stream, c, path.valid_tab, self.pending, j == 0, srcs, inject=inject)
        else:
            srcs = self.src_all
            r.acquire_checked(stream, c, path.valid_tab, inject=inject)
        if path.mirror is not None:
            DK.ep_pull_slots(self.heap.lib, r.stream_ref(stream), d=r.desc, buf=r.buf,
                             mirror=int(path.mirror.data_ptr()), mirror_stride=path.mirror.stride(0),
                             src_list=int(srcs.data_ptr()), chunk=c, sources=srcs.shape[0])
        return srcs

    def step(self, path, c: int, j: int, *, grouped: bool, bc, stream, instrument, queue=None) -> None:
        """Dispatch step ``j`` of chunk ``c`` on ``stream``: its sources' routed rows into ``bc``'s expert blocks (its
        ready index: ``path.step_index[c, j]``), their slots acknowledged after the copy; with ``grouped``, the step
        that takes the last source of the last chunk seals; ``queue`` (the persistent consumer's) learns the
        step's blocks."""
        with nvtx_range(f"streamring acquire+dispatch+ack chunk {c} step {j}", color="orange"):
            r, L = path.ring, path.ring.layout
            s = c % path.num_slots
            srcs = self._acquire(path, c, j, grouped, stream, instrument.inject_bits)
            if j == 0:
                instrument.stamp(c, 2)
            n = srcs.shape[0] * path.chunk * self.shape.topk
            flat_e, flat_w = self.flat_e[:n], self.flat_w[:n]
            d_u8, d_f32, d_i64 = path.deltas
            ring_u8 = r.region.local
            EK.ep_gather(ring_u8.view(torch.int64), ring_u8.view(torch.float32), d_i64, d_f32, srcs, path.valid_tab, c,
                         self.me * self.E_loc, L.topk_idx_off(s) // 8, L.topk_weights_off(s) // 4, flat_e, flat_w,
                         self.bad_routes, num_ranks=self.R, tokens_per_slot=path.chunk, topk=self.shape.topk,
                         local_experts=self.E_loc, num_experts=self.shape.num_experts, pull_bytes=self.pull_bytes,
                         me=self.me, hidden=self.shape.hidden)

            def release():
                # early input_consumed: nothing reads this slot of these sources after the copy
                if path.source_order != "rank":
                    r.ack_chosen(stream, c, srcs)
                else:
                    r.ack(stream, c)
            bc.dispatch_ep(c, flat_e, flat_w, srcs, (ring_u8, ring_u8.view(torch.float32)), (d_u8, d_f32),
                           (L.x_off(s), L.x_sf_off(s) // 4), step=path.step_index[c, j], pull="token",
                           on_slot_released=release)
            if grouped and c == path.num_chunks - 1:
                # the step that leaves no source of the last chunk pending seals (decided on the device), so its GEMM
                # call has the partial blocks too: sources that arrive together get one call (its range, which no
                # GEMM call or queue has been given yet, the queue learning it below, laid out expert by expert
                # where the consumer's seal_by_expert says so)
                i = path.step_index[c, j]
                bc.seal(i, if_none_pending=self.pending, call_from=i)
            if queue is not None:
                queue.publish(path.step_index[c, j])  # the persistent consumer picks the new blocks up
            if j == path.steps - 1:
                instrument.stamp(c, 3)
