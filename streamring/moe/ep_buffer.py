"""The expert-parallel FP8 MoE layer on GPUs, as an engine holds it: one buffer, many layers.

:class:`EPBuffer` is created once per process group (one PE per GPU, any number; several PEs on
one GPU under MPS). It owns every symmetric allocation (the batch ring, the streamed ring, the
owners' combine area), the block consumer's scratch, the producer's scratch and the streams, and
is shared by every MoE layer of a model. A layer's weights are prepared once
(:meth:`EPBuffer.prepare_weights`: bf16 weights are quantized to FP8 with 128x128 scales, FP8 checkpoint
tensors are taken as they are) and :meth:`EPBuffer.forward` runs one layer on this PE's tokens,
collectively on every PE::

    buf = EPBuffer(heap, shape, num_slots=2, tokens_per_slot=4096, max_tokens_per_rank=8192)
    w = buf.prepare_weights(weights)                    # once per layer (MoEWeights or FastWeights)
    y = buf.forward(x, w)                       # batch-ready path (default)
    y = buf.forward(x, w, streaming=True)       # streamed through the ring
    y = buf.forward(x_max, w, num_tokens=n)     # n: a device int64: the valid rows of x_max

Everything a forward enqueues is capture-safe (no host synchronisation, no shape-dependent host
work but the static ``x.shape[0]``), so the caller may capture it inside its own CUDA graph and
replay that graph with a different ``num_tokens`` each time: every chunk's valid count is derived
on the device, the producer publishes it in the slot's metadata, consumers learn it from there.
The device epoch of each ring advances at the end of every forward, so generations stay exact
across replays (RFC: ABA across CUDA-graph replay).

How a forward runs (the streams, the ring handoffs and the ordering argument for each memory-ordering
choice) is :mod:`streamring.moe.ep_pipeline`, beside the code that does it.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from ..device.ringdesc import describe_status
from ..gemm import choice as GC
from ..gemm.backends import CAPABILITIES
from ..gemm.cutlass import status_text as gemm_status_text
from ..ring.layout import CombineLayout, RingLayout
from ..ring.protocol import WatchdogError
from .blocks import FP8, BlockConsumer, FastWeights
from .ep_pipeline import EPPipeline, _Path
from .math import MoEShape, MoEWeights, quantize_weight_fp8_block
from .timeline_events import CHUNK_EVENTS, STAMP_STRIDE, TAIL_EVENTS
from .tuning import BLOCK_MS, EPTuning


def cutlass_unavailable_reason() -> Optional[str]:
    """Why the CUTLASS GEMM library is not taken here (``None`` when it loads). Never builds anything:
    the library is built ahead with ``python -m streamring.gemm.build --out .gemm-build``."""
    why = GC.available_impls(128)["cutlass"]
    return why or None


def resolve_gemm(gemm: str, shape: MoEShape, num_ranks: int, max_tokens_per_rank: int,
                 block_m: int) -> "GC.LayerChoice":
    """The expert GEMMs ``gemm`` stands for in a buffer of these sizes (``"auto"``: the fastest available
    implementation of the measured table, ``streamring/gemm/choice.py``, at the buffer's rows per
    expert; an explicit one: its own fastest variants). Every path of one buffer runs the result, so a
    streamed-vs-batch comparison never measures two GEMMs' rounding."""
    if gemm != "auto" and gemm not in CAPABILITIES:
        raise ValueError(f"gemm must be one of {('auto',) + tuple(CAPABILITIES)}, got {gemm!r}")
    return GC.resolve_layer(gemm, block_m, shape, [max_tokens_per_rank] * num_ranks)


@dataclass(frozen=True)
class _Launched:
    """A streamed forward's consumer side enqueued ahead of its producer (:meth:`EPBuffer.launch_consumer`)."""

    layer: "LayerWeights"
    rows: int
    stamps: bool
    enqueued: bool  # False: nothing was enqueued (serialized policy, or the streamed path's first forward)
    capturing: bool  # enqueued inside a CUDA graph capture


@dataclass
class LayerWeights:
    """One MoE layer's weights, prepared for an :class:`EPBuffer` (:meth:`EPBuffer.prepare_weights`).

    Attributes:
        routing: the layer's :class:`MoEShape` (router kind, groups, scaling; sizes equal the buffer's).
        fw: this PE's experts (``w1 [E/R, 2I, H]``, ``w2 [E/R, H, I]``, FP8 with 128x128 scales)
            and the global router (bf16 ``[E, H]``) and bias.
    """

    routing: MoEShape
    fw: FastWeights




