"""The Triton expert GEMMs behind the backend interface (:mod:`streamring.gemm.backends`).

The kernels live in :mod:`streamring.device.moe_triton` (the persistent consumer kernel is built from the
same tile functions, and device may not import gemm); this adapter launches them over a block consumer's
buffers. L1 writes FP8 ``h1`` with its 1x128 scales (SwiGLU and requantisation in the epilogue), L2 the
bf16 rows times their routing weights, rounded once.
"""

from __future__ import annotations

import torch

from ..device import moe_triton as K
from .backends import Capabilities, GemmBackend, register_backend

FP8 = torch.float8_e4m3fn


@register_backend
class TritonExperts(GemmBackend):
    """The Triton L1 + SwiGLU and L2 kernels over one :class:`~streamring.moe.blocks.BlockConsumer`
    (no buffers of its own: ``h1`` and its scales are the consumer's). Runs wherever Triton runs, so the rule
    where nothing is measured takes it when no backend ranked before it is available."""

    name = "triton"
    capabilities = Capabilities(max_ctas=True, owner_rows=True, persistent=True)
    title = "the Triton GEMMs"
    fallback_rank = 1

    def __init__(self, bc):
        self.bc = bc

    def compute(self, lo_index: int, hi_index: int, max_items: int, fw, *, max_ctas: int | None = None,
                expect_items: int | None = None, out=None, direct=None) -> None:
        """L1 + SwiGLU and L2 of the ready blocks (module :mod:`~streamring.gemm.backends`).

        ``max_ctas``: a persistent grid of at most this many CTAs looping over the tiles (leaves SM slots
        to other streams); None: one CTA per tile, of the ``expect_items`` blocks the call is expected to have
        and a small looping tail for the rest, or of every block up to ``max_items`` (``moe_triton._grid``).
        ``out``/``direct``: where L2 stores (default the local ``y``; ``direct=(row_src, row_tok, comb_delta)``
        with ``out`` = this PE's combine rows: straight into each row's owner, see ``moe_triton.expert_l2``).
        The launched kernels join ``bc.gemm_kernels`` (graph node priorities leave them at the default)."""
        bc = self.bc
        h1 = bc.h1.view(FP8)
        k1 = K.expert_l1(bc.ready_list, bc.ready_hi, lo_index, hi_index, max_items, bc.block_expert, bc.a.view(FP8),
                         bc.a_sf, fw.w1, fw.w1_sf, h1, bc.h1_sf, block_m=bc.block_m, max_ctas=max_ctas,
                         expect_items=expect_items)
        k2 = K.expert_l2(bc.ready_list, bc.ready_hi, lo_index, hi_index, max_items, bc.block_expert, h1, bc.h1_sf,
                         fw.w2, fw.w2_sf, bc.row_weight, bc.y if out is None else out, bc.block_rows,
                         block_m=bc.block_m, max_ctas=max_ctas, expect_items=expect_items,
                         direct=direct)
        bc.gemm_kernels.update(k for k in (k1, k2) if k is not None)

    def status(self) -> int:
        """0: the Triton kernels bound every ready range by ``max_items`` and record no status."""
        return 0

    @classmethod
    def fallback_variant(cls, rows_per_expert: float) -> tuple:
        return {}, "the Triton GEMMs (no backend ranked before them available)"
