"""The block consumer's expert GEMMs through CUTLASS (``gemm_impl="cutlass"``).

Same contract as :meth:`streamring.moe.blocks.BlockConsumer.compute` (the Triton path): L1 (gate and
up), SwiGLU, FP8 re-quantization of ``h`` with per-row 128-column scales, L2 times the routing weight,
bf16 ``y`` rows; only the ready blocks ``ready_list[ready_hi[lo] : ready_hi[hi]]`` are computed, the
range is read on the device, everything runs on the current stream without host synchronisation.

Per call:

1. L1: :class:`~streamring.device.cutlass_gemm.GroupedGemm` ``gu = A @ W1^T`` (``[rows, 2I]``,
   float32 by default: SwiGLU then sees fp32 accumulators as in the fused Triton epilogue; bf16 is
   the option that halves the traffic of this intermediate);
2. :func:`~streamring.device.moe_triton.swiglu_quant_blocks`: ``h1``, ``h1_sf`` exactly as the Triton
   epilogue, and ``h1_sf_w = h1_sf * routing weight`` (L2's activation scales);
3. L2: ``y = h1 @ W2^T`` with the scales ``h1_sf_w``: the routing weight is applied inside the
   blockwise scale promotion, so ``y`` is rounded to bf16 once, like the Triton L2's epilogue.

Bitwise streamed == batch holds as for the Triton path: the CUTLASS grouped GEMM computes each row
from that row only (see ``csrc/gemm/gemm_blockwise_fp8.cu``), the SwiGLU/quant kernel is row-local.
"""

from __future__ import annotations

import torch

from ..device import cutlass_gemm as CG
from ..device import moe_triton as K

FP8 = torch.float8_e4m3fn


class CutlassExperts:
    """CUTLASS plans and intermediates for one :class:`~streamring.moe.blocks.BlockConsumer`.

    ``tile_l1`` / ``tile_l2``: keys of :data:`streamring.device.cutlass_gemm.TILE_TABLE`;
    ``l1_out_dtype``: float32 or bfloat16 (the one-block tiles have bf16 only);
    ``raster_l1`` / ``raster_l2``: ``"m"`` or ``"n"`` and ``swizzle_l1`` / ``swizzle_l2``: 1, 2, 4 or 8
    (the group scheduler's tile order; neither changes a bit of the output). Allocates the L1
    output ``[rows, 2I]`` and the L2 scale buffer once, here. A tile that reads one weight scale per
    64 rows gets the weights' scales repeated (:func:`~streamring.device.cutlass_gemm.weight_scales_for`),
    made on first use and again whenever the scale tensor changes.
    """

    def __init__(self, bc, *, tile_l1: str = "coop128", tile_l2: str = "coop128", l1_out_dtype=torch.float32,
                 trap_on_error: bool = True, raster_l1: str = "m", raster_l2: str = "m", swizzle_l1: int = 1,
                 swizzle_l2: int = 1):
        shape = bc.shape
        H, I = shape.hidden, shape.intermediate
        rows = bc.max_blocks * bc.block_m
        self.bc = bc
        self.gemm1 = CG.GroupedGemm(2 * I, H, out_dtype=l1_out_dtype, tile=tile_l1, capacity=bc.max_blocks,
                                    trap_on_error=trap_on_error, raster=raster_l1, swizzle=swizzle_l1)
        self.gemm2 = CG.GroupedGemm(H, I, out_dtype=torch.bfloat16, tile=tile_l2, capacity=bc.max_blocks,
                                    trap_on_error=trap_on_error, raster=raster_l2, swizzle=swizzle_l2)
        self.gu = torch.zeros(rows, 2 * I, dtype=l1_out_dtype, device=bc.device)
        self.h1_sf_w = torch.zeros(rows, I // 128, dtype=torch.float32, device=bc.device)
        self._scales: dict = {}  # (which, sf_n) -> (key of the source tensor, repeated scales)

    def _w_sf(self, which: str, w_sf: torch.Tensor, sf_n: int) -> torch.Tensor:
        """``w_sf`` as a plan with ``sf_n`` reads it; the repeated copy is kept while the source tensor
        (its storage, shape and in-place version) stays the same. Call before a graph capture, like
        the first run (a change of weights inside a captured graph is not seen)."""
        if sf_n == CG.SF_BLOCK:
            return w_sf
        key = (w_sf.data_ptr(), tuple(w_sf.shape), w_sf._version)
        hit = self._scales.get((which, sf_n))
        if hit is None or hit[0] != key:
            hit = (key, CG.weight_scales_for(w_sf, sf_n))
            self._scales[(which, sf_n)] = hit
        return hit[1]

    def l1_swiglu(self, lo_index: int, hi_index: int, max_items: int, fw, max_ctas: int | None = None) -> None:
        """L1 GEMM + SwiGLU/requant of the ready blocks (into ``bc.h1``, ``bc.h1_sf``, ``h1_sf_w``)."""
        bc = self.bc
        self.gemm1.run(bc.ready_list, bc.ready_hi, lo_index, hi_index, max_items, bc.block_expert, bc.a.view(FP8),
                       bc.a_sf, fw.w1, self._w_sf("w1", fw.w1_sf, self.gemm1.sf_n), self.gu, block_m=bc.block_m,
                       max_ctas=max_ctas)
        K.swiglu_quant_blocks(bc.ready_list, bc.ready_hi, lo_index, hi_index, max_items, self.gu, bc.h1.view(FP8),
                              bc.h1_sf, bc.row_weight, self.h1_sf_w, block_m=bc.block_m)

    def l2(self, lo_index: int, hi_index: int, max_items: int, fw, max_ctas: int | None = None) -> None:
        """L2 GEMM (routing weight folded into the scales) of the ready blocks into ``bc.y``."""
        bc = self.bc
        self.gemm2.run(bc.ready_list, bc.ready_hi, lo_index, hi_index, max_items, bc.block_expert, bc.h1.view(FP8),
                       self.h1_sf_w, fw.w2, self._w_sf("w2", fw.w2_sf, self.gemm2.sf_n), bc.y, block_m=bc.block_m,
                       max_ctas=max_ctas)

    def compute(self, lo_index: int, hi_index: int, max_items: int, fw, max_ctas: int | None = None) -> None:
        self.l1_swiglu(lo_index, hi_index, max_items, fw, max_ctas)
        self.l2(lo_index, hi_index, max_items, fw, max_ctas)

    def check(self) -> None:
        """Raise if any run met a bad ready range (synchronises)."""
        self.gemm1.check()
        self.gemm2.check()
