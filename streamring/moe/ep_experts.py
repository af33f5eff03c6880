"""The experts stage of the expert-parallel layer: this PE's expert blocks (a
:class:`~streamring.moe.blocks.BlockConsumer` of its local experts), the GEMM backend that computes them
(``gemm.backends``: L1 + SwiGLU + L2 of a ready range), the grids each call is sized for, and the delivery of the
result rows to their owners' combine rows with the arrival counts.

Delivery (``csrc/ep_kernels.cu``): with a backend that stores L2 straight into its owner (``owner_rows``, P2P) the
rows are stored before the release ADD of their count (``ep_signal_arrivals``); otherwise L2 writes a local ``y``
and ``ep_put_rows`` copies the range's rows to their owners (through the peer pointers over P2P, NVSHMEM puts
otherwise), then ADDs the counts (release). The owner acquires the full count before
reading. With a stream of their own (``u``), the puts of one range run beside the next range's GEMMs: they read
only their range's rows of ``y``, which no later call writes (``y`` is a staging buffer of whole rows).

Bitwise: every GEMM row depends only on its own data (fixed tiles, fixed K order), whatever the ready ranges.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ..device import kernels as DK
from ..device.ranges import annotate as nvtx_range
from ..gemm import choice as GC
from ..gemm.backends import CAPABILITIES
from .blocks import BlockConsumer
from .grid_bounds import grouped_step_bound, grouped_step_expect, seal_bound, step_bound, step_expect
from .math import MoEShape
from .timeline_events import CHUNK_EVENTS

FIRST_BLOCKS_DONE = CHUNK_EVENTS.index("first_blocks_done")
#: a streamed forward of at most this many rows per PE is at decode size (:meth:`EPExperts.grid_ctas`): the largest
#: size at which the free SMs were measured to pay (128 and 256 rows per PE, 2 PEs under MPS)
DECODE_MAX_TOKENS = 256
#: the SMs a streamed decode forward's GEMM calls but the last leave free for the ring's kernels (60 of 66 CTAs
#: measured; 64 did not pay)
DECODE_FREE_SMS = 6


class EPExperts:
    """This PE's expert blocks and their GEMMs (local scratch, shared by every layer of the buffer).

    Args:
        choice: the resolved GEMMs (``gemm.choice.LayerChoice``); ``owner_rows``: L2 stores straight into the
        owners' combine rows (a backend that can, over P2P); ``persistent``: the persistent consumer's work queue.
    """

    def __init__(self, heap, shape: MoEShape, *, choice, experts_per_pe: int, max_rows: int, max_steps: int,
                 block_m: int, entries: int, owner_rows: bool, persistent: bool, tuning, on_gpu: bool):
        dev = heap.device
        self.heap, self.me, self.E_loc, self.tuning = heap, heap.rank, experts_per_pe, tuning
        self.choice = choice
        #: the expert GEMMs' implementation (a key of ``gemm.backends.CAPABILITIES``)
        self.gemm = choice.impl
        self.owner_rows = owner_rows
        local_shape = MoEShape(**{**shape.__dict__, "num_experts": experts_per_pe, "n_group": 1, "topk_group": 1,
                                  "router": "softmax_topk", "block_m": block_m})
        self.bc = BlockConsumer(local_shape, max_rows, max_steps, block_m, dev, ep_entries=entries,
                                local_y=not owner_rows, seal_by_expert=tuning.seal_by_expert)
        # y stays a staging buffer of whole rows: the result puts of a range may still read it while later ranges
        # compute, so no implementation may overwrite rows outside its range (staging_y=False)
        GC.setup_consumer(self.bc, choice, staging_y=False)
        #: the SMs this process's kernels may use (an MPS client's share under MPS)
        self.sm_count = torch.cuda.get_device_properties(dev).multi_processor_count if on_gpu else 1
        self.queue = None
        if persistent:
            from .work_queue import WorkQueue

            self.queue = WorkQueue(self.bc)
        # the last enqueued forward's GEMM calls (ready range, bound, expectation): what
        # debug.blocks_past_expectation compares with the blocks the calls found ready
        self.gemm_calls: list[tuple[int, int, int, Optional[int]]] = []
        # per ready index: an event after its GEMMs, which the puts on their own stream wait for (made here: an
        # event's first record must not create it inside a graph capture)
        self._computed = [torch.cuda.Event() for _ in range(max_steps + 2)] if on_gpu else []

    # -- grids ----------------------------------------------------------------------------------------
    def grid_ctas(self, path, final: bool, rows: Optional[int] = None) -> Optional[int]:
        """The ``max_ctas`` of a streamed GEMM call (None: the backend's own grid); the batch path keeps the
        backend's own grid. ``tuning.chunk_gemm_ctas`` caps every call but the forward's ``final`` one (after whose
        step no source is pending; a grouped step that may seal is capped too, as whether it seals is known only on
        the device): while a later source may still come, the dispatch's ready wait holds an SM, and a CTA of a
        statically scheduled persistent grid (``Capabilities.persistent_grid``) that finds no free SM starts its
        share of the tiles only when that wait ends. A backend that can run its grid in waves
        (``Capabilities.waves``) runs every streamed call on ``tuning.streamed_grid_waves`` CTAs per SM, so its CTAs
        retire during the call and higher-priority kernels get SMs between them.

        Decode sizes (``rows`` per PE at most :data:`DECODE_MAX_TOKENS`, a backend with a capped persistent grid):
        every call but the final one leaves :data:`DECODE_FREE_SMS` SMs free without being asked. There the
        GEMMs read weights (memory bound), so a few CTAs fewer cost little, while a grid on every SM queues the
        next step's dispatch behind the whole call and keeps a CTA of its own static schedule off an SM
        (measured with 2 PEs under MPS: docs/performance.md). At larger sizes the calls are compute bound and a
        capped grid measured slower on time, so the backend's own grid stays."""
        if path.name != "stream":
            return None
        if self.tuning.chunk_gemm_ctas is not None and not final:
            return self.tuning.chunk_gemm_ctas
        cap = CAPABILITIES[self.gemm]
        if (not final and rows is not None and rows <= DECODE_MAX_TOKENS and cap.persistent_grid and cap.max_ctas
                and self.sm_count > 2 * DECODE_FREE_SMS):
            return self.sm_count - DECODE_FREE_SMS
        waves = self.tuning.streamed_grid_waves
        return waves * self.sm_count if cap.waves and waves > 1 else None

    def holds_every_sm(self, path, i: int, rows: int) -> bool:
        """Whether the GEMM call of ready index ``i`` (``path.order[i]``) runs a grid that holds every SM of this
        process until it ends: the backend's own persistent grid (``Capabilities.persistent_grid``), not capped by
        :meth:`grid_ctas`. The last step of an ungrouped forward has no call of its own (the seal's)."""
        if not CAPABILITIES[self.gemm].persistent_grid:
            return False
        return self.grid_ctas(path, i == len(path.order) - 1, rows) is None

    def bound(self, path, grouped: bool, j: int = 0) -> int:
        """Most blocks one dispatch step can make ready (the GEMM grid bound; grouped: :func:`grouped_step_bound`)."""
        R = self.heap.num_ranks
        args = (path.chunk, self.bc.shape.topk, self.bc.block_m, self.E_loc, self.bc.max_blocks)
        return grouped_step_bound(R, j, *args) if grouped else step_bound(R, path.steps, *args)

    def expect(self, path, rows: int, grouped: bool, c: int, j: int = 0) -> int:
        """The blocks dispatch step ``j`` of chunk ``c`` is expected to make ready (the grid's hint), every source's
        chunk ``c`` holding as many rows as mine in this forward of ``rows`` rows per PE."""
        R = self.heap.num_ranks
        args = (path.rows_of_chunk(c, rows), self.bc.shape.topk, self.bc.block_m, self.E_loc)
        return grouped_step_expect(R, j, *args) if grouped else step_expect(R, path.steps, *args)

    # -- calls ----------------------------------------------------------------------------------------
    def compute(self, path, layer, lo: int, hi: int, max_items: int, expect, ctas, combine, stream,
                puts_stream=None) -> None:
        """The GEMMs of ready range ``[lo, hi)`` on ``stream``, then the delivery of its rows (on ``puts_stream`` when
        given: beside the next range's GEMMs)."""
        bc, r = self.bc, path.ring
        self.gemm_calls.append((lo, hi, max_items, expect))
        if self.owner_rows:
            bc.compute(lo, hi, max_items, layer.fw, impl=self.gemm, max_ctas=ctas, expect_items=expect,
                       out=combine.rows, direct=(bc.row_src, bc.row_tok, combine.row_delta))
            DK.ep_signal_arrivals(self.heap.lib, r.stream_ref(stream), d=r.desc, comb=combine.base,
                                  comb_peers=combine.peers, me=self.me, off_arrived=combine.layout.off_arrived,
                                  ready_list=int(bc.ready_list.data_ptr()), ready_hi=int(bc.ready_hi.data_ptr()),
                                  lo_index=lo, hi_index=hi, row_src=int(bc.row_src.data_ptr()),
                                  row_chunk=int(bc.row_chunk.data_ptr()), block_m=bc.block_m, max_items=max_items)
            return
        bc.compute(lo, hi, max_items, layer.fw, impl=self.gemm, max_ctas=ctas, expect_items=expect)
        if puts_stream is not None:  # the puts read only this range's rows of y: the next GEMMs need not wait
            self._computed[lo].record()
            puts_stream.wait_event(self._computed[lo])
            stream = puts_stream
        with torch.cuda.stream(stream) if puts_stream is not None else contextlib.nullcontext():
            DK.ep_put_rows(self.heap.lib, r.stream_ref(stream), d=r.desc, comb=combine.base,
                           comb_peers=combine.peers, me=self.me,
                           off_arrived=combine.layout.off_arrived, off_rows=combine.layout.off_rows,
                           y_stage=int(bc.y.data_ptr()), hidden=bc.shape.hidden,
                           ready_list=int(bc.ready_list.data_ptr()), ready_hi=int(bc.ready_hi.data_ptr()),
                           lo_index=lo, hi_index=hi, row_src=int(bc.row_src.data_ptr()),
                           row_tok=int(bc.row_tok.data_ptr()), row_chunk=int(bc.row_chunk.data_ptr()),
                           block_m=bc.block_m, max_items=max_items)

    def step_gemms(self, path, layer, plan, c: int, j: int, combine, stream, puts_stream, instrument) -> None:
        """The GEMM call of dispatch step ``j`` of chunk ``c`` (none for the last step of an ungrouped forward: its
        blocks go into the seal's call, one L1 and one L2 pass fewer over the weights of the experts both touch)."""
        i = path.step_index[c, j]
        last = i == len(path.order) - 1
        if last and not plan.grouped:
            return
        with nvtx_range(f"streamring block GEMMs chunk {c} step {j}", color="green"):
            self.compute(path, layer, i, i + 1, self.bound(path, plan.grouped, j),
                         self.expect(path, plan.rows, plan.grouped, c, j), self.grid_ctas(path, last, plan.rows), combine,
                         stream, puts_stream)
            if j == path.steps - 1:
                instrument.stamp(c, 4)
            elif j == 0:
                instrument.stamp(c, FIRST_BLOCKS_DONE)

    def seal(self, path, layer, plan, combine, stream, puts_stream, instrument) -> None:
        """The end of the stream: every partial block ready, computed in one call with the last step's blocks
        (grouped: sealed on the device by the step that took the last source, in that step's call)."""
        if plan.grouped:
            instrument.stamp(path.num_chunks, 2)
            return
        with nvtx_range("streamring seal + GEMMs", color="red"):
            n = len(path.order)  # dispatch steps so far: the seal is the next ready index
            # with the last step's blocks: ready_list[ready_hi[n-1] : ready_hi[n+1]] (laid out expert by expert
            # where the consumer's seal_by_expert says so)
            self.bc.seal(n, call_from=n - 1)
            bound = seal_bound(self.bound(path, False), self.E_loc, self.bc.max_blocks)
            c, j = path.order[-1]
            expect = seal_bound(self.expect(path, plan.rows, False, c, j), self.E_loc, self.bc.max_blocks)
            self.compute(path, layer, n - 1, n + 1, bound, expect, self.grid_ctas(path, final=True), combine, stream,
                         puts_stream)
            instrument.stamp(path.order[-1][0], 4)
            instrument.stamp(path.num_chunks, 2)

    # -- the persistent consumer ----------------------------------------------------------------------
    def launch_persistent(self, path, layer, ctas: int, combine, deadline_s: float) -> None:
        """The persistent consumer of this forward: ONE launch on the current stream (see ``work_queue``)."""
        self.queue.launch(layer.fw, ctas=max(1, ctas), comb_rows=combine.rows, comb_delta=combine.row_delta,
                          arrived=combine.arrived, arrived_delta=combine.arrived_delta, status=path.ring.status_t,
                          deadline_ns=int(deadline_s * 1e9))

    def seal_queue(self, path, instrument) -> None:
        n = len(path.order)  # dispatch steps so far: the seal is the next ready index
        self.bc.seal(n)
        self.queue.seal(n)
        instrument.stamp(path.num_chunks, 2)

    # -- status ---------------------------------------------------------------------------------------
    def status(self) -> int:
        """The GEMMs' ready-range status bits so far (the backend's ``status()``; 0: fine). Synchronises."""
        return self.bc.experts(self.gemm).status()
