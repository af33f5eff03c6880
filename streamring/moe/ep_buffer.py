"""The expert-parallel FP8 MoE layer on GPUs, as an engine holds it: one buffer, many layers.

:class:`EPBuffer` is created once per process group (one PE per GPU, any number; several PEs on
one GPU under MPS). It owns every symmetric allocation (the batch ring, the streamed ring, the
owners' combine area), the expert blocks' scratch, the producer's scratch and the streams, and
is shared by every MoE layer of a model. A layer's weights are prepared once
(:meth:`EPBuffer.prepare_weights`: bf16 weights are quantized to FP8 with 128x128 scales, FP8 checkpoint
tensors are taken as they are) and :meth:`EPBuffer.forward` runs one layer on this PE's tokens,
collectively on every PE::

    buf = EPBuffer(heap, shape, num_slots=2, tokens_per_slot=4096, max_tokens_per_rank=8192)
    w = buf.prepare_weights(weights)                    # once per layer (a MoEWeights)
    y = buf.forward(x, w)                       # batch-ready path (default)
    y = buf.forward(x, w, streaming=True)       # streamed through the ring
    y = buf.forward(x_max, w, num_tokens=n)     # n: a device int64: the valid rows of x_max

Everything a forward enqueues is capture-safe (no host synchronisation, no shape-dependent host
work but the static ``x.shape[0]``), so the caller may capture it inside its own CUDA graph and
replay that graph with a different ``num_tokens`` each time: every chunk's valid count is derived
on the device, the producer publishes it in the slot's metadata, consumers learn it from there.
The device epoch of each ring advances at the end of every forward, so generations stay exact
across replays (RFC: ABA across CUDA-graph replay).

The buffer is a composition of parts (the rings, a producer, a dispatch, the experts, the combine area, the
progress policy's streams); :mod:`streamring.moe.ep_pipeline` orders them and gives the ordering argument, each
part's module the argument of what it does. Test and benchmark hooks are an instrument attached explicitly
(:mod:`streamring.moe.instrument`).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from ..device import kernels as DK
from ..device.graph_priority import prioritize_nodes
from ..ring import progress as PG
from ..device.ringdesc import describe_status
from ..gemm.backends import CAPABILITIES
from ..gemm.cutlass import status_text as gemm_status_text
from ..ring.layout import MAX_EPOCH
from ..ring.policies import progress
from ..ring.protocol import WatchdogError
from . import ep_config as CFG
from .contract import DEFAULT_DEADLINE_S
from .checks import (check_num_tokens, check_out, check_routing, check_stream_epoch, check_streaming, check_x,
                     host_read_allowed)
from .ep_combine import CombineArea
from .ep_dispatch import EPDispatch
from .ep_experts import EPExperts
from .ep_launch import LaunchAhead
from .ep_pipeline import Pipeline
from .ep_producer import EPProducer
from .ep_rings import make_path
from .instrument import NO_INSTRUMENT
from .math import MoEShape
from .tuning import EPTuning
from .weight_views import PESliceView
from .weights import MoEWeights

# re-exported: the buffer's GEMM resolution, its sizes' check and memory report (ep_config)
resolve_gemm = CFG.resolve_gemm
cutlass_unavailable_reason = CFG.cutlass_unavailable_reason
memory_report = CFG.memory_report


class EPBuffer:
    """One process group's buffers for every expert-parallel FP8 MoE layer (collective).

    Args:
        heap: a started :class:`~streamring.device.nvshmem.NvshmemHeap` (one PE per GPU; several
            PEs on one GPU work under MPS).
        shape: sizes of every layer that will use this buffer (``hidden``, ``intermediate``,
            ``num_experts`` a multiple of the PEs, ``topk``; ``hidden``/``intermediate`` multiples of
            128) and the default routing of :meth:`prepare_weights`.
        max_tokens_per_rank: the most tokens any PE passes to one forward (sizes the batch ring, the
            combine area and the expert blocks).
        num_slots, tokens_per_slot: the streamed ring (the RFC's ``front_num_slots`` /
            ``front_tokens_per_slot``); default ``tokens_per_slot``: ``max_tokens_per_rank``, one chunk per
            forward, which the default ``ready`` order streams by source: the sources ready together in one
            step (forwards of up to ``tuning.group_max_tokens`` rows), else one source at a time (the measured
            best at the EP8 per-GPU load, ``docs/performance.md``: more chunks cost another weight pass each).
        gemm: ``"triton"``, ``"cutlass"``, ``"deep_gemm"`` (``block_m`` 128, when ``import deep_gemm``
            works) or ``"auto"`` (:func:`resolve_gemm`: the fastest available one of a measured layer row, else of
            the measured GEMM table);
            :attr:`gemm` is the resolved implementation, :attr:`gemm_choice` its variants and why. Every
            path of this buffer runs the same GEMMs, so a streamed-vs-batch comparison never measures two
            GEMMs' rounding.
        deadline_s: every device wait gives up after this long and records where it waited
            (:meth:`status`); nothing hangs.
        tuning: the scheduling switches (:class:`~streamring.moe.tuning.EPTuning`; default: the measured
            defaults).
        name: prefix of this buffer's symmetric allocations (distinct per buffer of one process).

    The streamed path's GEMMs run per dispatch step. In the default ``ready`` order a step takes every
    source that is ready together (within ``tuning.ready_window_us``), and the step that takes the last
    source seals, so on-time sources share one GEMM call with the partial blocks (one L1 and one L2 pass
    over the weights, as in the batch path) and a late source's rows get a call of their own.
    With a local ``y`` (CUTLASS, DeepGEMM, RMA transport) the result puts run on a stream of their own, so
    the next blocks' GEMMs do not wait for them.

    Memory: :meth:`memory_report` (or :func:`memory_report` before building one).
    """

    def __init__(self, heap, shape: MoEShape, *, max_tokens_per_rank: int, num_slots: int = 2,
                 tokens_per_slot: Optional[int] = None, gemm: str = "auto", deadline_s: float = DEFAULT_DEADLINE_S,
                 tuning: Optional[EPTuning] = None, name: str = "ep"):
        if tuning is None:
            tuning = EPTuning()
        elif not isinstance(tuning, EPTuning):
            raise ValueError(f"tuning must be an EPTuning, got {type(tuning).__name__}")
        R = heap.num_ranks
        M, C, S, _ = CFG.check_sizes(shape, R, max_tokens_per_rank, num_slots, tokens_per_slot, tuning.block_m)
        CFG.check_tuning(tuning, R, -(-M // C), S)
        block_m, choice = CFG.resolve_block_and_gemm(CFG.consumer_gemm(gemm, tuning), shape, R, M, tuning.block_m)
        CFG.check_gemm(tuning, choice.impl, torch.device(heap.device).type == "cuda")
        #: the scheduling switches this buffer runs (frozen)
        self.tuning = tuning
        self.heap, self.shape, self.max_tokens, self.deadline_s = heap, shape, M, deadline_s
        #: an error in a running stream (None: usable); the buffer then refuses to run: rebuild it
        self.broken: Optional[str] = None
        #: the tuned table's answer for the last streaming="auto" forward (:meth:`adaptive_streaming`)
        self.last_adaptive = None
        #: a consumer side enqueued ahead of its forward (:meth:`launch_consumer`)
        self.launches = LaunchAhead(self)
        self.warm_paths: set = set()  # the paths whose first (eager) forward ran
        self._graph_paths: dict = {}  # id(graph) -> the path it was captured on (replay() checks that ring)
        #: what the last :meth:`capture` set of its graph's node priorities
        self.node_priority_report = "not asked"
        self.paths = self._make_paths(C, S, name)
        self._make_parts(choice, block_m, name)
        for p in self.paths.values():
            p.ring.set_epoch(1)
        heap.barrier()

    def _make_paths(self, chunk: int, slots: int, name: str) -> dict:
        """The batch ring (one slot of the whole batch, serialized) and the streamed ring (symmetric)."""
        tu = self.tuning
        transport = "p2p" if tu.policy == "green_ctx" else tu.transport
        common = dict(transport=transport, deadline_s=self.deadline_s)
        paths = {"batch": make_path(self.heap, self.shape, self.max_tokens, name="batch", chunk=self.max_tokens,
                                    num_slots=1, policy="serialized", source_order="rank", wake=False,
                                    ring_name=f"{name}-batch-ring", **common),
                 "stream": make_path(self.heap, self.shape, self.max_tokens, name="stream", chunk=chunk,
                                     num_slots=slots, policy=tu.policy, source_order=tu.source_order,
                                     wake=progress(tu.policy).doorbells, ring_name=f"{name}-stream-ring", **common)}
        if tu.consumer == "persistent" and paths["stream"].ring.transport != "p2p":
            raise ValueError("consumer 'persistent' needs every peer load/store reachable (P2P); this job's transport "
                             "is 'nv' (another node?): use consumer 'per_chunk'")
        return paths

    def _make_parts(self, choice, block_m: int, name: str) -> None:
        """The producer, the dispatch, the experts, the combine area and the streams, and their order."""
        heap, sh, tu, paths = self.heap, self.shape, self.tuning, self.paths
        R, E_loc = heap.num_ranks, sh.num_experts // heap.num_ranks
        # every token a forward can name, on either path (a chunk's valid count is at most its size)
        capacity = max(p.num_chunks * p.chunk for p in paths.values())
        max_chunks = max(p.num_chunks for p in paths.values())
        entries = max(R * p.chunk * sh.topk for p in paths.values())
        p2p = paths["stream"].ring.transport == "p2p"
        combine = CombineArea(heap, capacity=capacity, topk=sh.topk, hidden=sh.hidden, max_chunks=max_chunks,
                              p2p=p2p, name=name)
        producer = EPProducer(heap, capacity=capacity, max_chunk=max(p.chunk for p in paths.values()),
                              max_chunks=max_chunks, topk=sh.topk, num_experts=sh.num_experts)
        dispatch = EPDispatch(heap, entries=entries, experts_per_pe=E_loc, shape=sh, ready_window_us=tu.ready_window_us)
        experts = EPExperts(heap, sh, choice=choice, experts_per_pe=E_loc, max_rows=R * capacity,
                            max_steps=max(p.num_chunks * p.steps for p in paths.values()), block_m=block_m,
                            entries=entries, owner_rows=p2p and CAPABILITIES[choice.impl].owner_rows,
                            persistent=tu.consumer == "persistent", tuning=tu,
                            on_gpu=torch.device(heap.device).type == "cuda")
        puts_high = tu.puts_at_high_priority(persistent_grid=CAPABILITIES[choice.impl].persistent_grid)
        progress = PG.make(tu.policy, heap.device, producer_sms=tu.producer_sms,
                           default_priority_roles=("g",) if puts_high else ("g", "u"))
        self.pipeline = Pipeline(heap=heap, paths=paths, progress=progress, producer=producer, dispatch=dispatch,
                                 experts=experts, combine=combine, tuning=tu, deadline_s=self.deadline_s)

    # -- what the parts hold, read-only ---------------------------------------------------------------
    @property
    def dev(self):
        return self.heap.device

    @property
    def R(self) -> int:
        return self.heap.num_ranks

    @property
    def me(self) -> int:
        return self.heap.rank

    @property
    def E_loc(self) -> int:
        """Experts per PE."""
        return self.shape.num_experts // self.heap.num_ranks

    @property
    def max_tokens_per_rank(self) -> int:
        """The most tokens any PE passes to one forward."""
        return self.max_tokens

    @property
    def local_experts(self) -> range:
        """The experts this PE holds (rank r holds ``[r * E/R, (r+1) * E/R)``)."""
        return range(self.me * self.E_loc, (self.me + 1) * self.E_loc)

    @property
    def gemm(self) -> str:
        """The expert GEMMs' implementation of every path (``gemm.backends``)."""
        return self.pipeline.experts.gemm

    @property
    def gemm_choice(self):
        """The expert GEMMs' variants and why they were chosen (``gemm.choice.LayerChoice``)."""
        return self.pipeline.experts.choice

    @property
    def block_m(self) -> int:
        return self.pipeline.experts.bc.block_m

    @property
    def transport(self) -> str:
        """``p2p`` (NVLink loads and stores) or ``nv`` (NVSHMEM RMA): how this buffer reaches its peers."""
        return self.paths["stream"].ring.transport

    @property
    def instrument(self):
        """The test and benchmark hooks attached to this buffer (:mod:`streamring.moe.instrument`), or None."""
        inst = self.pipeline.instrument
        return None if inst is NO_INSTRUMENT else inst

    @instrument.setter
    def instrument(self, inst) -> None:
        self.pipeline.instrument = NO_INSTRUMENT if inst is None else inst

    # -- layers -----------------------------------------------------------------------------------
    def prepare_weights(self, weights: MoEWeights, routing: Optional[MoEShape] = None) -> PESliceView:
        """One layer's weights for this buffer (call once per layer; keep the result).

        Args:
            weights: the layer's :class:`~streamring.moe.weights.MoEWeights`, all experts or only this PE's
                (bf16 weights are quantized to FP8 with 128x128 block scales here; FP8 weights with their
                scales, e.g. a checkpoint's ``weight_scale_inv``, are taken as they are).
            routing: the layer's router (kind, groups, scaling); default the buffer's ``shape``.
                Its sizes must equal the buffer's.

        Returns:
            :class:`~streamring.moe.weight_views.PESliceView` (:meth:`MoEWeights.pe_slice`): this PE's experts in
            the FP8 block layout and the global router.
        """
        sh = self.shape if routing is None else routing
        CFG.check_layer_routing(sh, self.shape)
        if not isinstance(weights, MoEWeights):
            raise ValueError(f"weights must be a MoEWeights, got {type(weights).__name__}")
        return weights.pe_slice(sh, self.me, self.R, self.dev)

    # -- the forward --------------------------------------------------------------------------------
    def adaptive_streaming(self, tokens: int) -> bool:
        """``streaming="auto"``: whether streaming wins for ``tokens`` rows per PE with this buffer's GEMM
        implementation, PE count, experts per PE, chunk count and dispatch order, from the tuned table's rows of
        that same GEMM implementation only (:mod:`streamring.moe.adaptive`, made by
        ``python -m bench.make_adaptive_table`` from the layer benchmark): its batch row, or its streamed row
        where that row's schedule is the buffer's (chunking and order, ``ep_config.schedule``). Batch where the
        table has no row of this implementation and setting, where its row is another schedule's, or where it
        measured no win (and for 0 rows): the batch path is the correctness fallback and what streaming must
        beat, and a measurement of one GEMM implementation says nothing of another's. :attr:`last_adaptive` keeps
        the answer; its ``source`` says what decided (``measured``, ``none``, ``other schedule``)."""
        from . import adaptive

        if tokens < 1:
            return False
        st = self.paths["stream"]
        window = self.tuning.ready_window_us if self.pipeline.groups_sources(st, int(tokens)) else None
        own = CFG.schedule(st.num_chunks, st.source_order, window, self.R)
        choice = adaptive.choose(int(tokens), gemm=self.gemm, ranks=self.R, experts_per_pe=self.E_loc,
                                 block_m=self.block_m, min_chunk_tokens=1)
        # a measured streamed win of another schedule says nothing of this buffer's own against batch
        if choice.path == "streamed" and CFG.schedule(choice.chunks, choice.source_order, choice.ready_window_us,
                                                      self.R) != own:
            choice = adaptive.AdaptiveChoice(int(tokens), "batch", self.block_m, int(tokens), source="other schedule",
                                             table_tokens=choice.table_tokens,
                                             note=f"the table's streamed row is another schedule "
                                                  f"({choice.chunks} chunks, {choice.source_order}): the batch path")
        self.last_adaptive = choice
        return choice.path == "streamed"

    def forward(self, x: torch.Tensor, weights: PESliceView, *, streaming: bool | str = False,
                stream_epoch: Optional[int] = None, num_tokens=None, out: Optional[torch.Tensor] = None,
                routing: Optional[tuple] = None, stamps: bool = True) -> torch.Tensor:
        """One layer on this PE's ``x [T, hidden]`` (collective: every PE calls it, each replay of a captured
        graph likewise); returns ``y [T, hidden]`` in ``x``'s dtype (``out`` when given).

        The arguments, checks and errors are the contract's (:mod:`streamring.moe.contract`); what this buffer
        adds: ``streaming="auto"`` streams where the tuned table measured a win for ``T``
        (:meth:`adaptive_streaming`, decided on the host, under a capture once for every replay);
        ``stream_epoch`` defaults to the device's own count (the only choice inside a captured graph);
        ``num_tokens`` and ``routing`` on the buffer's device, read on the host only outside a capture (under a
        capture a count outside ``[0, T]`` is clamped, a bad route dropped, both counted in :meth:`status`, and
        the buffer then refuses further work); ``stamps`` records the timeline stamps (a buffer with an
        instrument recording them). The producer quantizes bf16 rows: another float ``x`` is rounded to bf16
        first and ``y`` rounded back to ``x``'s dtype.

        The first forward of each path must run eagerly (it compiles and loads every kernel: a module
        load while a stream waits on the ring could deadlock); capture after it.
        """
        self._refuse_if_broken()
        x16, out16, num_tokens, routing = self._checked_inputs(x, weights, streaming, num_tokens, out, routing)
        if streaming == "auto":
            streaming = self.adaptive_streaming(x.shape[0])
            stream_epoch = stream_epoch if streaming else None
        path = self.paths["stream" if streaming else "batch"]
        capturing = self.capturing()
        if stream_epoch is not None:
            last = path.ring.epoch() - 1 if streaming and not capturing else 0  # (refused without a read)
            stream_epoch = check_stream_epoch(stream_epoch, streaming=streaming, capturing=capturing, last=last,
                                              max_epoch=MAX_EPOCH)
        if path.name not in self.warm_paths and capturing:
            raise RuntimeError(f"the {path.name} path of this EPBuffer has not run yet: run one forward "
                               f"(streaming={streaming}) eagerly before capturing it (it compiles the kernels)")
        # every argument checked: from here on something is enqueued (a pending launch is taken or cancelled)
        launched = self.launches.take(weights, x.shape[0], streaming, stream_epoch, capturing)
        if stream_epoch is not None:
            path.ring.set_epoch(stream_epoch)
        warm = path.name in self.warm_paths
        if launched is not None and launched.enqueued:
            stamps = launched.stamps
        self.pipeline.enqueue(path, weights, x16, out16, num_tokens, routing, serialized=not warm, stamps=stamps,
                              launched=launched is not None and launched.enqueued)
        if not warm:
            self._sync()
            self.warm_paths.add(path.name)
            self.check()
        if out16.dtype == x.dtype:
            return out16
        return out16.to(x.dtype) if out is None else out.copy_(out16)

    def _checked_inputs(self, x, weights, streaming, num_tokens, out, routing) -> tuple:
        """Every argument of :meth:`forward` checked before anything is enqueued (:mod:`streamring.moe.checks`: a bad
        one raises naming it and leaves the buffer usable; values are read on the host only outside a CUDA graph
        capture); returns ``(x in bf16, the bf16 output, num_tokens, routing made contiguous)`` (a count read on the
        host comes back as an int)."""
        if not isinstance(weights, PESliceView):
            raise ValueError(f"weights must come from EPBuffer.prepare_weights (a PESliceView), got "
                             f"{type(weights).__name__}")
        check_x(x, self.shape.hidden, device=self.dev, max_rows=self.max_tokens)
        T = x.shape[0]
        check_out(out, (T, self.shape.hidden), x.dtype, self.dev)
        read = host_read_allowed(self.dev)
        valid = check_num_tokens(num_tokens, T, device=self.dev, read=read)
        if routing is not None:  # the producer reads rows of K back to back (contiguous: no copy if so)
            routing = check_routing(routing, T, self.shape.topk, self.shape.num_experts, valid=valid,
                                    device=self.dev, read=read and valid is not None)
        if num_tokens is not None and valid is not None:
            num_tokens = valid  # read and checked on the host: the forward fills it in as an int
        check_streaming(streaming, auto=True)
        if x.dtype != torch.bfloat16:
            # the producer quantizes rows to FP8 with 1x128 scales from bf16; a wider x costs one rounding more
            return x.to(torch.bfloat16), torch.empty(T, self.shape.hidden, dtype=torch.bfloat16, device=self.dev), \
                num_tokens, routing
        return x, torch.empty_like(x) if out is None else out, num_tokens, routing

    def _refuse_if_broken(self) -> None:
        if self.broken:
            raise RuntimeError(f"this EPBuffer is unusable after a ring error ({self.broken}); close() it and build "
                               f"a new EPBuffer on every PE (collective)")

    def capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (values cannot be read on the host then)."""
        return self.pipeline.on_gpu and torch.cuda.is_current_stream_capturing()

    def _sync(self) -> None:
        if self.pipeline.on_gpu:
            torch.cuda.synchronize(self.dev)

    # -- a consumer launched ahead --------------------------------------------------------------------
    def launch_consumer(self, weights: PESliceView, rows: int, *, stamps: bool = True) -> None:
        """Enqueue the consumer side of this layer's next streamed forward now, ahead of its input (the RFC's
        question 4: a consumer launched before all chunks are ready).

        The dispatch, GEMM and puts streams start behind what the current stream holds at this call (the
        previous layer's forward: its blocks, rows and combine area are reused) and never wait on anything the
        caller enqueues after it: while this PE's own stream is still busy (attention) or waiting, its consumer
        already dispatches and computes the rows that other PEs publish. Past that start its waits are the
        ring's generations (acquire, with the deadline ``deadline_s``, naming the source and chunk when it
        expires) and its own stream order. Call it right after the previous layer's forward, before the work
        that produces this layer's ``x``; the next :meth:`forward` must then be this layer's
        (``weights``), ``streaming=True`` (or ``"auto"`` choosing it) with ``x`` of ``rows`` rows: it enqueues
        the producer, the owner's reduce and the join only. Collective like :meth:`forward` (every PE launches
        the same layers in the same order). Streamed output stays bitwise equal to batch.

        Any other call first cancels the launch (a forward of another layer, of another row count or on the batch
        path, :meth:`capture`, :meth:`close`, :meth:`cancel_launch`): this PE's producer publishes empty chunks
        so that no consumer waits past its deadline, with a warning naming both. Inside a CUDA graph capture the
        launch and its forward must be captured together (both inside, as a whole-model graph does).

        With the ``serialized`` policy (one stream), with the persistent consumer refused below, and before the
        streamed path's first (eager) forward, nothing is enqueued here and the forward runs whole.

        Eagerly, every kernel the caller launches between this call and the forward must have run once before
        (run the model once without launching ahead): under CUDA's lazy module loading (the default) a kernel's
        first launch can wait for the kernels already running, this consumer's waits among them, which wait in
        turn for a producer the host has not enqueued yet; the wait's deadline then ends the forward with an
        acquire timeout. ``CUDA_MODULE_LOADING=EAGER`` removes the hazard; a captured graph has none (its
        kernels are loaded when it is captured).

        Args:
            weights: the layer's weights (:meth:`prepare_weights`), as the next forward passes them.
            rows: ``x.shape[0]`` of the next forward (the grids' expectations depend on it).
            stamps: record the timeline stamps (a buffer with an instrument recording them).
        Raises:
            ValueError: naming the argument (nothing is enqueued, a pending launch stays); with
                ``tuning.consumer='persistent'`` (its kernel would hold the SMs the caller's own work needs).
        """
        self._refuse_if_broken()
        if not isinstance(weights, PESliceView):
            raise ValueError(f"weights must come from EPBuffer.prepare_weights (a PESliceView), got "
                             f"{type(weights).__name__}")
        if isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= self.max_tokens:
            raise ValueError(f"rows must be an int in [0, max_tokens_per_rank={self.max_tokens}] (x.shape[0] of the "
                             f"next forward), got {rows!r}")
        if self.tuning.consumer == "persistent":
            raise ValueError("launch_consumer needs tuning.consumer 'per_chunk': the persistent consumer's kernel "
                             "would hold the SMs the caller's own work needs while it waits")
        self.launches.launch(weights, rows, stamps, self.capturing())

    def cancel_launch(self) -> bool:
        """Cancel a consumer side enqueued ahead by :meth:`launch_consumer` (this PE's producer publishes empty
        chunks and the forward's end is enqueued: its consumers, here and on every PE, finish with no rows of this
        PE's). Collective in effect: every PE must cancel or run the launched forward. True if one was pending."""
        return self.launches.cancel(None)

    # -- graphs -------------------------------------------------------------------------------------
    def capture(self, x: torch.Tensor, weights: PESliceView, out: torch.Tensor, *, streaming: bool = False,
                num_tokens=None, routing: Optional[tuple] = None, node_priority: bool = True, stamps: bool = True,
                launch_ahead: bool = False, before: Optional[Callable[[], None]] = None):
        """Capture one :meth:`forward` into a CUDA graph and return it (run one eager forward of the
        same path first). With ``node_priority`` (and high-priority producer/dispatch streams) every
        kernel node but the expert GEMMs gets the high launch priority explicitly (a captured node
        does not keep its stream's priority, :meth:`prioritize`); :attr:`node_priority_report` says what was
        changed. A consumer launched ahead eagerly (:meth:`launch_consumer`) is cancelled first.

        ``before``: the caller's own work for this layer (what produces ``x``: attention), called on the
        capture stream before the forward and captured with it. ``launch_ahead`` (``streaming=True``): the
        consumer side is launched (:meth:`launch_consumer`) at the graph's start, before ``before``'s work, so
        in every replay it runs beside that work instead of after it."""
        self.launches.cancel("capture()")
        if launch_ahead and not streaming:
            raise ValueError("launch_ahead=True needs streaming=True (the batch path has no consumer to launch ahead)")
        want = node_priority and streaming and self.pipeline.progress.high_priority
        g = torch.cuda.CUDAGraph(keep_graph=want)
        side = torch.cuda.Stream(device=self.dev)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(g, stream=side, capture_error_mode="thread_local"):
            if launch_ahead:
                self.launch_consumer(weights, x.shape[0], stamps=stamps)
            if before is not None:
                before()
            self.forward(x, weights, streaming=streaming, num_tokens=num_tokens, out=out, routing=routing,
                         stamps=stamps)
        self._graph_paths[id(g)] = self.paths["stream" if streaming else "batch"]
        self.node_priority_report = "not asked" if not want else self.prioritize(g)
        if want:
            g.instantiate()
        torch.cuda.current_stream().wait_stream(side)
        return g

    def prioritize(self, graph) -> str:
        """Give every kernel node of ``graph`` (a ``torch.cuda.CUDAGraph(keep_graph=True)`` captured with this
        buffer's streamed forwards in it, not yet instantiated) but this buffer's expert GEMMs the high launch
        priority of its producer and dispatch streams: a captured node does not keep its stream's priority, and
        without it the next source's dispatch, a late PE's producer and the result puts wait behind the GEMMs'
        pending CTAs. The result puts stay at the default where their stream does (``EPTuning.high_priority_puts``).
        The caller's own kernels in the graph (attention, ...) get the high priority too, so a consumer launched
        ahead (:meth:`launch_consumer`) computes in the SMs they leave. Returns a one-line report."""
        p = self.pipeline.progress.stream("p")
        if p is None:
            return "no priorities: the serialized policy runs one stream"
        ex = self.pipeline.experts
        low_names = CAPABILITIES[self.gemm].kernel_names
        if not self.tuning.puts_at_high_priority(persistent_grid=CAPABILITIES[self.gemm].persistent_grid):
            low_names = (*low_names, DK.ep_put_rows.__name__)  # their stream's priority (EPTuning.high_priority_puts)
        return prioritize_nodes(graph, {int(k.function) for k in ex.bc.gemm_kernels}, p.priority, low_names)

    def replay(self, graph, *, host_deadline_s: Optional[float] = None) -> dict:
        """Replay ``graph`` (from :meth:`capture`) on the current stream, wait for it, return :meth:`status`;
        raise if the device recorded an error or the forward did not end.

        A peer that died or stopped mid-forward makes a device wait of this PE time out after
        ``deadline_s``; every later wait then gives up at once, so the forward ends and this raises a
        :class:`~streamring.ring.protocol.WatchdogError` whose first line names the source rank, chunk and
        generation waited for. ``host_deadline_s`` (default ``2 * deadline_s + 5``) bounds what has no
        device deadline (a ``cuStreamWaitValue64`` of the stream_wait policy). Violations and corrupt
        routes raise a :class:`~streamring.ring.protocol.ProtocolViolation`. Either way the buffer is
        :attr:`broken` afterwards (close it and build a new one on every PE). When the device context itself
        fails during the forward (a peer's process died and this PE touched its unmapped memory: seen with
        PEs sharing a GPU under MPS), the WatchdogError names what the last slow device wait waited for,
        read from pinned host memory (the wait beacon); this process cannot use the GPU again.
        """
        self._refuse_if_broken()
        path = self._graph_paths.get(id(graph))
        if path is None:
            raise ValueError("graph was not captured by this EPBuffer's capture()")
        limit = 2 * self.deadline_s + 5 if host_deadline_s is None else float(host_deadline_s)
        t0 = time.monotonic()
        path.ring.clear_wait_beacon()  # only this path's ring is read after a fault
        graph.replay()
        done = torch.cuda.Event()
        done.record()
        try:
            finished, st = path.ring.wait_forward(done, limit)
        except WatchdogError as exc:  # the device context failed (a dead peer's memory, under MPS)
            self.broken = self.broken or str(exc).splitlines()[0]
            raise
        if finished:
            # the dispatch's dropped-route count and the clamped device counts, readable once the forward ended
            st.update(self._counters())
        if not finished or st["violations"] or st["timeouts"] or st.get("bad_routes") or st.get("bad_counts"):
            self.broken = self.broken or f"{st.get('first_error') or st}"
        path.ring.check(st, finished=finished, host_deadline_s=limit, elapsed_s=time.monotonic() - t0)
        if st.get("gemm_status"):
            # e.g. DeepGEMM's psum layout refused on the device: nothing was computed, y holds stale rows
            self.broken = self.broken or self._gemm_status_line(st["gemm_status"])
            raise RuntimeError(f"{self.broken}; the buffer now refuses to run: rebuild it")
        if st.get("bad_counts"):
            raise ValueError(f"rank {self.me}: num_tokens was outside [0, rows of x] in {st['bad_counts']} forward(s) "
                             f"(clamped; the buffer now refuses to run: rebuild it)")
        return st

    # -- status -------------------------------------------------------------------------------------
    def _counters(self) -> dict:
        """The dispatch's dropped routes, the clamped device counts and the GEMMs' status bits (synchronises)."""
        pl = self.pipeline
        return {"bad_routes": int(pl.dispatch.bad_routes.item()), "bad_counts": int(pl.producer.bad_counts.item()),
                "gemm_status": pl.experts.status()}

    def status(self) -> dict:
        """Device status of both rings (violations, timeouts, published, consumed, first error per
        path), corrupt routes dropped by the dispatch (``bad_routes``) and device token counts outside
        ``[0, T]`` that were clamped (``bad_counts``). Synchronises. Any error makes the buffer refuse
        further forwards (:attr:`broken`): ``close()`` it and build a new one on every PE."""
        out = self._counters()
        for name, p in self.paths.items():
            st = p.ring.status()
            for k in ("violations", "timeouts"):
                out[k] = out.get(k, 0) + st[k]
            out[name] = st
        first = next((n for n in self.paths if out[n]["first_error"]), None)
        out["first_error"] = out[first]["first_error"] if first else None
        if out["violations"] or out["timeouts"] or out["bad_routes"] or out["bad_counts"]:
            line = describe_status({**out[first], "bad_routes": out["bad_routes"]}, pe=self.me,
                                   num_slots=self.paths[first].num_slots, deadline_s=self.deadline_s) if first else ""
            self.broken = self.broken or line or (f"violations={out['violations']} timeouts={out['timeouts']} "
                                                  f"bad_routes={out['bad_routes']} bad_counts={out['bad_counts']}")
        if out["gemm_status"]:
            self.broken = self.broken or self._gemm_status_line(out["gemm_status"])
        return out

    def _gemm_status_line(self, bits: int) -> str:
        return f"rank {self.me}: the expert GEMMs met a bad ready range (status {bits:#x}: {gemm_status_text(bits)})"

    def check(self) -> None:
        """Raise if a ring or the dispatch recorded an error (the buffer is then :attr:`broken`: close it
        and build a new one on every PE). Synchronises."""
        st = self.status()
        if self.broken:
            raise RuntimeError(f"ring errors on PE {self.me}: {self.broken} (violations={st['violations']} "
                               f"timeouts={st['timeouts']} bad_routes={st['bad_routes']} "
                               f"bad_counts={st['bad_counts']}); close() it and build a new EPBuffer on every PE")

    @property
    def last_routing(self) -> tuple:
        """``(topk_idx int64 [T, topk], topk_weights float32 [T, topk])`` of this PE's tokens in the last
        forward (-1: no expert, e.g. a row past ``num_tokens``). Views, valid until the next forward."""
        plan, pr = self.pipeline.plan, self.pipeline.producer
        T = plan.rows if plan is not None else 0
        return pr.my_idx[:T], pr.my_w[:T]

    def memory_report(self) -> dict:
        """Bytes this buffer holds: symmetric (rings, combine area) and local (scratch)."""
        st = self.paths["stream"]
        return memory_report(self.shape, self.R, max_tokens_per_rank=self.max_tokens, num_slots=st.num_slots,
                             tokens_per_slot=st.chunk, block_m=self.block_m, gemm=self.gemm)

    def close(self) -> None:
        """Free the rings and the combine area (collective; a consumer launched ahead is cancelled first) and
        destroy the streams."""
        if self.launches.pending is not None and not self.broken:
            self.launches.cancel("close()")
            self._sync()
        self.pipeline.combine.close()
        for p in self.paths.values():
            p.close()
        self.pipeline.progress.close()
