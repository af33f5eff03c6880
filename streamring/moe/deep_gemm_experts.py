"""The block consumer's expert GEMMs through DeepGEMM (``gemm_impl="deep_gemm"``).

Same contract as :mod:`streamring.moe.cutlass_experts` (and the Triton path): L1 (gate and up),
SwiGLU, FP8 re-quantization of ``h`` with per-row 128-column scales, L2 times the routing weight,
bf16 ``y`` rows; only the ready blocks ``ready_list[ready_hi[lo] : ready_hi[hi]]`` are computed, the
range is read on the device, everything runs on the current stream without host synchronisation.

Per call (``streamring.device.deep_gemm_ops`` says what DeepGEMM wants and why):

1. ``m_indices`` of the ready range: the expert on the rows of every ready block, -1 elsewhere;
   the activation scales copied into an MN-major buffer;
2. L1: ``deep_gemm.m_grouped_fp8_gemm_nt_contiguous`` over the whole block buffer
   (``max_blocks * 128`` rows: the same kernel configuration whatever the range) into ``gu`` (bf16,
   the only output DeepGEMM's contiguous path has). A call that covers the forward's only allocation
   (the batch path: one dispatch, the seal, one call over every block;
   :meth:`~streamring.moe.blocks.BlockConsumer.covers_one_allocation`) passes the psum layout instead
   of ``m_indices`` (:func:`~streamring.device.deep_gemm_ops.psum_layout`): DeepGEMM then schedules
   only the allocated blocks, not the worst-case buffer's -1 rows, which it would load and store;
3. :func:`~streamring.device.moe_triton.swiglu_quant_blocks`: ``h1``, ``h1_sf``, and
   ``h1_sf_w = h1_sf * routing weight`` (L2's activation scales), copied MN-major;
4. L2 with those scales: the routing weight is applied inside the scale promotion, ``y`` is rounded
   to bf16 once. DeepGEMM writes zeros on every -1 row, so by default L2 goes into a scratch buffer
   and only the ready blocks' rows are copied into ``y`` (``keep_rows_outside_range``); a caller whose
   ``y`` is a staging buffer read right after each call (the expert-parallel layer, which puts the
   range's rows to their owners at once) or that computes every block in one call (the batch path)
   passes False and L2 writes ``y`` directly.

Bitwise streamed == batch: DeepGEMM computes each row from that row's data and its expert's weights
with a configuration fixed by (rows of the buffer, N, K, SMs), whichever layout (psum or ``m_indices``)
schedules its tile (``streamring.device.deep_gemm_ops`` says what that rests on, and what re-checks it);
the SwiGLU/quant kernel is row-local, the copy is exact.
"""

from __future__ import annotations

import torch

from ..device import deep_gemm_ops as DG
from ..device import moe_triton as K

FP8 = torch.float8_e4m3fn


