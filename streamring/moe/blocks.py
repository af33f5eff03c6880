"""Block-granular FP8 MoE consumer (RFC option 2): per-expert blocks filled across chunks.

The consumer appends the routed rows of each chunk to per-expert blocks of ``block_m`` rows,
reserved incrementally (a block id is handed out when an expert's first row of the block
arrives). A block becomes *ready* the moment its last row is appended, or at the end-of-stream
*seal* for the expert's last, partial block. Only ready blocks enter the expert GEMMs, so each
expert's weights are read once per block, exactly as in the batch path - the weight re-reading
of chunk-local pools (``performance.md``: 1.9x the MoE time for 2 chunks at 1024 tokens) does
not happen.

Everything is enqueued on the current torch stream with no host synchronisation: the block
counts live on the device and the GEMM launches read their ``[lo, hi)`` range of the ready
list from device memory, with a grid sized for the largest range possible. A whole forward -
per-chunk dispatch and GEMMs included - is therefore one captured CUDA graph that the host does
not relaunch per chunk (``streamring.moe.ep_buffer``).

Bitwise contract: rows of an expert are appended in chunk order and, inside a chunk, in
(token, k) order (stable sort), which is the batch path's order; the kernels compute every row
independently (``streamring.device.moe_triton``). Streamed and batch outputs are therefore
bitwise identical (``tests/unit/test_blocks.py`` checks it, and the GPU benchmark re-checks it on
the H200).

Runs wherever Triton runs: on a GPU, or on the CPU under ``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..device import ep_triton as EK
from ..device.block_alloc import alloc_blocks
from ..device import moe_triton as K
from ..gemm.backends import make_experts, refuse_unsupported
from .grid_bounds import consumer_max_blocks, step_bound
from .math import MoEShape
from .routing import router_of
from .weight_views import FP8BlocksView

FP8 = torch.float8_e4m3fn
PULLS = ("route", "token")  # BlockConsumer.dispatch_ep: one slot read per route, or per needed token


def select_experts_into(logits: torch.Tensor, bias: Optional[torch.Tensor], shape: MoEShape, idx_out: torch.Tensor,
                        w_out: torch.Tensor, launch: Optional[dict] = None) -> None:
    """The router of ``shape`` (:mod:`streamring.moe.routing`) on float32 ``logits [n, E]``, written into
    ``idx_out`` (int64 ``[n, topk]``) and ``w_out`` (float32 ``[n, topk]``): by the router's one kernel
    (``select_into``; the torch form of the built-in rules is a dozen launches, about 0.4 ms of a forward at
    8192 tokens), else by its ``select`` and a copy. ``launch``: the kernel's launch parameters (the built-in
    ones: rows per program and warps, default ``moe_triton.SELECT_EXPERTS_LAUNCH``)."""
    r = router_of(shape.router)
    if r.select_into is not None:
        r.function("select_into")(logits, bias, shape, idx_out, w_out, launch=launch)
        return
    idx, w = r.function()(logits, bias, shape)
    idx_out.copy_(idx)
    w_out.copy_(w)


def softmax_topk_into(logits, bias, shape: MoEShape, idx_out, w_out, launch: Optional[dict] = None) -> None:
    """The ``softmax_topk`` router (:func:`streamring.moe.routers.softmax_topk`) as one kernel."""
    K.select_experts(logits, None if bias is None else bias.float(), idx_out, w_out, topk=shape.topk, softmax=True,
                     normalize=shape.renormalize, n_group=1, topk_group=1, routed_scaling_factor=1.0, launch=launch)


def deepseek_v3_into(logits, bias, shape: MoEShape, idx_out, w_out, launch: Optional[dict] = None) -> None:
    """The ``deepseek_v3`` router (:func:`streamring.moe.routers.deepseek_v3`) as one kernel."""
    K.select_experts(logits, None if bias is None else bias.float(), idx_out, w_out, topk=shape.topk, softmax=False,
                     normalize=shape.norm_topk_prob, n_group=shape.n_group, topk_group=shape.topk_group,
                     routed_scaling_factor=shape.routed_scaling_factor, launch=launch)


class Producer:
    """The producer's step, the one of every path: a layer's router and top-k (:meth:`route`) and the FP8 layout of
    the rows (:meth:`layout`), for up to ``max_tokens`` rows per call, of layers of ``num_experts`` experts. The
    block path calls it directly; the expert-parallel layer's producer
    (:class:`~streamring.moe.ep_producer.EPProducer`) calls it per chunk, into the chunk's ring slot, and publishes
    what it wrote."""

    def __init__(self, max_tokens: int, num_experts: int, device):
        self.logits = torch.zeros(max_tokens, num_experts, dtype=torch.float32, device=device)

    def route(self, x: torch.Tensor, fw: FP8BlocksView, shape: MoEShape, idx_out: torch.Tensor,
              w_out: torch.Tensor) -> None:
        """Router + top-k of ``x [n, H]`` by ``fw``'s router and bias and ``shape``'s rule (a layer's routing)
        into ``idx_out [n, K]`` (int64), ``w_out [n, K]`` (f32)."""
        n = x.shape[0]
        lg = self.logits[:n]
        K.router_logits(x, fw.router, lg)
        select_experts_into(lg, fw.bias, shape, idx_out, w_out)

    @staticmethod
    def layout(x: torch.Tensor, q_out: torch.Tensor, sf_out: torch.Tensor) -> None:
        """FP8 quantization of ``x [n, H]`` into ``q_out [n, H]`` and ``sf_out [n, H/128]``."""
        K.quant_rows(x, q_out, sf_out)


class BlockConsumer:
    """Per-expert block state and buffers for one forward of up to ``max_tokens`` tokens.

    Call order per forward: :meth:`begin`, then for chunk c = 0..C-1 :meth:`dispatch` (c) and
    :meth:`compute` (c, c+1), then :meth:`seal` (C), :meth:`compute` (C, C+1) and
    :meth:`combine`. ``ready_hi[j]`` (device) is the ready-list length after dispatch j-1,
    so the blocks made ready by dispatch c are ``ready_list[ready_hi[c] : ready_hi[c+1]]``.
    """

    def __init__(self, shape: MoEShape, max_tokens: int, max_chunks: int, block_m: int, device, *,
                 ep_entries: int = 0, local_y: bool = True, seal_by_expert: bool = True):
        """``shape``: the experts this consumer serves (all of them, or a PE's local ones).
        ``max_tokens``: most tokens whose rows can reach it in one forward (every source's).
        ``ep_entries``: >0 for the expert-parallel dispatch (:meth:`dispatch_ep`): the routes of one
        chunk of every source (``num_ranks * tokens_per_slot * topk``); it also keeps, per row, the
        owner PE, the owner's combine row and the chunk (``row_src``, ``row_tok``, ``row_chunk``).
        ``local_y``: keep the local bf16 L2 output ``y`` (not needed when L2 writes straight into
        the owners' combine rows).
        ``seal_by_expert``: whether :meth:`seal` lays the range of the GEMM call that computes the partial
        blocks out expert by expert (``EPTuning.seal_by_expert``: this consumer is its only reader)."""
        if block_m not in (16, 32, 64, 128):
            raise ValueError(f"block_m must be one of (16, 32, 64, 128), got {block_m}")
        self.shape, self.block_m, self.device = shape, block_m, device
        self.seal_by_expert = seal_by_expert
        E, Kk, H, I = shape.num_experts, shape.topk, shape.hidden, shape.intermediate
        self.max_tokens, self.max_chunks = max_tokens, max_chunks
        self.max_blocks = consumer_max_blocks(1, max_tokens, Kk, block_m, E)
        rows = self.max_blocks * block_m
        i32 = dict(dtype=torch.int32, device=device)
        self.state = torch.zeros(E + 3, **i32)  # fill per expert, allocated, ready, sealed
        self.expert_blocks = torch.zeros(E, -(-max_tokens // block_m) + 1, **i32)
        self.block_expert = torch.zeros(self.max_blocks, **i32)
        self.ready_list = torch.zeros(self.max_blocks, **i32)
        self.block_rows = torch.zeros(self.max_blocks, **i32)  # routed rows per ready block (alloc_blocks)
        self.ready_hi = torch.zeros(max_chunks + 2, **i32)
        self.ones = torch.ones(max_tokens * Kk, **i32)  # dispatch's histogram (scatter_add of ones)
        # zero-filled once: rows of a partial block past its fill are computed but never read
        self.a = torch.zeros(rows, H, dtype=torch.uint8, device=device)
        self.a_sf = torch.zeros(rows, H // 128, dtype=torch.float32, device=device)
        self.h1 = torch.zeros(rows, I, dtype=torch.uint8, device=device)
        self.h1_sf = torch.zeros(rows, I // 128, dtype=torch.float32, device=device)
        self.row_weight = torch.zeros(rows, dtype=torch.float32, device=device)
        self.y = torch.zeros(rows, H, dtype=torch.bfloat16, device=device) if local_y else None
        self.tok_row = torch.zeros(max_tokens * Kk, dtype=torch.int64, device=device)
        self.ep = ep_entries > 0
        if self.ep:
            self.row_src = torch.full((rows,), -1, **i32)  # -1: no result row (padding)
            self.row_tok = torch.zeros(rows, dtype=torch.int64, device=device)
            self.row_chunk = torch.zeros(rows, **i32)
            # a dispatch's routes sorted by local expert (a stable counting sort, ``ep_triton.bucket_sort``):
            # reused by every dispatch, which all run on one stream in order
            self.sorted_e = torch.zeros(ep_entries, **i32)
            self.order = torch.zeros(ep_entries, dtype=torch.int64, device=device)
            self.counts = torch.zeros(E + 1, **i32)
            self.cstart = torch.zeros(E + 1, **i32)
            # bytes the dispatch pulls from peers' slots this forward, counted by ep_gather (pull_bytes=):
            # [0] one row per route (pull="route"), [1] one row per needed token (pull="token")
            self.pull_bytes = torch.zeros(2, dtype=torch.int64, device=device)
            self.ep_tokens = ep_entries // shape.topk  # (source, token) pairs of one dispatch
            self._stage = None  # (x, x_sf) stage rows of pull="token", allocated at its first use
        self.gemm_kernels: set = set()  # compiled GEMM kernels launched so far (graph node priorities)
        self._experts: dict = {}  # backend name -> its expert GEMMs for this consumer (experts())
        # this forward's dispatches that allocated blocks (the seal allocates none) and the ready index the
        # seal wrote (``ready_hi[seal_ready_index]``), kept on the host, so also right while a graph is
        # captured: after exactly one dispatch and the seal, block ids were handed out expert by expert in
        # one call (``alloc_blocks``), so each expert's blocks are contiguous and in expert order
        self.dispatch_allocations, self.seal_ready_index = 0, None

    def max_ready(self, tokens: int) -> int:
        """Most blocks one dispatch of ``tokens`` tokens can make ready (the GEMM grid bound)."""
        return step_bound(1, 1, tokens, self.shape.topk, self.block_m, self.shape.num_experts, self.max_blocks)

    def begin(self) -> None:
        """Start a forward: no block allocated or ready (and, expert-parallel, no result row)."""
        self.state.zero_()
        self.ready_hi.zero_()
        self.dispatch_allocations, self.seal_ready_index = 0, None
        if self.ep:
            self.row_src.fill_(-1)
            self.pull_bytes.zero_()

    def dispatch(self, c: int, topk_idx, topk_w, x_q, x_sf, token_base: int) -> None:
        """Append chunk ``c``'s routed rows (slot views, ``n`` tokens) to the expert blocks.

        After this returns (in stream order) nothing reads the slot again: the ring slot may be
        acknowledged right here, before the GEMMs (the RFC's early ``input_consumed`` ack).
        """
        E, Kk = self.shape.num_experts, self.shape.topk
        n = topk_idx.shape[0]
        flat = topk_idx.reshape(-1)
        sorted_e, order = torch.sort(flat, stable=True)
        counts = torch.zeros(E, dtype=torch.int32, device=self.device).scatter_add_(0, flat, self.ones[:n * Kk])
        cstart = (torch.cumsum(counts, 0, dtype=torch.int32) - counts)
        self._alloc_blocks(counts, c + 1, seal=False)
        K.place_rows(sorted_e, order, counts, cstart, self.state, self.expert_blocks, x_q.view(torch.uint8), x_sf,
                     topk_w.reshape(-1), self.a, self.a_sf, self.row_weight, self.tok_row, token_base, topk=Kk,
                     block_m=self.block_m)

    def dispatch_ep(self, c: int, flat_e, flat_w, src_list, ring, deltas, offs, step: int | None = None, *,
                    pull: str = "route", on_slot_released=None) -> None:
        """Expert-parallel dispatch of chunk ``c`` (dispatch number ``step``, default ``c``: the
        blocks it makes ready are ``ready_list[ready_hi[step] : ready_hi[step + 1]]``; several
        dispatches per chunk in the ready source order): append the routes of ``flat_e`` (int32 local
        expert per route of every source in ``src_list``, ``local experts`` for routes this PE does
        not serve; see :func:`~streamring.device.ep_triton.ep_gather`) to the expert blocks and copy
        each routed row out of its source's slot: ``ring = (ring_u8, ring_f32)`` views of the ring,
        ``deltas = (delta_u8, delta_f32)`` per-source distances, ``offs = (x byte offset, x_sf
        element offset)`` of the slot.

        ``pull``: ``"route"`` copies a row from the slot once per route to a local expert (up to K
        times per token); ``"token"`` copies each needed token's row once into local stage rows
        (``ep_stage_rows``), then expands them into the blocks. Both append the same rows in the same
        order (outputs bitwise equal). The stage rows (``ep_entries / K`` rows of ``hidden`` bytes) are
        allocated at the first ``"token"`` dispatch: make it before a CUDA-graph capture (a warm-up).

        ``on_slot_released``: called (to enqueue, e.g., the slot's acknowledgement, the RFC's early
        ``input_consumed``) right after the last read of the slot: after the stage copy with
        ``"token"``, at the end with ``"route"``. After this returns (in stream order) nothing reads
        the slot again either way.
        """
        if pull not in PULLS:
            raise ValueError(f"pull must be one of {PULLS}, got {pull!r}")
        E, Kk = self.shape.num_experts, self.shape.topk
        n = flat_e.shape[0]
        C = n // (src_list.shape[0] * Kk)
        staged = None
        if pull == "token":
            staged = self._stage_rows()
            EK.ep_stage_rows(flat_e, src_list, ring[0], ring[1], deltas[0], deltas[1], offs[0], offs[1], staged[0],
                            staged[1], tokens_per_slot=C, topk=Kk, hidden=self.shape.hidden, local_experts=E)
            if on_slot_released is not None:
                on_slot_released()
        # the routes in expert order: one small kernel (a radix sort's kernels would wait, in a captured graph,
        # for an expert GEMM grid on another stream to drain; see ``ep_triton.bucket_sort``)
        sorted_e, order, counts, cstart = self.sorted_e[:n], self.order[:n], self.counts, self.cstart
        EK.bucket_sort(flat_e, E + 1, sorted_e, order, counts, cstart)
        self._alloc_blocks(counts, (c if step is None else step) + 1, seal=False)
        EK.ep_place_rows(sorted_e, order, counts, cstart, self.state, self.expert_blocks, src_list, ring[0], ring[1],
                        deltas[0], deltas[1], offs[0], offs[1], flat_w, self.a, self.a_sf, self.row_weight,
                        self.row_src, self.row_tok, self.row_chunk, c, tokens_per_slot=C, topk=Kk,
                        hidden=self.shape.hidden, local_experts=E, block_m=self.block_m, staged=staged)
        if pull == "route" and on_slot_released is not None:
            on_slot_released()

    def _stage_rows(self):
        if self._stage is None:
            H = self.shape.hidden
            self._stage = (torch.zeros(self.ep_tokens, H, dtype=torch.uint8, device=self.device),
                           torch.zeros(self.ep_tokens, H // 128, dtype=torch.float32, device=self.device))
        return self._stage

    def seal(self, c: int, *, if_none_pending=None, call_from: int | None = None) -> None:
        """End of stream: every partial block becomes ready (``ready_hi[c + 1]``), once per forward (a
        second seal makes nothing ready and writes ``ready_hi[c + 1]`` = the blocks ready so far).

        ``if_none_pending`` (a device int64 source mask): seal only if it is 0, decided on the device
        (the ready-order dispatch step that takes the last source of the last chunk seals, so its GEMM
        call has the partial blocks too; ``c`` is then that step's index and its blocks and the seal's
        are ``ready_list[ready_hi[c] : ready_hi[c + 1]]``).

        ``call_from``: the ready index where the GEMM call that computes the partial blocks starts (that call is
        ``compute(call_from, c + 1, ...)``, enqueued after this). With ``seal_by_expert`` (the constructor's)
        the seal then lays that range out expert by expert, each expert's partial block right after its full
        blocks, so the call reads every expert's weights in one run of tiles instead of twice
        (``block_alloc.alloc_blocks``, ``by_expert_from``); without it the range keeps the allocator's order.
        Nothing may have read that range yet: not for a range a persistent consumer was already given."""
        self._alloc_blocks(self.ready_hi, c + 1, seal=True, if_none_pending=if_none_pending,
                           by_expert_from=call_from if self.seal_by_expert else None)

    def _alloc_blocks(self, counts, hi_index: int, *, seal: bool, if_none_pending=None,
                      by_expert_from: int | None = None) -> None:
        """``block_alloc.alloc_blocks`` on this consumer's block state, recording on the host what
        :meth:`covers_one_allocation` reads: a dispatch's allocation, or the seal's ready index (a seal
        decided on the device counts as an allocation of its own: the host cannot tell where it was)."""
        alloc_blocks(counts, self.state, self.expert_blocks, self.block_expert, self.ready_list, self.block_rows,
                     self.ready_hi, hi_index, num_experts=self.shape.num_experts, block_m=self.block_m, seal=seal,
                     seal_if_none_pending=if_none_pending, by_expert_from=by_expert_from)
        if seal and if_none_pending is None:
            self.seal_ready_index = hi_index
        else:
            self.dispatch_allocations += 1

    def covers_one_allocation(self, lo_index: int, hi_index: int) -> bool:
        """Whether ``[lo_index, hi_index)`` is this forward's whole ready list after exactly one dispatch
        and the seal: then every block is in the range and the blocks lie expert by expert
        (``alloc_blocks`` hands ids out by a prefix sum over experts), the layout DeepGEMM's psum
        path reads (:func:`streamring.gemm.deep_gemm.psum_layout` re-checks it on the device)."""
        return (self.dispatch_allocations == 1 and self.seal_ready_index is not None and lo_index == 0
                and hi_index == self.seal_ready_index)

    def experts(self, impl: str = "triton", **options):
        """The expert GEMMs of backend ``impl`` for this consumer (:mod:`streamring.gemm.backends`: the
        Triton kernels, CUTLASS's or DeepGEMM's grouped FP8 GEMM): made on the first call, or again with
        new ``options`` (the backend's: e.g. CUTLASS tiles). Making one allocates: call it before a graph
        capture. Refusals name the reason (DeepGEMM: ``block_m`` 128 and an importable ``deep_gemm``)."""
        have = self._experts.get(impl)
        if have is None or options:
            have = self._experts[impl] = make_experts(impl, self, **options)
        return have

    def made_experts(self, impl: str):
        """The expert GEMMs of ``impl`` if :meth:`experts` made them already, else None (makes nothing)."""
        return self._experts.get(impl)

    def compute(self, lo_index: int, hi_index: int, max_items: int, fw: FP8BlocksView, *, impl: str = "triton",
                max_ctas: int | None = None, expect_items: int | None = None, out=None,
                direct=None) -> None:
        """L1+SwiGLU and L2 of the blocks ``ready_list[ready_hi[lo_index] : ready_hi[hi_index]]`` by the
        expert GEMMs of ``impl`` (:meth:`experts`). ``max_ctas`` (a capped persistent grid), ``expect_items``
        (the blocks the call is expected to have: the grid's hint) and ``out``/``direct`` (where L2 stores) as
        the backend's ``compute`` takes them; a backend without one of them refuses it (ValueError), before it is
        made."""
        refuse_unsupported(impl, max_ctas=max_ctas, out=out, direct=direct)
        self.experts(impl).compute(lo_index, hi_index, max_items, fw, max_ctas=max_ctas, expect_items=expect_items,
                                   out=out, direct=direct)

    def combine(self, out: torch.Tensor) -> None:
        """``out [T, H]`` bf16: the sum of each token's k weighted expert rows."""
        K.combine(self.tok_row, self.y, out, topk=self.shape.topk)


def moe_forward(idx, w, q, sf, fw: FP8BlocksView, bc: BlockConsumer, out: torch.Tensor,
                max_ctas: int | None = None, gemm_impl: str = "triton") -> None:
    """The MoE alone on already produced routing/layout (batch structure): the expert GEMMs of
    ``gemm_impl`` (``max_ctas`` as :meth:`BlockConsumer.compute` takes it)."""
    bc.begin()
    bc.dispatch(0, idx, w, q, sf, 0)
    bc.seal(1)
    bc.compute(0, 2, bc.max_blocks, fw, impl=gemm_impl, max_ctas=max_ctas)
    bc.combine(out)
