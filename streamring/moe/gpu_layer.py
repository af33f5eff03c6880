"""The expert-parallel FP8 MoE layer on GPUs: one PE per GPU (any number, one included).

Each PE holds ``E / R`` experts (only its own weights), produces its own tokens' chunks into
its ring slot, dispatches every source's chunks to its experts by device code, runs the
block-granular FP8 expert GEMMs, and sends every result row straight back to the owner of the
token. One forward is enqueued with no host synchronisation and captured as one CUDA graph; the
device epoch (``advance_epoch`` at the end) makes every replay a new ring epoch, so the generation
checks stay exact across replays (RFC: ABA across CUDA-graph replay). The batch-ready path is the
same kernels on a one-slot ring whose slot holds the whole batch (``PlanChoice.batch``): the
default and the correctness fallback.

Per chunk c (slot s = c % S) on every PE::

    producer stream                          dispatch stream (enqueued first)
    reuse_wait(c)  (every ack of c - S)      [stream_wait: doorbells of c]
    router + top-k -> slot s idx/weights     acquire_checked(c): both generations of every
    publish(ROUTE, c)  (+ metadata words)      source (acquire, deadline) + their metadata words
    FP8 quant -> slot s x / x_sf             [transport nv: RMA-get every source's slot s]
    publish(LAYOUT, c)                       ep_gather: every source's routes to my experts
                                             dispatch_ep: rows copied into my expert blocks
                                             ack(c)  <- early input_consumed: the slot is not
                                                        referenced after the copy
                                             event(c)
                                             GEMM stream: wait event(c); L1+SwiGLU, L2 of the
                                             blocks dispatch c made ready; L2 stores each row in
                                             its owner's combine rows[token][k] (P2P), then
                                             ep_signal_arrivals ADDs the row counts to the
                                             owners' arrived[chunk] (release)
    after the last chunk: seal -> GEMMs of the partial blocks -> signal; then (as owner)
    ep_wait_arrivals (arrived == expected, acquire) -> combine_owner (k-ordered sum) ->
    arrived := 0; after every stream joined: ring drain, advance_epoch.

Ordering argument (the RFC's release/acquire, each step in one place):

* producer -> consumer: the payload kernels complete before ``ring_publish`` (stream order), whose
  release precedes the generation SET; ``acquire_checked`` acquire-loads the generations and the
  data kernels follow it in stream order (``streamring.device_ring``).
* early ``input_consumed``: the dispatch kernels are the last readers of the slot; ``ring_ack``
  follows them in stream order and releases before its fetch_or; the owner's ``reuse_wait``
  acquires the full mask before the next write of the slot (rules 3 and 4 of the protocol).
* consumer -> owner (results): see ``csrc/ep_kernels.cu``: the rows are stored before the
  release ADD of their count; the owner acquires the full count before reading; the count is
  reset before the owner's next epoch publishes, and a consumer writes an owner's rows of epoch
  e+1 only after acquiring that owner's epoch-(e+1) chunks, so neither rows nor counts are
  carried across epochs.
* bitwise: every GEMM row depends only on its own data (fixed tiles, fixed K order) and the owner
  sums the k results of a token in the order k = 0..K-1, so the streamed output equals the batch
  output bitwise whatever the chunking, the progress policy or the arrival order.

Progress policies (``streamring.protocol.PROGRESS_POLICIES``): the dispatch stream is enqueued
before the producer and must not block it: ``serialized`` (one stream, chunk by chunk), ``pdl``
(serialized, GEMMs with programmatic dependent launch; one PE only, refused with more: see
``__init__``), ``spin_kernel`` (one-thread acquire kernels
with a deadline; producer and dispatch streams at high priority), ``stream_wait``
(``cuStreamWaitValue64`` on the ring's doorbells, no SM held), ``green_ctx`` (producer and consumer
on disjoint SM partitions; P2P transport).

Transports (chosen once per layer): ``p2p`` (NVLink loads/stores through peer pointers: the
dispatch pulls rows from the peers' slots, L2 stores into the peers' combine rows) or ``nv``
(NVSHMEM device RMA, for peers without a pointer, e.g. on another node: every source's slot is
fetched with gets into a local mirror, L2 writes locally and ``ep_put_rows`` puts the rows).
``transport='nv'`` forces that path between GPUs of one host, so it is tested there.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import numpy as np
import torch

from ..device import kernels as DK
from ..device import moe_triton as K
from ..device.ranges import annotate as nvtx_range
from ..device.ringdesc import RING_LAYOUT, RING_ROUTE
from ..device_ring import DeviceRing
from ..protocol import PROGRESS_POLICIES as POLICIES  # noqa: F401  (re-exported)
from ..protocol import SOURCE_ORDERS, CombineLayout, RingLayout, StreamPlan
from . import gemm_choice as GC
from .blocks import FP8, BlockConsumer, FastWeights, Producer, compute_blocks
from .math import MoEShape
from .plan import PlanChoice
# per-chunk device timestamps (ns, %globaltimer): row c of ``stamps`` is chunk c, the last row the tail
from .timeline_events import CHUNK_EVENTS, STAMP_STRIDE, TAIL_EVENTS

TRANSPORTS = ("auto", "p2p", "nv")
GEMMS = ("auto", "triton", "cutlass", "deep_gemm")


def cutlass_available() -> bool:
    """Whether the CUTLASS GEMM library loads here (built ahead: ``python -m streamring.device.build_gemm``)."""
    try:
        from ..device import cutlass_gemm as CG

        CG.library_info()
        return True
    except Exception:  # noqa: BLE001 - not built, no toolchain, no GPU: the Triton GEMMs serve
        return False


class EPMoE:
    """One expert-parallel FP8 MoE forward per call, on every PE of ``heap`` (collective).

    Args:
        heap: a started :class:`~streamring.device.nvshmem.NvshmemHeap` (one PE per GPU; several
            PEs on one GPU work under MPS).
        shape: the whole layer (``num_experts`` a multiple of the PEs; ``hidden`` and
            ``intermediate`` multiples of 128; FP8 weights).
        fw: this PE's experts only: :class:`FastWeights` with ``w1 [E/R, 2I, H]`` and
            ``w2 [E/R, H, I]`` (float8_e4m3fn, 128x128 block scales) and the *global* router
            ``[E, H]`` (bf16) and bias ``[E]`` (float32 or None) — every PE routes its own tokens
            over all experts. :meth:`FastWeights.local` slices a full set.
        tokens_per_rank: the token count of every PE's forward (``x.shape[0]`` on PE r); fixed for
            this object (graphs have fixed shapes). 0 is allowed (an empty rank publishes empty
            chunks, nobody waits on it).
        plan: chunk size, slots, ``block_m`` and progress policy (:meth:`PlanChoice.batch` for the
            batch-ready path).
        transport: ``"auto"`` (P2P when every peer is load/store reachable, else NVSHMEM RMA),
            ``"p2p"`` or ``"nv"`` (forces RMA; see the module doc).
        deadline_s: every device wait gives up after this long and records where it waited
            (:meth:`status`); nothing hangs.
        straggler_ns: a device-side delay before this PE's first produced chunk (benchmarks and
            tests of a slow rank); a device word, changed with :meth:`set_straggler` between replays
            of a captured graph.
        timeline: record per-chunk ``%globaltimer`` stamps (:meth:`timeline`).
        producer_sms: green_ctx only: SMs of the producer partition.
        source_order: ``"rank"`` (each chunk of every source acquired together, then one dispatch)
            or ``"ready"`` (the RFC's later optimisation: per chunk, R steps, each taking whichever
            source is ready first, decided on the device by ``ring_wait_any``; its rows are dispatched
            and their full blocks computed at once, so a late source delays only its own rows).
        gemm: the expert GEMMs: ``"triton"`` (``moe_triton``; L2 stores straight into the owners over
            P2P), ``"cutlass"`` (CUTLASS's SM90 FP8 blockwise grouped GEMM, ``device/cutlass_gemm``,
            faster at every size measured; L2 writes locally and ``ep_put_rows`` puts the rows),
            ``"deep_gemm"`` (DeepGEMM's grouped FP8 GEMM when ``import deep_gemm`` works; needs
            ``plan.block_m`` 128) or ``"auto"`` (the fastest available one of the measured table,
            ``streamring/moe/gemm_choice.py``; CUTLASS, else Triton, where nothing is measured; see
            :attr:`gemm` and :attr:`gemm_choice`). Each keeps the bitwise streamed == batch contract;
            their outputs differ from each other by rounding (the CUTLASS and DeepGEMM L1 output is
            rounded to bf16 before SwiGLU).
        inject: a deliberate protocol mutation (``streamring.protocol.INJECT_MODES``; tests and the GPU
            check): ``skip-acquire`` (the consumer does not wait for the generations),
            ``signal-before-payload`` (the producer publishes before it writes the slot),
            ``skip-ack-wait`` (the producer reuses a slot without waiting for every ack),
            ``ignore-epoch`` (generations compared without their epoch). With a straggler the window
            is wide open; the run's bitwise and status checks must then fail.

    Use: :meth:`warm_up` once (compiles every kernel, checks the ring), then :meth:`enqueue`
    eagerly or :meth:`capture` one forward into a CUDA graph and replay it. :meth:`status`
    after a forward: ring violations, timeouts and dropped corrupt routes (all must be 0).
    """

    def __init__(self, heap, shape: MoEShape, fw: FastWeights, tokens_per_rank: Sequence[int], plan: PlanChoice, *,
                 transport: str = "auto", deadline_s: float = 10.0, straggler_ns: int = 0, timeline: bool = False,
                 producer_sms: int = 16, inject: str = "none", source_order: str = "rank", gemm: str = "auto",
                 name: str = "ep"):
        from ..device.ringdesc import INJECT_BITS

        plan.validate()
        if inject not in INJECT_BITS:
            raise ValueError(f"inject must be one of {list(INJECT_BITS)}, got {inject!r}")
        self.inject = inject
        self.inject_bits = INJECT_BITS[inject]
        if source_order not in SOURCE_ORDERS:
            raise ValueError(f"source_order must be one of {SOURCE_ORDERS}, got {source_order!r}")
        if source_order == "ready" and heap.num_ranks > 64:
            raise ValueError(f"source_order 'ready' supports up to 64 PEs, got {heap.num_ranks}")
        self.source_order = source_order
        if plan.policy == "pdl" and heap.num_ranks > 1:
            # Measured, not yet understood: on 2 H200s (one PE each, launch/gpu_check.sh,
            # 2026-11-30) the streamed output under 'pdl' differed from the batch output on both
            # ranks (max |diff| 0.09), while every other policy was bitwise equal and 'pdl' is
            # bitwise equal with one PE (tests/test_gpu_ep.py). Refused until that is explained.
            allowed = [p for p in POLICIES if p != "pdl"]
            raise ValueError(f"plan.policy 'pdl' is refused with more than one PE ({heap.num_ranks}): its streamed "
                             f"output differed from batch on 2 GPUs; use one of {allowed}")
        if gemm not in GEMMS:
            raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
        if gemm in ("cutlass", "deep_gemm") and plan.policy == "pdl":
            raise ValueError(f"gemm={gemm!r} has no programmatic dependent launch: use a policy other than 'pdl'")
        # implementation and variants from the measured table (gemm_choice); an explicit gemm only picks the variants
        self.gemm_choice = GC.resolve_layer(gemm, plan, shape, tokens_per_rank)
        gemm = self.gemm_choice.impl
        self.gemm = gemm
        R, me = heap.num_ranks, heap.rank
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if shape.num_experts % R:
            raise ValueError(f"shape.num_experts={shape.num_experts} must be a multiple of the {R} PEs")
        tokens = [int(t) for t in tokens_per_rank]
        if len(tokens) != R or any(t < 0 for t in tokens):
            raise ValueError(f"tokens_per_rank must hold {R} counts >= 0 (one per PE), got {list(tokens_per_rank)}")
        E_loc = shape.num_experts // R
        if fw.w1.shape[0] != E_loc or fw.w2.shape[0] != E_loc:
            raise ValueError(f"fw must hold this PE's {E_loc} experts (w1 [{E_loc}, 2I, H]), got w1 "
                             f"{list(fw.w1.shape)}; FastWeights.local(rank, num_ranks) slices a full set")
        if tuple(fw.router.shape) != (shape.num_experts, shape.hidden):
            raise ValueError(f"fw.router must be the global router [{shape.num_experts}, {shape.hidden}], "
                             f"got {list(fw.router.shape)}")
        self.heap, self.shape, self.fw, self.plan = heap, shape, fw, plan
        self.R, self.me, self.E_loc, self.e_lo = R, me, E_loc, me * E_loc
        self.tokens_per_rank = tokens
        self.tokens = tokens[me]
        t_max = max(tokens)
        self.chunk = max(1, min(plan.chunk_tokens, max(t_max, 1)))
        sp = StreamPlan(epoch=1, tokens_per_rank=tuple(tokens), tokens_per_slot=self.chunk)
        self.num_chunks = max(1, sp.num_chunks)
        S = min(plan.num_slots, self.num_chunks)
        self.num_slots = S
        H, Kk = shape.hidden, shape.topk
        dev = heap.device
        self.dev = dev
        layout = RingLayout(num_ranks=R, num_slots=S, tokens_per_slot=self.chunk, hidden=H, topk=Kk,
                            num_experts=shape.num_experts)
        self.layout = layout
        self.ring = DeviceRing(heap, layout, self.num_chunks, transport="p2p" if plan.policy == "green_ctx" else transport,
                               wake=(plan.policy == "stream_wait"), deadline_s=deadline_s, name=f"{name}-ring")
        self.transport = self.ring.transport
        # -- the owner's combine area (symmetric) ------------------------------------------------
        self.comb_layout = CombineLayout(max_tokens=max(t_max, 1), topk=Kk, hidden=H, max_chunks=self.num_chunks)
        CL = self.comb_layout
        self.comb_region = heap.alloc(f"{name}-combine", CL.nbytes)
        self.comb_base = self.comb_region.handle.ptr
        loc = self.comb_region.local
        self.arrived = loc[CL.off_arrived: CL.off_arrived + 8 * self.num_chunks].view(torch.int64)
        self.comb_rows = loc[CL.off_rows: CL.off_rows + CL.rows_bytes].view(torch.bfloat16).view(-1, H)
        if self.transport == "p2p":
            comb_peers = heap.peer_table(self.comb_region)
            self.comb_peers = int(comb_peers.data_ptr())
            self.comb_delta = ((comb_peers - self.comb_base) // 2).contiguous()  # bf16 elements
            self._comb_peers_t = comb_peers
        # -- where each source's slot is read from -------------------------------------------------
        ring_u8 = self.ring.region.local
        self.ring_u8, self.ring_f32, self.ring_i64 = ring_u8, ring_u8.view(torch.float32), ring_u8.view(torch.int64)
        base = self.ring.buf
        if self.transport == "p2p":
            delta = self.ring.peers_t - base
        else:  # NVSHMEM gets into a local mirror laid out like the ring, one copy per source
            self.mirror = torch.zeros(R, layout.nbytes, dtype=torch.uint8, device=dev)
            self.mirror_stride = layout.nbytes
            delta = torch.arange(R, dtype=torch.int64, device=dev) * layout.nbytes + (
                int(self.mirror.data_ptr()) - base)
        self.delta_u8 = delta.contiguous()
        self.delta_f32 = (delta // 4).contiguous()
        self.delta_i64 = (delta // 8).contiguous()
        self.src_all = torch.arange(R, dtype=torch.int32, device=dev)
        self.valid_tab = torch.tensor([[sp.chunk_tokens(r, c)[1] for r in range(R)] for c in range(self.num_chunks)],
                                      dtype=torch.int32, device=dev)
        # -- my slot, written by my producers ------------------------------------------------------
        n = self.chunk

        def view(off, nbytes, dtype, shape_):
            return ring_u8[off: off + nbytes].view(dtype).view(*shape_)

        L = layout
        self.slot_x = [view(L.x_off(s), n * H, FP8, (n, H)) for s in range(S)]
        self.slot_sf = [view(L.x_sf_off(s), n * L.sf_cols * 4, torch.float32, (n, L.sf_cols)) for s in range(S)]
        self.slot_idx = [view(L.topk_idx_off(s), n * Kk * 8, torch.int64, (n, Kk)) for s in range(S)]
        self.slot_w = [view(L.topk_weights_off(s), n * Kk * 4, torch.float32, (n, Kk)) for s in range(S)]
        # my routing kept for my reduce (the slot is reused before the results are back), -1 padded
        self.my_idx = torch.full((self.num_chunks * n, Kk), -1, dtype=torch.int64, device=dev)
        self.expected = torch.zeros(self.num_chunks, dtype=torch.int64, device=dev)
        self.prod = Producer(shape, fw, n, dev)
        local_shape = MoEShape(**{**shape.__dict__, "num_experts": E_loc, "n_group": 1, "topk_group": 1,
                                  "router": "softmax_topk", "block_m": plan.block_m})
        self.entries = R * n * Kk
        # dispatch steps per chunk: one (every source at once) or R (one source each, ready order)
        self.steps = R if source_order == "ready" else 1
        # L2 stores straight into the owners only with the Triton GEMMs over P2P; else a local y + puts
        self.direct_l2 = self.transport == "p2p" and gemm == "triton"
        self.bc = BlockConsumer(local_shape, max(sum(tokens), 1), self.num_chunks * self.steps, plan.block_m, dev,
                                ep_entries=self.entries, local_y=not self.direct_l2)
        # y is a staging buffer here: ep_put_rows sends each range's rows right after its GEMMs
        GC.setup_consumer(self.bc, self.gemm_choice, staging_y=True)
        self.pending = torch.zeros(1, dtype=torch.int64, device=dev)  # ready order: sources not yet taken
        self.chosen = torch.zeros(R, dtype=torch.int32, device=dev)  # ready order: the source of step j
        self.flat_e = torch.zeros(self.entries, dtype=torch.int32, device=dev)
        self.flat_w = torch.zeros(self.entries, dtype=torch.float32, device=dev)
        self.bad_routes = torch.zeros(1, dtype=torch.int32, device=dev)
        self.straggler_t = torch.full((1,), int(straggler_ns), dtype=torch.int64, device=dev)
        self.stamps = torch.zeros((self.num_chunks + 1) * STAMP_STRIDE, dtype=torch.int64, device=dev) \
            if timeline else None
        self._recording = True
        # -- streams -------------------------------------------------------------------------------
        self.green = None
        self.events = []
        if plan.policy == "green_ctx":
            from ..device.green import make_green_pair

            self.green = make_green_pair(heap.device_index, producer_sms)
            self.pstream = self.green[0].stream
            self.dstream = self.gstream = self.green[1].stream
        elif plan.policy in ("serialized", "pdl"):
            self.pstream = self.dstream = self.gstream = None
        else:
            # Producer and dispatch at high priority: their CTAs are scheduled before the next
            # pending CTA of a big GEMM grid, so chunk c+1 is produced and dispatched while chunk c's
            # blocks compute.
            hi = -10 if plan.priority_streams() else 0
            self.pstream = torch.cuda.Stream(device=dev, priority=hi)
            self.dstream = torch.cuda.Stream(device=dev, priority=hi)
            self.gstream = torch.cuda.Stream(device=dev, priority=0)
            self.events = [torch.cuda.Event() for _ in range(self.num_chunks * self.steps)]
        self.ring.set_epoch(1)
        heap.barrier()

    # -- pieces ------------------------------------------------------------------------------------
    def _stamp(self, row, col):
        if self.stamps is not None and self._recording:
            K.stamp(self.stamps, row * STAMP_STRIDE + col)

    def _side(self, which):
        """Context manager making side ``which`` ('p' producer, 'd' dispatch, 'g' GEMMs) current."""
        stream = {"p": self.pstream, "d": self.dstream, "g": self.gstream}[which]
        if stream is None:
            return contextlib.nullcontext()
        if self.green is None:
            return torch.cuda.stream(stream)
        side = self.green[0 if which == "p" else 1]

        @contextlib.contextmanager
        def both():
            with side.current(), torch.cuda.stream(side.stream):
                yield
        return both()

    def _rows(self, c):
        a = c * self.chunk
        b = min(self.tokens, (c + 1) * self.chunk)
        return a, max(a, b)

    def _produce(self, x, c):
        with nvtx_range(f"streamring produce chunk {c}", color="blue"):
            r, st = self.ring, torch.cuda.current_stream()
            s = c % self.num_slots
            a, b = self._rows(c)
            n = b - a
            self._stamp(c, 5)
            if c == 0:
                DK.ep_delay(self.heap.lib, self.ring.stream_ref(st), ns=int(self.straggler_t.data_ptr()))
            if c >= self.num_slots:
                r.reuse_wait(st, c, inject=self.inject_bits)
            early = self.inject == "signal-before-payload"  # mutation: the generations before the payload
            if early:
                r.publish(st, c, RING_ROUTE, valid=n)
                r.publish(st, c, RING_LAYOUT, valid=n)
                DK.ep_delay(self.heap.lib, self.ring.stream_ref(st), ns=int(self.straggler_t.data_ptr()))
            if n:
                self.prod.route(x[a:b], self.slot_idx[s][:n], self.slot_w[s][:n])
                self.my_idx[a:b].copy_(self.slot_idx[s][:n])
            if not early:
                r.publish(st, c, RING_ROUTE, valid=n)
            self._stamp(c, 0)
            if n:
                self.prod.layout(x[a:b], self.slot_x[s][:n], self.slot_sf[s][:n])
            if not early:
                r.publish(st, c, RING_LAYOUT, valid=n)
            self._stamp(c, 1)

    def _expected(self):
        # the owner's expected row count per chunk: its routed (token, k) pairs
        self.expected.copy_((self.my_idx >= 0).view(self.num_chunks, -1).sum(dim=1))

    def _dispatch(self, c, j=0):
        """Dispatch step j of chunk c: every source (rank order) or the j-th ready source."""
        with nvtx_range(f"streamring acquire+dispatch+ack chunk {c} step {j}", color="orange"):
            r, st = self.ring, torch.cuda.current_stream()
            s = c % self.num_slots
            L = self.layout
            ready = self.source_order == "ready"
            if self.plan.policy == "stream_wait" and j == 0:
                r.wait_doorbells(st, c)
            if ready:
                srcs = self.chosen[j:j + 1]
                r.wait_any(st, c, self.valid_tab, self.pending, j == 0, srcs, inject=self.inject_bits)
            else:
                srcs = self.src_all
                r.acquire_checked(st, c, self.valid_tab, inject=self.inject_bits)
            if self.transport == "nv":
                DK.ep_pull_slots(self.heap.lib, r.stream_ref(st), d=r.desc, buf=r.buf,
                                 mirror=int(self.mirror.data_ptr()), mirror_stride=self.mirror_stride,
                                 src_list=int(srcs.data_ptr()), chunk=c, sources=srcs.shape[0])
            if j == 0:
                self._stamp(c, 2)
            n = srcs.shape[0] * self.chunk * self.shape.topk
            flat_e, flat_w = self.flat_e[:n], self.flat_w[:n]
            K.ep_gather(self.ring_i64, self.ring_f32, self.delta_i64, self.delta_f32, srcs, self.valid_tab, c,
                        self.e_lo, L.topk_idx_off(s) // 8, L.topk_weights_off(s) // 4, flat_e, flat_w,
                        self.bad_routes, num_ranks=self.R, tokens_per_slot=self.chunk, topk=self.shape.topk,
                        local_experts=self.E_loc, num_experts=self.shape.num_experts)
            self.bc.dispatch_ep(c, flat_e, flat_w, srcs, (self.ring_u8, self.ring_f32), (self.delta_u8, self.delta_f32),
                                (L.x_off(s), L.x_sf_off(s) // 4), step=c * self.steps + j)
            # early input_consumed: nothing reads this slot of these sources after the copy
            if ready:
                r.ack_chosen(st, c, srcs)
            else:
                r.ack(st, c)
            if j == self.steps - 1:
                self._stamp(c, 3)

    def _gemms(self, lo, hi, max_items, max_ctas=None):
        bc, r = self.bc, self.ring
        st = torch.cuda.current_stream()
        pdl = self.plan.policy == "pdl"
        if self.direct_l2:
            bc.compute(lo, hi, max_items, self.fw, pdl=pdl, max_ctas=max_ctas, out=self.comb_rows,
                       direct=(bc.row_src, bc.row_tok, self.comb_delta))
            DK.ep_signal_arrivals(self.heap.lib, r.stream_ref(st), d=r.desc, comb=self.comb_base, comb_peers=self.comb_peers,
                                  me=self.me, off_arrived=self.comb_layout.off_arrived,
                                  ready_list=int(bc.ready_list.data_ptr()), ready_hi=int(bc.ready_hi.data_ptr()),
                                  lo_index=lo, hi_index=hi, row_src=int(bc.row_src.data_ptr()),
                                  row_chunk=int(bc.row_chunk.data_ptr()), block_m=bc.block_m, max_items=max_items)
        else:
            compute_blocks(bc, lo, hi, max_items, self.fw, self.gemm, pdl=pdl, max_ctas=max_ctas)
            DK.ep_put_rows(self.heap.lib, r.stream_ref(st), d=r.desc, comb=self.comb_base, me=self.me,
                           off_arrived=self.comb_layout.off_arrived, off_rows=self.comb_layout.off_rows,
                           y_stage=int(bc.y.data_ptr()), hidden=self.shape.hidden,
                           ready_list=int(bc.ready_list.data_ptr()), ready_hi=int(bc.ready_hi.data_ptr()),
                           lo_index=lo, hi_index=hi, row_src=int(bc.row_src.data_ptr()),
                           row_tok=int(bc.row_tok.data_ptr()), row_chunk=int(bc.row_chunk.data_ptr()),
                           block_m=bc.block_m, max_items=max_items)

    def _chunk_gemms(self, c, j=0):
        with nvtx_range(f"streamring block GEMMs chunk {c} step {j}", color="green"):
            i = c * self.steps + j
            # the persistent (SM-sparing) grid only while later chunks are still being produced; the
            # last chunk's blocks, like the sealed ones, take the whole GPU
            ctas = self.plan.chunk_gemm_ctas if c < self.num_chunks - 1 else None
            self._gemms(i, i + 1, self.max_ready_per_step(), ctas)
            if j == self.steps - 1:
                self._stamp(c, 4)

    def max_ready_per_step(self) -> int:
        """Most blocks one dispatch step can make ready (the GEMM grid bound)."""
        return min(self.bc.max_blocks, self.entries // self.steps // self.bc.block_m + self.E_loc)

    def _seal(self):
        with nvtx_range("streamring seal + GEMMs", color="red"):
            n = self.num_chunks * self.steps  # dispatch steps so far: the seal is the next ready index
            self.bc.seal(n)
            self._gemms(n, n + 1, min(self.bc.max_blocks, self.E_loc))
            self._stamp(self.num_chunks, 2)

    def _combine(self, out):
        with nvtx_range("streamring wait arrivals + combine", color="red"):
            r, st = self.ring, torch.cuda.current_stream()
            DK.ep_wait_arrivals(self.heap.lib, r.stream_ref(st), d=r.desc, comb=self.comb_base,
                                off_arrived=self.comb_layout.off_arrived, expected=int(self.expected.data_ptr()),
                                num_chunks=self.num_chunks)
            T = self.tokens
            K.combine_owner(self.comb_rows[: T * self.shape.topk], self.my_idx[:T], out, topk=self.shape.topk)
            # reset before my next epoch publishes anything: no count carried across epochs
            self.arrived.zero_()
            self._stamp(self.num_chunks, 3)

    # -- the forward --------------------------------------------------------------------------------
    def warm_up(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """One eager forward in the serialized order (no wait enqueued before its producer), then a
        device sync: compiles and loads every kernel the plan's order uses, so no module load can
        happen while a stream waits on the ring. Raises if the ring reports any error."""
        self.enqueue(x, out, order="serialized")
        torch.cuda.synchronize(self.dev)
        st = self.status()
        if st["violations"] or st["timeouts"] or st["bad_routes"]:
            raise RuntimeError(f"ring errors in the warm-up forward: {st}")

    def enqueue(self, x: torch.Tensor, out: torch.Tensor, order: str | None = None, stamps: bool = True) -> None:
        """Enqueue one forward of this PE's ``x [tokens, H]`` (bf16) into ``out [tokens, H]`` (bf16).

        Collective: every PE enqueues its forward (each replay of a captured graph likewise).
        ``order='serialized'`` forces the one-stream chunk-by-chunk order (used by :meth:`warm_up`).
        ``stamps=False`` leaves the timeline stamp kernels out (a layer made with ``timeline=True``
        can capture one graph for timing and one for its timeline).
        """
        self._recording = stamps
        try:
            self._enqueue(x, out, order)
        finally:
            self._recording = True

    def _enqueue(self, x, out, order):
        with nvtx_range(f"streamring EPMoE.enqueue ({self.num_chunks} chunks, {self.plan.policy})", color="purple"):
            H = self.shape.hidden
            if tuple(x.shape) != (self.tokens, H) or tuple(out.shape) != (self.tokens, H):
                raise ValueError(f"x and out must have shape [{self.tokens}, {H}] (tokens_per_rank[{self.me}], "
                                 f"hidden), got {list(x.shape)} and {list(out.shape)}")
            if x.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
                raise ValueError(f"x and out must be bfloat16, got {x.dtype} and {out.dtype}")
            r = self.ring
            origin = torch.cuda.current_stream()
            C = self.num_chunks
            if self.pstream is None or order == "serialized":  # one stream, chunk by chunk
                self._stamp(C, 0)
                self.bc.begin()
                for c in range(C):
                    self._produce(x, c)
                    for j in range(self.steps):
                        self._dispatch(c, j)
                        self._chunk_gemms(c, j)
                self._stamp(C, 1)
                self._expected()
                self._seal()
                self._combine(out)
            else:
                for st in {self.pstream, self.dstream, self.gstream}:
                    st.wait_stream(origin)
                # the consumer is enqueued FIRST: the progress policy must keep it from blocking producers
                with self._side("d"):
                    self._stamp(C, 0)
                    self.bc.begin()
                    for c in range(C):
                        for j in range(self.steps):
                            self._dispatch(c, j)
                            if self.events:
                                self.events[c * self.steps + j].record()
                            else:
                                self._chunk_gemms(c, j)  # green_ctx: dispatch and GEMMs share the consumer's stream
                if self.events:
                    with self._side("g"):
                        for c in range(C):
                            for j in range(self.steps):
                                self.gstream.wait_event(self.events[c * self.steps + j])
                                self._chunk_gemms(c, j)
                with self._side("g"):
                    self._seal()
                with self._side("p"):
                    for c in range(C):
                        self._produce(x, c)
                    self._expected()
                    self._stamp(C, 1)
                self.gstream.wait_stream(self.pstream)
                with self._side("g"):
                    self._combine(out)
                for st in {self.pstream, self.dstream, self.gstream}:
                    origin.wait_stream(st)
            r.drain(origin)
            r.advance_epoch(origin)

    def capture(self, x: torch.Tensor, out: torch.Tensor, *, node_priority: bool = True, stamps: bool = True):
        """Capture one forward into a CUDA graph and return it (call :meth:`warm_up` first).

        With ``node_priority`` (and high-priority producer/dispatch streams) every kernel node but
        the expert GEMMs gets the high launch priority explicitly (a captured node does not keep
        its stream's priority); ``self.node_priority_report`` says how many nodes were changed."""
        want = node_priority and self.plan.priority_streams() and self.events != []
        g = torch.cuda.CUDAGraph(keep_graph=want)
        side = torch.cuda.Stream(device=self.dev)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(g, stream=side, capture_error_mode="thread_local"):
            self.enqueue(x, out, stamps=stamps)
        self.node_priority_report = "not asked" if not want else _prioritize_nodes(
            g, {int(k.function) for k in self.bc.gemm_kernels}, self.pstream.priority)
        if want:
            g.instantiate()
        torch.cuda.current_stream().wait_stream(side)
        return g

    def set_straggler(self, ns: int) -> None:
        """Delay this PE's producer by ``ns`` nanoseconds (device side) in the next forwards (0: none)."""
        self.straggler_t.fill_(int(ns))

    def status(self) -> dict:
        """The ring's device status (violations, timeouts, published, consumed, first error) and the
        number of corrupt routes dropped by the dispatch (``bad_routes``)."""
        st = self.ring.status()
        st["bad_routes"] = int(self.bad_routes.item())
        return st

    def timeline(self) -> dict:
        """Per-chunk device timestamps of the last forward (needs ``timeline=True``), in us from start."""
        if self.stamps is None:
            raise ValueError("this EPMoE was made without timeline=True")
        st = self.stamps.view(-1, STAMP_STRIDE).cpu().numpy().astype(np.int64)
        t0 = int(st[self.num_chunks, 0])
        chunks = [{ev: (int(st[c, j]) - t0) / 1e3 for j, ev in enumerate(CHUNK_EVENTS)}
                  for c in range(self.num_chunks)]
        tail = {ev: (int(st[self.num_chunks, j]) - t0) / 1e3 for j, ev in enumerate(TAIL_EVENTS)}
        n, k = self.num_chunks, self.steps
        ready = self.bc.ready_hi.cpu().tolist()[: n * k + 2]
        for c in range(n):
            chunks[c]["blocks_ready"] = ready[(c + 1) * k] - ready[c * k]
        tail["seal_blocks"] = ready[n * k + 1] - ready[n * k]
        return {"chunks": chunks, "tail": tail, "policy": self.plan.policy, "source_order": self.source_order,
                "tokens": self.tokens,
                "chunk_tokens": self.chunk, "num_slots": self.num_slots, "block_m": self.plan.block_m,
                "rank": self.me, "ranks": self.R}

    def close(self) -> None:
        """Free the ring and the combine area (collective)."""
        self.heap.free(self.comb_region)
        self.ring.close()


def _prioritize_nodes(graph, low_funcs: set, priority: int) -> str:
    """Give every kernel node of the captured ``graph`` whose function is not in ``low_funcs``
    the launch priority ``priority`` (CUDA driver graph API). Returns a one-line report."""
    from cuda.bindings import driver as drv

    def ok(res, what):
        err = res[0] if isinstance(res, tuple) else res
        if err != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what}: {err}")
        return res[1:] if isinstance(res, tuple) else ()

    try:
        cg = drv.CUgraph(int(graph.raw_cuda_graph()))
        _, count = ok(drv.cuGraphGetNodes(cg, 0), "cuGraphGetNodes(count)")
        nodes, _ = ok(drv.cuGraphGetNodes(cg, count), "cuGraphGetNodes")
        kernel_type = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
        # the node-attribute flavour of the launch attribute (cuda-bindings wants these types)
        ids = getattr(drv, "CUkernelNodeAttrID", drv.CUlaunchAttributeID)
        attr = getattr(ids, "CU_KERNEL_NODE_ATTRIBUTE_PRIORITY", None)
        if attr is None:
            attr = ids.CU_LAUNCH_ATTRIBUTE_PRIORITY
        value_type = getattr(drv, "CUkernelNodeAttrValue", drv.CUlaunchAttributeValue)
        changed = kept = 0
        for node in nodes:
            (ntype,) = ok(drv.cuGraphNodeGetType(node), "cuGraphNodeGetType")
            if ntype != kernel_type:
                continue
            (params,) = ok(drv.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
            if int(params.func) in low_funcs:
                kept += 1
                continue
            val = value_type()
            val.priority = int(priority)
            ok(drv.cuGraphKernelNodeSetAttribute(node, attr, val), "cuGraphKernelNodeSetAttribute")
            changed += 1
        return f"{changed} kernel nodes set to priority {priority}, {kept} GEMM nodes left at the default"
    except Exception as exc:  # noqa: BLE001 - the graph still runs, without node priorities
        return f"node priorities not set: {type(exc).__name__}: {exc}"