class DeepGemmExperts:
    """DeepGEMM buffers for one :class:`~streamring.moe.blocks.BlockConsumer` (allocated here, once).

    ``psum``: let a call over the forward's only allocation pass the psum layout (module doc).
    Raises ValueError unless ``bc.block_m`` is 128 and RuntimeError (with the reason) when DeepGEMM
    is not available (:func:`~streamring.device.deep_gemm_ops.deep_gemm_available`).
    """

    def __init__(self, bc, *, keep_rows_outside_range: bool = True, psum: bool = True):
        DG.check_block_m(bc.block_m, "block_m (BlockConsumer.block_m, the plan's block_m)")
        self.dg = DG.load()
        shape = bc.shape
        H, I = shape.hidden, shape.intermediate
        rows = bc.max_blocks * bc.block_m
        dev = bc.device
        self.bc = bc
        self.keep_rows_outside_range = bool(keep_rows_outside_range)
        #: False: every call passes ``m_indices`` (the psum layout's baseline in benchmarks)
        self.allow_psum = bool(psum)
        self.m_indices = torch.full((rows,), -1, dtype=torch.int32, device=dev)
        self.psum = torch.zeros(shape.num_experts, dtype=torch.int32, device=dev)
        #: whether the last :meth:`compute` passed the psum layout (True) or ``m_indices`` (False)
        self.last_used_psum: bool | None = None
        self.status_word = torch.zeros(1, dtype=torch.int32, device=dev)
        self.a_sf_mn = DG.mn_major_scales(rows, H // 128, dev)
        self.gu = torch.zeros(rows, 2 * I, dtype=torch.bfloat16, device=dev)
        self.h1_sf_w = torch.zeros(rows, I // 128, dtype=torch.float32, device=dev)
        self.h1_sf_w_mn = DG.mn_major_scales(rows, I // 128, dev)
        self.y_scratch = (torch.zeros(rows, H, dtype=torch.bfloat16, device=dev)
                          if self.keep_rows_outside_range and bc.y is not None else None)

    def indices(self, lo_index: int, hi_index: int, max_items: int) -> None:
        """``m_indices`` of the ready range (bad ranges set bits of :attr:`status_word`)."""
        bc = self.bc
        DG.ready_m_indices(bc.ready_list, bc.ready_hi, lo_index, hi_index, max_items, bc.block_expert,
                           bc.shape.num_experts, bc.block_m, out=self.m_indices, status=self.status_word)

    def build_psum_layout(self, lo_index: int, hi_index: int) -> None:
        """The psum layout of every allocated block (checked on the device: :attr:`status_word` bit 32)."""
        bc = self.bc
        DG.psum_layout(bc.state, bc.expert_blocks, bc.ready_hi, lo_index, hi_index, bc.shape.num_experts,
                       bc.block_m, out=self.psum, status=self.status_word)

    def _grouped(self, a, b, d, psum: bool) -> None:
        DG.grouped_gemm(self.dg, a, b, d, self.psum if psum else self.m_indices, psum)

    def l1_swiglu(self, lo_index: int, hi_index: int, max_items: int, fw, psum: bool = False) -> None:
        """L1 + SwiGLU/requant of the ready blocks (``m_indices`` must be current: :meth:`indices`; with
        ``psum``, :attr:`psum`: :meth:`build_psum_layout`)."""
        bc = self.bc
        self.a_sf_mn.copy_(bc.a_sf)
        self._grouped((bc.a.view(FP8), self.a_sf_mn), (fw.w1, fw.w1_sf), self.gu, psum)
        K.swiglu_quant_blocks(bc.ready_list, bc.ready_hi, lo_index, hi_index, max_items, self.gu, bc.h1.view(FP8),
                              bc.h1_sf, bc.row_weight, self.h1_sf_w, block_m=bc.block_m)

    def l2(self, lo_index: int, hi_index: int, max_items: int, fw, psum: bool = False) -> None:
        """L2 (routing weight folded into the scales) of the ready blocks into ``bc.y``. With ``psum``
        DeepGEMM stores only the allocated blocks' rows, so it writes ``bc.y`` directly."""
        bc = self.bc
        if bc.y is None:
            raise ValueError("gemm='deep_gemm' needs the consumer's local y (BlockConsumer(local_y=True))")
        self.h1_sf_w_mn.copy_(self.h1_sf_w)
        out = self.y_scratch if self.y_scratch is not None and not psum else bc.y
        self._grouped((bc.h1.view(FP8), self.h1_sf_w_mn), (fw.w2, fw.w2_sf), out, psum)
        if out is self.y_scratch:
            DG.copy_ready_rows(bc.ready_list, bc.ready_hi, lo_index, hi_index, max_items, self.y_scratch, bc.y,
                               block_m=bc.block_m)

    def compute(self, lo_index: int, hi_index: int, max_items: int, fw, max_ctas: int | None = None) -> None:
        if max_ctas is not None:
            raise ValueError(f"max_ctas must be None for gemm='deep_gemm' (its grid and configuration follow the "
                             f"device's SM count; a capped grid would change them), got {max_ctas}")
        if max_items <= 0:
            return
        psum = self.allow_psum and self.bc.covers_one_allocation(lo_index, hi_index)
        if psum:
            self.build_psum_layout(lo_index, hi_index)
        else:
            self.indices(lo_index, hi_index, max_items)
        self.last_used_psum = psum
        self.l1_swiglu(lo_index, hi_index, max_items, fw, psum)
        self.l2(lo_index, hi_index, max_items, fw, psum)

    def status(self) -> int:
        """The ready-range status bits so far (synchronises); 0 = every range was fine."""
        return int(self.status_word.item())

    def check(self) -> None:
        """Raise if any call met a bad ready range (synchronises)."""
        s = self.status()
        if s:
            raise RuntimeError(f"DeepGemmExperts: status {s:#x}: {DG.status_text(s)}")