class EPBuffer(EPPipeline):
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
            works) or ``"auto"`` (:func:`resolve_gemm`: the fastest available one of the measured table);
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
                 tokens_per_slot: Optional[int] = None, gemm: str = "auto", deadline_s: float = 10.0,
                 tuning: Optional[EPTuning] = None, name: str = "ep"):
        R, me = heap.num_ranks, heap.rank
        if tuning is None:
            tuning = EPTuning()
        elif not isinstance(tuning, EPTuning):
            raise ValueError(f"tuning must be an EPTuning, got {type(tuning).__name__}")
        #: the scheduling switches this buffer runs (frozen)
        self.tuning = tu = tuning
        sizes = _check_sizes(shape, R, max_tokens_per_rank, num_slots, tokens_per_slot, tu.block_m)
        self.max_tokens, C, S, self.block_m = sizes
        policy, source_order, transport, consumer = tu.policy, tu.source_order, tu.transport, tu.consumer
        _check_tuning(tu, R, -(-self.max_tokens // C), S)
        #: the expert GEMMs of every path (implementation and variants; :attr:`gemm` names the implementation)
        self.gemm_choice = resolve_gemm(gemm, shape, R, self.max_tokens, self.block_m)
        self.gemm = self.gemm_choice.impl
        cap = CAPABILITIES[self.gemm]
        if consumer == "persistent" and (not cap.persistent or transport == "nv" or policy == "green_ctx"):
            raise ValueError(f"tuning.consumer 'persistent' runs the Triton GEMMs storing straight into the owners over "
                             f"P2P: it needs gemm 'triton' (got {self.gemm!r}), transport 'auto' or 'p2p' (got "
                             f"{transport!r}) and a policy other than 'green_ctx' (got {policy!r})")
        self.consumer, self.reserved_sms = consumer, tu.reserved_sms
        if tu.chunk_gemm_ctas is not None and not cap.max_ctas:
            raise ValueError(f"tuning.chunk_gemm_ctas must be None with gemm {self.gemm!r} (it sizes its own grid)")
        self.heap, self.shape = heap, shape
        self.R, self.me = R, me
        self.E_loc = shape.num_experts // R
        #: the experts this PE holds (rank r holds ``[r * E/R, (r+1) * E/R)``)
        self.local_experts = range(me * self.E_loc, (me + 1) * self.E_loc)
        self.policy, self.source_order = policy, source_order
        self.chunk_gemm_ctas = tu.chunk_gemm_ctas
        self.ready_window_ns = int(round(tu.ready_window_us * 1000))
        self.priority_streams = tu.priority_streams
        self.inject = "none"  # a deliberate protocol mutation: streamring.moe.debug.inject (tests only)
        self._inject_bits = 0
        self.deadline_s = deadline_s
        self.dev = dev = heap.device
        self._on_gpu = torch.device(dev).type == "cuda"
        #: the SMs this process's kernels may use (an MPS client's share under MPS)
        self.sm_count = torch.cuda.get_device_properties(dev).multi_processor_count if self._on_gpu else 1
        if not self._on_gpu and policy != "serialized":
            raise ValueError(f"policy {policy!r} needs a GPU (streams); off the GPU only 'serialized' runs")
        self.broken: Optional[str] = None
        #: the tuned table's answer for the last streaming="auto" forward (:meth:`adaptive_streaming`)
        self.last_adaptive = None
        self._launched: Optional[_Launched] = None  # a consumer side enqueued ahead (launch_consumer)
        self._warm: set = set()
        self._graph_paths: dict = {}  # id(graph) -> the path it was captured on (replay() checks that ring)
        self._regions: list = []
        wake = policy == "stream_wait"
        ring_transport = "p2p" if policy == "green_ctx" else transport
        # -- the two rings (symmetric) --------------------------------------------------------------
        self.paths = {
            "batch": self._make_path("batch", self.max_tokens, 1, "serialized", "rank", ring_transport, False,
                                     f"{name}-batch-ring"),
            "stream": self._make_path("stream", C, S, policy, source_order, ring_transport, wake,
                                      f"{name}-stream-ring"),
        }
        self.transport = self.paths["stream"].ring.transport
        if consumer == "persistent" and self.transport != "p2p":
            raise ValueError("consumer 'persistent' needs every peer load/store reachable (P2P); this job's transport "
                             "is 'nv' (another node?): use consumer 'per_chunk'")
        max_chunks = max(p.num_chunks for p in self.paths.values())
        # every token a forward can name, on either path (a chunk's valid count is at most its size)
        self.token_capacity = max(p.num_chunks * p.chunk for p in self.paths.values())
        self._make_combine_area(name, max_chunks)
        self._make_forward_state(max_chunks)
        self._make_consumer(shape, consumer)
        # -- streams ----------------------------------------------------------------------------------
        self._make_streams(policy, tu.producer_sms)
        for p in self.paths.values():
            p.ring.set_epoch(1)
        heap.barrier()

    def _make_combine_area(self, name: str, max_chunks: int) -> None:
        """The owners' combine area (symmetric; shared by both paths and every layer)."""
        H, Kk = self.shape.hidden, self.shape.topk
        self.comb_layout = CombineLayout(max_tokens=self.token_capacity, topk=Kk, hidden=H, max_chunks=max_chunks)
        CL = self.comb_layout
        self.comb_region = self.heap.alloc(f"{name}-combine", CL.nbytes)
        self.comb_base = self.comb_region.handle.ptr
        loc = self.comb_region.local
        self.arrived = loc[CL.off_arrived: CL.off_arrived + 8 * max_chunks].view(torch.int64)
        self.comb_rows = loc[CL.off_rows: CL.off_rows + CL.rows_bytes].view(torch.bfloat16).view(-1, H)
        self.comb_peers = 0
        if self.transport == "p2p":
            self._comb_peers_t = self.heap.peer_table(self.comb_region)
            self.comb_peers = int(self._comb_peers_t.data_ptr())
            self.comb_delta = ((self._comb_peers_t - self.comb_base) // 2).contiguous()  # bf16 elements

    def _make_forward_state(self, max_chunks: int) -> None:
        """The per-forward device state (counts, my routing, the dispatch's scratch, status words)."""
        R, dev, Kk = self.R, self.dev, self.shape.topk
        self.num_tokens_t = torch.zeros(1, dtype=torch.int64, device=dev)
        self.my_idx = torch.full((self.token_capacity, Kk), -1, dtype=torch.int64, device=dev)
        self.my_w = torch.zeros(self.token_capacity, Kk, dtype=torch.float32, device=dev)
        self._last_T = 0
        # the last enqueued forward's GEMM calls (EPPipeline._gemms)
        self.gemm_calls: list[tuple[int, int, int, int | None]] = []
        self.expected = torch.zeros(max_chunks, dtype=torch.int64, device=dev)
        self.logits = torch.zeros(max(p.chunk for p in self.paths.values()), self.shape.num_experts,
                                  dtype=torch.float32, device=dev)
        self.entries = max(R * p.chunk * Kk for p in self.paths.values())
        self.flat_e = torch.zeros(self.entries, dtype=torch.int32, device=dev)
        self.flat_w = torch.zeros(self.entries, dtype=torch.float32, device=dev)
        self.pending = torch.zeros(1, dtype=torch.int64, device=dev)  # ready order: sources not yet taken
        # one source per step (arrival order; the persistent consumer's ready order): the source of step j
        self.chosen = torch.zeros(R, dtype=torch.int32, device=dev)
        # ready order (grouped): row j = the sources step j took, -1 padded (ring_wait_any writes it)
        self.taken = torch.full((R, R), -1, dtype=torch.int32, device=dev)
        # arrival order, chunks after the first: the one source a step waits for, and where its wait writes it
        self.one_bit = torch.ones(1, dtype=torch.int64, device=dev)
        self.pending_one = torch.zeros(1, dtype=torch.int64, device=dev)
        self.chosen_again = torch.zeros(1, dtype=torch.int32, device=dev)
        self.src_all = torch.arange(R, dtype=torch.int32, device=dev)
        self.bad_routes = torch.zeros(1, dtype=torch.int32, device=dev)
        # bytes the dispatch reads from peers' slots (last forward): [0] one row per route, [1] one per token
        self.pull_bytes = torch.zeros(2, dtype=torch.int64, device=dev)
        self.bad_counts = torch.zeros(1, dtype=torch.int32, device=dev)  # num_tokens outside [0, T], clamped
        self.straggler_t = torch.zeros(1, dtype=torch.int64, device=dev)
        self._max_chunks = max_chunks
        self.stamps = None  # per-chunk %globaltimer stamps: streamring.moe.debug.record_timeline
        self._stamp_path: Optional[_Path] = None
        self._recording = True
        self._grouped = False  # this forward groups ready sources (EPPipeline.groups_sources)

    def _make_consumer(self, shape: MoEShape, consumer: str) -> None:
        """The block consumer (local scratch, shared by every layer) and, for the persistent consumer, its
        work queue. L2 stores straight into the owners over P2P with GEMMs that can (the Triton ones:
        ``gemm.backends.Capabilities.owner_rows``); else a local y and puts."""
        R, dev = self.R, self.dev
        self.direct_l2 = self.transport == "p2p" and CAPABILITIES[self.gemm].owner_rows
        local_shape = MoEShape(**{**shape.__dict__, "num_experts": self.E_loc, "n_group": 1, "topk_group": 1,
                                  "router": "softmax_topk", "block_m": self.block_m})
        max_steps = max(p.num_chunks * p.steps for p in self.paths.values())
        self.bc = BlockConsumer(local_shape, R * self.token_capacity, max_steps, self.block_m, dev,
                                ep_entries=self.entries, local_y=not self.direct_l2)
        # y stays a staging buffer of whole rows: the result puts of a range may still read it while later
        # ranges compute, so no implementation may overwrite rows outside its range (staging_y=False)
        GC.setup_consumer(self.bc, self.gemm_choice, staging_y=False)
        self.queue = None
        if consumer == "persistent":
            from .work_queue import WorkQueue

            self.queue = WorkQueue(self.bc)
            self.comb_arrived_delta = ((self._comb_peers_t - self.comb_base) // 8).contiguous()  # int64 words

    # -- layers -----------------------------------------------------------------------------------
    def prepare_weights(self, weights, routing: Optional[MoEShape] = None) -> LayerWeights:
        """One layer's weights for this buffer (call once per layer; keep the result).

        Args:
            weights: a :class:`~streamring.moe.math.MoEWeights` (bf16 weights are quantized to FP8
                with 128x128 block scales here; FP8 weights with their scales, e.g. a checkpoint's
                ``weight_scale_inv``, are taken as they are; all experts or only this PE's) or a
                :class:`~streamring.moe.blocks.FastWeights` (all experts or this PE's).
            routing: the layer's router (kind, groups, scaling); default the buffer's ``shape``.
                Its sizes must equal the buffer's.

        Returns:
            :class:`LayerWeights` holding this PE's experts and the global router.
        """
        sh = self.shape if routing is None else routing
        for f in ("hidden", "intermediate", "num_experts", "topk"):
            if getattr(sh, f) != getattr(self.shape, f):
                raise ValueError(f"routing.{f}={getattr(sh, f)} differs from the buffer's shape.{f}="
                                 f"{getattr(self.shape, f)}: a buffer serves layers of one size")
        if isinstance(weights, MoEWeights):
            weights = _fp8_weights(weights, sh, self.dev)
            fw = FastWeights.from_moe_weights(weights)
        elif isinstance(weights, FastWeights):
            fw = weights
        else:
            raise ValueError(f"weights must be a MoEWeights or a FastWeights, got {type(weights).__name__}")
        E, E_loc, H, I = sh.num_experts, self.E_loc, sh.hidden, sh.intermediate
        if fw.w1.shape[0] == E and E_loc != E:
            fw = fw.local(self.me, self.R)
        want = {"w1": (E_loc, 2 * I, H), "w1_sf": (E_loc, 2 * I // 128, H // 128), "w2": (E_loc, H, I),
                "w2_sf": (E_loc, H // 128, I // 128), "router": (E, H)}
        for f, shp in want.items():
            t = getattr(fw, f)
            if tuple(t.shape) != shp:
                raise ValueError(f"weights.{f} must have shape {list(shp)} (all {E} experts or this PE's {E_loc}), "
                                 f"got {list(t.shape)}")
            if t.device != self.dev:
                raise ValueError(f"weights.{f} is on {t.device}, the buffer on {self.dev}")
        if fw.w1.dtype != FP8 or fw.w2.dtype != FP8:
            raise ValueError(f"weights.w1/w2 must be float8_e4m3fn here, got {fw.w1.dtype}/{fw.w2.dtype}")
        if sh.router == "deepseek_v3" and fw.bias is None:
            raise ValueError("routing.router 'deepseek_v3' needs weights.correction_bias [num_experts]")
        return LayerWeights(routing=sh, fw=fw)

    # -- the forward --------------------------------------------------------------------------------
    def adaptive_streaming(self, tokens: int) -> bool:
        """``streaming="auto"``: whether streaming wins for ``tokens`` rows per PE with this buffer's GEMM
        implementation, PE count, experts per PE, chunk count and dispatch order, from the tuned table's rows of
        that same GEMM implementation only (:mod:`streamring.moe.adaptive`, made by
        ``python -m bench.make_adaptive_table`` from the layer benchmark): its batch row, or its streamed row
        where that row's schedule is the buffer's (chunking and order, ``_schedule``). Batch where the table has
        no row of this implementation and setting, where its row is another schedule's, or where it measured
        no win (and for 0 rows): the batch path is the correctness fallback and what streaming must beat, and a
        measurement of one GEMM implementation says nothing of another's. :attr:`last_adaptive` keeps the
        answer; its ``source`` says what decided (``measured``, ``none``, ``other schedule``)."""
        from . import adaptive

        if tokens < 1:
            return False
        st = self.paths["stream"]
        window = self.tuning.ready_window_us if self.groups_sources(st, int(tokens)) else None
        own = _schedule(st.num_chunks, st.source_order, window, self.R)
        choice = adaptive.choose(int(tokens), gemm=self.gemm, ranks=self.R, experts_per_pe=self.E_loc,
                                 min_chunk_tokens=1)
        # a measured streamed win of another schedule says nothing of this buffer's own against batch
        if choice.path == "streamed" and _schedule(choice.chunks, choice.source_order, choice.ready_window_us,
                                                   self.R) != own:
            choice = adaptive.AdaptiveChoice(int(tokens), "batch", self.block_m, int(tokens), source="other schedule",
                                             table_tokens=choice.table_tokens,
                                             note=f"the table's streamed row is another schedule "
                                                  f"({choice.chunks} chunks, {choice.source_order}): the batch path")
        self.last_adaptive = choice
        return choice.path == "streamed"

    def forward(self, x: torch.Tensor, weights: LayerWeights, *, streaming: bool | str = False,
                stream_epoch: Optional[int] = None, num_tokens=None, out: Optional[torch.Tensor] = None,
                routing: Optional[tuple] = None, stamps: bool = True) -> torch.Tensor:
        """One layer on this PE's tokens (collective: every PE calls it, each replay of a captured
        graph likewise).

        Args:
            x: ``[T, hidden]``, ``T <= max_tokens_per_rank``, bf16 (another float dtype is rounded to
                bf16 first; a PE without tokens passes ``[0, hidden]`` or ``num_tokens=0``).
            weights: the layer, from :meth:`prepare_weights`.
            streaming: ``False`` = batch-ready path (the default and the correctness fallback);
                ``True`` = chunks through the streamed ring. Both give bitwise equal outputs. ``"auto"``:
                streamed where the tuned table measured a win for ``T`` (:meth:`adaptive_streaming`),
                decided on the host from ``T`` (under a capture: once, for every replay).
            stream_epoch: the streamed ring's epoch of this call (must grow from call to call); default:
                the device's own count (the only choice inside a captured graph, which replays it).
            num_tokens: the valid rows of ``x`` (``None``: all ``T``): an int, or a one-element integer
                CUDA tensor read when the forward runs (replays of one captured graph may vary it).
                Rows at and past it are ignored and their output rows are zero. A device value outside
                ``[0, T]`` is clamped into it and counted in :meth:`status` (``bad_counts``).
            out: bf16 ``[T, hidden]`` to write into (default: a new tensor).
            routing: ``(topk_idx, topk_weights)`` computed by the caller (int64 and float32 ``[T, topk]``
                on the buffer's device, experts in ``[0, num_experts)`` or -1 for none) instead of the
                layer's router: the producer publishes them as they are.
            stamps: record the timeline stamps (a buffer made with ``timeline=True``).

        Returns:
            ``out``: bf16 ``[T, hidden]``, the sum over each token's routed experts.

        The first forward of each path must run eagerly (it compiles and loads every kernel: a module
        load while a stream waits on the ring could deadlock); capture after it.
        """
        if self.broken:
            raise RuntimeError(f"this EPBuffer is unusable after a ring error ({self.broken}); close() it and build "
                               f"a new EPBuffer on every PE (collective)")
        if not isinstance(weights, LayerWeights):
            raise ValueError(f"weights must come from EPBuffer.prepare_weights (a LayerWeights), got "
                             f"{type(weights).__name__}")
        H = self.shape.hidden
        if not x.is_floating_point() or x.ndim != 2 or x.shape[1] != H or x.device != self.dev:
            raise ValueError(f"x must be a bfloat16 (or other float) [tokens, hidden={H}] tensor on {self.dev}, got "
                             f"{x.dtype} {list(x.shape)} on {x.device}")
        if x.dtype != torch.bfloat16:
            # the producer quantizes rows to FP8 with 1x128 scales from bf16; a wider x costs one rounding more
            x = x.to(torch.bfloat16)
        T = x.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"x has {T} tokens, more than max_tokens_per_rank={self.max_tokens}")
        if out is None:
            out = torch.empty_like(x)
        elif out.dtype != torch.bfloat16 or tuple(out.shape) != tuple(x.shape) or out.device != self.dev:
            raise ValueError(f"out must be bfloat16 {list(x.shape)} on {self.dev}, got {out.dtype} {list(out.shape)}")
        if routing is not None:
            idx, w = routing
            Kk = self.shape.topk
            if idx.dtype != torch.int64 or tuple(idx.shape) != (T, Kk) or idx.device != self.dev:
                raise ValueError(f"routing[0] (topk_idx) must be int64 [{T}, {Kk}] on {self.dev}, got {idx.dtype} "
                                 f"{list(idx.shape)} on {idx.device}")
            if w.dtype != torch.float32 or tuple(w.shape) != (T, Kk) or w.device != self.dev:
                raise ValueError(f"routing[1] (topk_weights) must be float32 [{T}, {Kk}] on {self.dev}, got {w.dtype} "
                                 f"{list(w.shape)} on {w.device}")
            routing = (idx.contiguous(), w.contiguous())  # the producer reads rows of K back to back (no copy if so)
        if isinstance(num_tokens, int) and not 0 <= num_tokens <= T:
            raise ValueError(f"num_tokens must be in [0, {T}] (rows of x), got {num_tokens}")
        if streaming == "auto":
            streaming = self.adaptive_streaming(T)
            stream_epoch = stream_epoch if streaming else None
        elif not isinstance(streaming, bool):
            raise ValueError(f"streaming must be True, False or 'auto', got {streaming!r}")
        path = self.paths["stream" if streaming else "batch"]
        capturing = self._on_gpu and torch.cuda.is_current_stream_capturing()
        launched = self._take_launched(weights, T, streaming, stream_epoch, capturing)
        if stream_epoch is not None:
            if not streaming:
                raise ValueError("stream_epoch is for streaming=True (the batch ring counts its own epochs)")
            if capturing:
                raise ValueError("stream_epoch cannot be given while capturing a CUDA graph: every replay would "
                                 "reuse it (ABA); the device epoch advances by itself")
            now = path.ring.epoch()
            if int(stream_epoch) < now:
                raise ValueError(f"stream_epoch must grow from call to call: the last was {now - 1}, "
                                 f"got {stream_epoch}")
            path.ring.set_epoch(int(stream_epoch))
        if path.name not in self._warm:
            if capturing:
                raise RuntimeError(f"the {path.name} path of this EPBuffer has not run yet: run one forward "
                                   f"(streaming={streaming}) eagerly before capturing it (it compiles the kernels)")
            self._enqueue(path, weights, x, out, num_tokens, routing, "serialized", stamps)
            self._sync()
            self._warm.add(path.name)
            self.check()
            return out
        if launched is not None and launched.enqueued:
            self._enqueue(path, weights, x, out, num_tokens, routing, None, launched.stamps, launched=True)
        else:
            self._enqueue(path, weights, x, out, num_tokens, routing, None, stamps)
        return out

    def launch_consumer(self, weights: LayerWeights, rows: int, *, stamps: bool = True) -> None:
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

        Args:
            weights: the layer's weights (:meth:`prepare_weights`), as the next forward passes them.
            rows: ``x.shape[0]`` of the next forward (the grids' expectations depend on it).
            stamps: record the timeline stamps (a buffer with ``record_timeline``).
        Raises:
            ValueError: naming the argument (nothing is enqueued, a pending launch stays); with
                ``tuning.consumer='persistent'`` (its kernel would hold the SMs the caller's own work needs).
        """
        if self.broken:
            raise RuntimeError(f"this EPBuffer is unusable after a ring error ({self.broken}); close() it and build "
                               f"a new EPBuffer on every PE (collective)")
        if not isinstance(weights, LayerWeights):
            raise ValueError(f"weights must come from EPBuffer.prepare_weights (a LayerWeights), got "
                             f"{type(weights).__name__}")
        if isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= self.max_tokens:
            raise ValueError(f"rows must be an int in [0, max_tokens_per_rank={self.max_tokens}] (x.shape[0] of the "
                             f"next forward), got {rows!r}")
        if self.consumer == "persistent":
            raise ValueError("launch_consumer needs tuning.consumer 'per_chunk': the persistent consumer's kernel "
                             "would hold the SMs the caller's own work needs while it waits")
        capturing = self._on_gpu and torch.cuda.is_current_stream_capturing()
        self._cancel_launched("a new launch_consumer")
        path = self.paths["stream"]
        enqueue = path.name in self._warm and path.policy != "serialized" and self.pstream is not None
        if enqueue:
            self._enqueue_launch(path, weights, rows, stamps)
        self._launched = _Launched(weights, rows, stamps, enqueue, capturing)

    def cancel_launch(self) -> bool:
        """Cancel a consumer side enqueued ahead by :meth:`launch_consumer` (this PE's producer publishes empty
        chunks and the forward's end is enqueued: its consumers, here and on every PE, finish with no rows of this
        PE's). Collective in effect: every PE must cancel or run the launched forward. True if one was pending."""
        return self._cancel_launched(None)

    def _cancel_launched(self, why: Optional[str]) -> bool:
        ld, self._launched = self._launched, None
        if ld is None:
            return False
        if why is not None:
            warnings.warn(f"EPBuffer: the consumer launched ahead for a layer's forward of {ld.rows} rows was "
                          f"cancelled by {why}", stacklevel=3)
        if ld.enqueued:
            capturing = self._on_gpu and torch.cuda.is_current_stream_capturing()
            if capturing != ld.capturing:
                self.broken = self.broken or ("a consumer launched ahead " + ("inside" if ld.capturing else "outside")
                                              + " a CUDA graph capture was cancelled " + ("outside" if ld.capturing
                                              else "inside") + " it")
                raise RuntimeError(f"{self.broken}: its producer cannot be enqueued there (a captured graph would "
                                   f"hold a consumer whose producer never runs); the buffer now refuses to run: "
                                   f"rebuild it")
            H = self.shape.hidden
            empty = torch.empty(0, H, dtype=torch.bfloat16, device=self.dev)
            self._enqueue(self.paths["stream"], ld.layer, empty, empty, 0, None, None, ld.stamps, launched=True)
        return True

    def _take_launched(self, weights, rows: int, streaming: bool, stream_epoch, capturing: bool):
        """The pending launch this forward runs the producer side of (None: none pending, or cancelled here
        because this forward is not the launched one)."""
        ld = self._launched
        if ld is None:
            return None
        if ld.enqueued and ld.capturing != capturing:
            self._cancel_launched("a forward " + ("inside" if capturing else "outside") + " a CUDA graph capture")
            return None
        if not streaming or weights is not ld.layer or rows != ld.rows or stream_epoch is not None:
            what = ("a batch forward" if not streaming else "a forward with stream_epoch" if stream_epoch is not None
                    else "a forward of another layer" if weights is not ld.layer
                    else f"a forward of {rows} rows")
            self._cancel_launched(what)
            return None
        self._launched = None
        return ld

    def capture(self, x: torch.Tensor, weights: LayerWeights, out: torch.Tensor, *, streaming: bool = False,
                num_tokens=None, routing: Optional[tuple] = None, node_priority: bool = True, stamps: bool = True,
                launch_ahead: bool = False, before: Optional[Callable[[], None]] = None):
        """Capture one :meth:`forward` into a CUDA graph and return it (run one eager forward of the
        same path first). With ``node_priority`` (and high-priority producer/dispatch streams) every
        kernel node but the expert GEMMs gets the high launch priority explicitly (a captured node
        does not keep its stream's priority, :meth:`prioritize`); ``self.node_priority_report`` says what was
        changed. A consumer launched ahead eagerly (:meth:`launch_consumer`) is cancelled first.

        ``before``: the caller's own work for this layer (what produces ``x``: attention), called on the
        capture stream before the forward and captured with it. ``launch_ahead`` (``streaming=True``): the
        consumer side is launched (:meth:`launch_consumer`) at the graph's start, before ``before``'s work, so
        in every replay it runs beside that work instead of after it."""
        self._cancel_launched("capture()")
        if launch_ahead and not streaming:
            raise ValueError("launch_ahead=True needs streaming=True (the batch path has no consumer to launch ahead)")
        want = node_priority and streaming and self.priority_streams and self.events != []
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
        pending CTAs. The caller's own kernels in the graph (attention, ...) get it too, so a consumer launched
        ahead (:meth:`launch_consumer`) computes in the SMs they leave. Returns a one-line report."""
        if self.pstream is None:
            return "no priorities: the serialized policy runs one stream"
        return _prioritize_nodes(graph, {int(k.function) for k in self.bc.gemm_kernels}, self.pstream.priority,
                                 CAPABILITIES[self.gemm].kernel_names)

    # -- status -------------------------------------------------------------------------------------
    def status(self) -> dict:
        """Device status of both rings (violations, timeouts, published, consumed, first error per
        path), corrupt routes dropped by the dispatch (``bad_routes``) and device token counts outside
        ``[0, T]`` that were clamped (``bad_counts``). Synchronises. Any error makes the buffer refuse
        further forwards (:attr:`broken`): ``close()`` it and build a new one on every PE."""
        out = {"bad_routes": int(self.bad_routes.item()), "bad_counts": int(self.bad_counts.item()),
               "gemm_status": self._gemm_status()}
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

    def _gemm_status(self) -> int:
        """The expert GEMMs' ready-range status bits so far (``status()`` of the backend), 0: fine.
        Synchronises."""
        return self.bc.experts(self.gemm).status()

    def _gemm_status_line(self, bits: int) -> str:
        return f"rank {self.me}: the expert GEMMs met a bad ready range (status {bits:#x}: {gemm_status_text(bits)})"

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
        if self.broken:
            raise RuntimeError(f"this EPBuffer is unusable after a ring error ({self.broken}); close() it and build "
                               f"a new EPBuffer on every PE (collective)")
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
            st["bad_routes"] = int(self.bad_routes.item())
            st["bad_counts"] = int(self.bad_counts.item())
            st["gemm_status"] = self._gemm_status()
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
        T = self._last_T
        return self.my_idx[:T], self.my_w[:T]

    def set_straggler(self, ns: int) -> None:
        """Delay this PE's producer by ``ns`` nanoseconds (device side) in the next forwards (0: none)."""
        self.straggler_t.fill_(int(ns))

    def timeline(self) -> dict:
        """Per-chunk device timestamps of the last stamped forward, in us (after
        :func:`streamring.moe.debug.record_timeline`). A chunk's ``acquired`` is its first dispatch step's,
        ``dispatched_acked`` and ``blocks_done`` its last step's; ``blocks_ready`` counts the blocks all its
        steps made ready; ``t0_ns`` is the forward's first stamp (``%globaltimer``, ns), the zero of the rest."""
        if self.stamps is None or self._stamp_path is None:
            raise ValueError("no timeline: call streamring.moe.debug.record_timeline(buffer) and run a forward")
        p = self._stamp_path
        st = self.stamps.view(-1, STAMP_STRIDE).cpu().numpy().astype(np.int64)
        t0 = int(st[p.num_chunks, 0])
        chunks = [{ev: (int(st[c, j]) - t0) / 1e3 for j, ev in enumerate(CHUNK_EVENTS)} for c in range(p.num_chunks)]
        tail = {ev: (int(st[p.num_chunks, j]) - t0) / 1e3 for j, ev in enumerate(TAIL_EVENTS)}
        n = len(p.order)
        ready = self.bc.ready_hi.cpu().tolist()[: n + 2]
        for c in range(p.num_chunks):
            chunks[c]["blocks_ready"] = sum(ready[i + 1] - ready[i] for i, (cc, _) in enumerate(p.order) if cc == c)
        # grouped ready steps: the seal's partial blocks are in the blocks of the step that sealed (no call of
        # its own, ready_hi[n + 1] unwritten)
        tail["seal_blocks"] = 0 if self._grouped else ready[n + 1] - ready[n]
        return {"chunks": chunks, "tail": tail, "t0_ns": t0, "policy": p.policy, "source_order": p.source_order,
                "chunk_tokens": p.chunk, "num_slots": p.num_slots, "block_m": self.block_m, "rank": self.me,
                "ranks": self.R, "path": p.name, "grouped_steps": self._grouped}

    def memory_report(self) -> dict:
        """Bytes this buffer holds: symmetric (rings, combine area) and local (scratch)."""
        return memory_report(self.shape, self.R, max_tokens_per_rank=self.max_tokens,
                             num_slots=self.paths["stream"].num_slots, tokens_per_slot=self.paths["stream"].chunk,
                             block_m=self.block_m, gemm=self.gemm)

    def close(self) -> None:
        """Free the rings and the combine area (collective; a consumer launched ahead is cancelled first)."""
        if self._launched is not None and not self.broken:
            self._cancel_launched("close()")
            self._sync()
        self.heap.free(self.comb_region)
        for p in self.paths.values():
            p.ring.close()



# ------------------------------------------------------------------------------------------------
def _schedule(chunks: int, source_order: str, ready_window_us: Optional[float], R: int) -> tuple:
    """What a measured plan and a buffer must share for the measurement to decide for the buffer: the ready
    order's grouped steps (any window) are a schedule of their own; with one chunk, arrival and one source
    per ready step are one schedule (a step per source, in the order they publish; arrival differs only in
    how it takes later chunks)."""
    if source_order == "ready" and R > 1 and ready_window_us is not None:
        return chunks, "ready, grouped"
    if chunks == 1 and source_order in ("ready", "arrival"):
        return 1, "a step per source"
    return chunks, source_order


def _check_tuning(tu: EPTuning, R: int, chunks: int, slots: int) -> None:
    """What ``tu`` needs of this job's sizes; errors name the field."""
    if tu.source_order != "rank" and R > 64:
        raise ValueError(f"tuning.source_order {tu.source_order!r} supports up to 64 PEs, got {R}")
    if tu.source_order == "arrival" and slots < chunks:
        raise ValueError(f"tuning.source_order 'arrival' needs num_slots >= the chunks of a forward "
                         f"(max_tokens_per_rank / tokens_per_slot = {chunks}), got num_slots={slots}: a consumer "
                         f"taking all of one source's chunks first could wait for a slot only its own later "
                         f"acknowledgement frees")
    if tu.source_order == "arrival" and tu.policy == "stream_wait":
        raise ValueError("tuning.source_order 'arrival' with policy 'stream_wait' would wait for every source's "
                         "doorbell of a chunk before taking any: use policy 'spin_kernel'")


def _check_sizes(shape: MoEShape, R: int, max_tokens_per_rank, num_slots, tokens_per_slot, block_m):
    """Validated ``(max_tokens, tokens_per_slot, num_slots, block_m)``; errors name the field."""
    if not isinstance(shape, MoEShape):
        raise ValueError(f"shape must be a MoEShape, got {type(shape).__name__}")
    if shape.num_experts % R:
        raise ValueError(f"shape.num_experts={shape.num_experts} must be a multiple of the {R} PEs")
    if shape.hidden % 128 or shape.intermediate % 128:
        raise ValueError(f"shape.hidden={shape.hidden} and shape.intermediate={shape.intermediate} must be multiples "
                         f"of 128 (one FP8 scale per 128 columns)")
    if not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank < 1:
        raise ValueError(f"max_tokens_per_rank must be an int >= 1, got {max_tokens_per_rank!r}")
    if not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
    C = max_tokens_per_rank if tokens_per_slot is None else tokens_per_slot
    if not isinstance(C, int) or not 1 <= C <= max_tokens_per_rank:
        raise ValueError(f"tokens_per_slot must be an int in [1, max_tokens_per_rank={max_tokens_per_rank}], "
                         f"got {tokens_per_slot!r}")
    bm = shape.block_m if block_m is None else block_m
    if bm not in BLOCK_MS:
        raise ValueError(f"block_m must be one of {BLOCK_MS}, got {bm!r}")
    return max_tokens_per_rank, C, num_slots, bm


def _fp8_weights(w: MoEWeights, shape: MoEShape, device) -> MoEWeights:
    """``w`` with FP8 expert weights: bf16/float weights are quantized with 128x128 block scales;
    FP8 weights (with their scales) are kept as they are."""
    if w.is_fp8:
        return w
    q = {}
    for name in ("w1", "w3", "w2"):
        t = getattr(w, name).to(device)
        qs = [quantize_weight_fp8_block(t[e].float()) for e in range(t.shape[0])]
        q[name] = torch.stack([a for a, _ in qs])
        q[f"{name}_scale"] = torch.stack([s for _, s in qs])
    return MoEWeights(router_weight=w.router_weight.to(device), correction_bias=None if w.correction_bias is None
                      else w.correction_bias.to(device), **q)


def memory_report(shape: MoEShape, num_ranks: int, *, max_tokens_per_rank: int, num_slots: int = 2,
                  tokens_per_slot: Optional[int] = None, block_m: int = 64, gemm: str = "triton") -> dict:
    """Bytes per PE of an :class:`EPBuffer` of these sizes, without allocating anything.

    Returns a dict: ``symmetric`` (both rings + the combine area: what NVSHMEM's heap must hold),
    ``one_layer_ring_and_combine`` (the streamed ring + the combine area: what a buffer per layer would
    hold at the least), ``ratio`` (symmetric / one layer), ``local`` (the expert blocks' scratch and
    the producer's, on the GPU outside the symmetric heap) and each part.
    """
    R, H, Kk, E, I = num_ranks, shape.hidden, shape.topk, shape.num_experts, shape.intermediate
    M, C, S, bm = _check_sizes(shape, R, max_tokens_per_rank, num_slots, tokens_per_slot, block_m)
    lay = dict(num_ranks=R, hidden=H, topk=Kk, num_experts=E)
    nch_s = -(-M // C)
    batch_ring = RingLayout(num_slots=1, tokens_per_slot=M, **lay).nbytes
    stream_ring = RingLayout(num_slots=min(S, nch_s), tokens_per_slot=C, **lay).nbytes
    cap = max(M, nch_s * C)
    combine = CombineLayout(max_tokens=cap, topk=Kk, hidden=H, max_chunks=max(nch_s, 1)).nbytes
    E_loc = E // R
    max_blocks = -(-(R * cap) * Kk // bm) + E_loc
    rows = max_blocks * bm
    local = rows * (H + H // 128 * 4 + I + I // 128 * 4 + 4 + 4 + 8 + 4)  # a, a_sf, h1, h1_sf, weight, src, tok, chunk
    if gemm not in CAPABILITIES or not CAPABILITIES[gemm].owner_rows:
        local += rows * (2 * I * 2 + I // 128 * 4 + H * 2)  # bf16 L1 output, L2 scales, local y
    sym = batch_ring + stream_ring + combine
    one = stream_ring + combine
    return {"symmetric": sym, "batch_ring": batch_ring, "stream_ring": stream_ring, "combine": combine,
            "one_layer_ring_and_combine": one, "ratio": sym / one, "local": local}


def _prioritize_nodes(graph, low_funcs: set, priority: int, low_names: tuple = ()) -> str:
    """Give every kernel node of the captured ``graph`` whose function is not in ``low_funcs`` and whose name
    (``cuFuncGetName``: kernels launched by a library, whose handles Python does not see) contains none of
    ``low_names`` the launch priority ``priority`` (CUDA driver graph API). Returns a one-line report."""
    from cuda.bindings import driver as drv

    def is_low(func) -> bool:
        if int(func) in low_funcs:
            return True
        if not low_names:
            return False
        res = drv.cuFuncGetName(func)
        if res[0] != drv.CUresult.CUDA_SUCCESS:
            return False
        name = res[1].decode(errors="replace") if isinstance(res[1], bytes) else str(res[1])
        return any(part in name for part in low_names)

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
            if is_low(params.func):
                kept += 1
                continue
            val = value_type()
            val.priority = int(priority)
            ok(drv.cuGraphKernelNodeSetAttribute(node, attr, val), "cuGraphKernelNodeSetAttribute")
            changed += 1
        return f"{changed} kernel nodes set to priority {priority}, {kept} GEMM nodes left at the default"
    except Exception as exc:  # noqa: BLE001 - the graph still runs, without node priorities
        return f"node priorities not set: {type(exc).__name__}: {exc}"
