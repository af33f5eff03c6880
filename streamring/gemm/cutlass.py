"""The CUTLASS backend of the expert GEMMs: :class:`CutlassExperts`, the block consumer's L1/L2 through the FP8
blockwise grouped GEMM of :mod:`streamring.gemm.cutlass_lib` (``gemm_impl="cutlass"``), registered as
``cutlass`` in :mod:`streamring.gemm.backends`.

The library's names (the variant table, finding and loading the library, the argument checks,
:class:`~streamring.gemm.cutlass_lib.GroupedGemm` plans) are importable from here as well: the backend's users
(bench/, tests/, launch/) reach the library through this module.
"""

from __future__ import annotations

import torch

from .backends import Capabilities, GemmBackend, refuse_unsupported, register_backend
from .cutlass_lib import (  # noqa: F401 - the library's names, offered here too (see the module doc)
    BLOCK_TILE_ROWS, BLOCK_TILES, FP8, MAX_CTAS_PER_SM, NUM_VARIANTS, OUT_DTYPES, RASTERS, SF_BLOCK, SIGNATURES,
    STATUS_BITS, SWIZZLES, TILE_DOC, TILE_TABLE, TILES, GemmLibraryError, GemmLibraryMissing, GroupedGemm, RunShape,
    Tile, absent_text, candidate_libraries, check_run_args, library_info, library_path, load_library, notice_once,
    status_text, table_mismatches, variant_id, weight_scales_for)

# ----------------------------------------------------------------------------------------------
# The block consumer's expert GEMMs through CUTLASS (gemm_impl="cutlass")
# ----------------------------------------------------------------------------------------------
# Same contract as :meth:`streamring.moe.blocks.BlockConsumer.compute` (the Triton path): L1 (gate and
# up), SwiGLU, FP8 re-quantization of ``h`` with per-row 128-column scales, L2 times the routing weight,
# bf16 ``y`` rows; only the ready blocks ``ready_list[ready_hi[lo] : ready_hi[hi]]`` are computed, the
# range is read on the device, everything runs on the current stream without host synchronisation.
#
# Per call:
#
# 1. L1: :class:`GroupedGemm` ``gu = A @ W1^T`` (``[rows, 2I]``,
#    float32 by default: SwiGLU then sees fp32 accumulators as in the fused Triton epilogue; bf16 is
#    the option that halves the traffic of this intermediate);
# 2. :func:`~streamring.device.moe_triton.swiglu_quant_blocks`: ``h1``, ``h1_sf`` exactly as the Triton
#    epilogue, and ``h1_sf_w = h1_sf * routing weight`` (L2's activation scales);
# 3. L2: ``y = h1 @ W2^T`` with the scales ``h1_sf_w``: the routing weight is applied inside the
#    blockwise scale promotion, so ``y`` is rounded to bf16 once, like the Triton L2's epilogue.
#
# Bitwise streamed == batch holds as for the Triton path: the CUTLASS grouped GEMM computes each row
# from that row only (see ``csrc/gemm/gemm_blockwise_fp8.cu``), the SwiGLU/quant kernel is row-local.


#: how :meth:`CutlassExperts.probe` starts the reason of a library that is not built (none found)
NOT_BUILT = "CUTLASS library not built"
#: the swizzles a table key names after the raster (the default 1 is left out of the key)
KEY_SWIZZLES = tuple(s for s in SWIZZLES if s != 1)
#: where nothing is measured, the 64-row ping-pong tile below this many rows per expert (weight-read bound),
#: the 128x128 cooperative tile from it on (docs/results/gemm-cutlass-triton-vs-torch-128-32768-2026-11-30.json)
PINGPONG_BELOW_ROWS = 128


@register_backend
class CutlassExperts(GemmBackend):
    """CUTLASS plans and intermediates for one :class:`~streamring.moe.blocks.BlockConsumer`: the
    ``cutlass`` backend of :mod:`streamring.gemm.backends`.

    ``tile_l1`` / ``tile_l2``: keys of :data:`TILE_TABLE`;
    ``l1_out_dtype``: float32 or bfloat16 (the one-block tiles have bf16 only);
    ``raster_l1`` / ``raster_l2``: ``"m"`` or ``"n"`` and ``swizzle_l1`` / ``swizzle_l2``: 1, 2, 4 or 8
    (the group scheduler's tile order; neither changes a bit of the output). Allocates the L1
    output ``[rows, 2I]`` and the L2 scale buffer once, here. A tile that reads one weight scale per
    64 rows gets the weights' scales repeated (:func:`weight_scales_for`),
    made on first use and again whenever the scale tensor changes.
    """

    name = "cutlass"
    # cutlass::device_kernel<...GemmUniversal...>: the grouped and the one-block-tile kernels
    capabilities = Capabilities(max_ctas=True, persistent_grid=True, waves=True,
                                kernel_names=("cutlass13device_kernel",))
    title = "CUTLASS"
    fallback_rank = 0  # the rule where nothing is measured prefers it (measured faster before the table)

    def __init__(self, bc, *, tile_l1: str = "coop128", tile_l2: str = "coop128", l1_out_dtype=torch.float32,
                 trap_on_error: bool = True, raster_l1: str = "m", raster_l2: str = "m", swizzle_l1: int = 1,
                 swizzle_l2: int = 1):
        shape = bc.shape
        H, I = shape.hidden, shape.intermediate
        rows = bc.max_blocks * bc.block_m
        self.bc = bc
        from ..device.moe_triton import swiglu_quant_blocks  # Triton only here: the module imports without it

        self._swiglu_quant = swiglu_quant_blocks
        self.gemm1 = GroupedGemm(2 * I, H, out_dtype=l1_out_dtype, tile=tile_l1, capacity=bc.max_blocks,
                                 trap_on_error=trap_on_error, raster=raster_l1, swizzle=swizzle_l1)
        self.gemm2 = GroupedGemm(H, I, out_dtype=torch.bfloat16, tile=tile_l2, capacity=bc.max_blocks,
                                 trap_on_error=trap_on_error, raster=raster_l2, swizzle=swizzle_l2)
        self.gu = torch.zeros(rows, 2 * I, dtype=l1_out_dtype, device=bc.device)
        self.h1_sf_w = torch.zeros(rows, I // 128, dtype=torch.float32, device=bc.device)
        self._scales: dict = {}  # (which, sf_n) -> (key of the source tensor, repeated scales)

    def _w_sf(self, which: str, w_sf: torch.Tensor, sf_n: int) -> torch.Tensor:
        """``w_sf`` as a plan with ``sf_n`` reads it; the repeated copy is kept while the source tensor
        (its storage, shape and in-place version) stays the same. Call before a graph capture, like
        the first run (a change of weights inside a captured graph is not seen)."""
        if sf_n == SF_BLOCK:
            return w_sf
        key = (w_sf.data_ptr(), tuple(w_sf.shape), w_sf._version)
        hit = self._scales.get((which, sf_n))
        if hit is None or hit[0] != key:
            hit = (key, weight_scales_for(w_sf, sf_n))
            self._scales[(which, sf_n)] = hit
        return hit[1]

    def l1_swiglu(self, lo_index: int, hi_index: int, max_items: int, fw, max_ctas: int | None = None) -> None:
        """L1 GEMM + SwiGLU/requant of the ready blocks (into ``bc.h1``, ``bc.h1_sf``, ``h1_sf_w``)."""
        bc = self.bc
        self.gemm1.run(bc.ready_list, bc.ready_hi, lo_index, hi_index, max_items, bc.block_expert, bc.a.view(FP8),
                       bc.a_sf, fw.w1, self._w_sf("w1", fw.w1_sf, self.gemm1.sf_n), self.gu, block_m=bc.block_m,
                       max_ctas=max_ctas)
        self._swiglu_quant(bc.ready_list, bc.ready_hi, lo_index, hi_index, max_items, self.gu, bc.h1.view(FP8),
                           bc.h1_sf, bc.row_weight, self.h1_sf_w, block_m=bc.block_m)

    def l2(self, lo_index: int, hi_index: int, max_items: int, fw, max_ctas: int | None = None) -> None:
        """L2 GEMM (routing weight folded into the scales) of the ready blocks into ``bc.y``."""
        bc = self.bc
        self.gemm2.run(bc.ready_list, bc.ready_hi, lo_index, hi_index, max_items, bc.block_expert, bc.h1.view(FP8),
                       self.h1_sf_w, fw.w2, self._w_sf("w2", fw.w2_sf, self.gemm2.sf_n), bc.y, block_m=bc.block_m,
                       max_ctas=max_ctas)

    def compute(self, lo_index: int, hi_index: int, max_items: int, fw, *, max_ctas: int | None = None,
                expect_items: int | None = None, out=None, direct=None) -> None:
        """L1 + SwiGLU/requant and L2 of the ready blocks into ``bc.y`` (:mod:`~streamring.gemm.backends`);
        ``max_ctas`` caps the persistent grids (``expect_items`` is not needed: they loop over the ready tiles);
        ``out`` and ``direct`` are refused (ValueError)."""
        refuse_unsupported(self.name, max_ctas=max_ctas, out=out, direct=direct)
        self.l1_swiglu(lo_index, hi_index, max_items, fw, max_ctas)
        self.l2(lo_index, hi_index, max_items, fw, max_ctas)

    def status(self) -> int:
        """Both plans' ready-range status bits so far (0: fine; synchronises; with ``trap_on_error`` a bad
        range traps the kernel instead)."""
        return self.gemm1.status() | self.gemm2.status()

    def check(self) -> None:
        """Raise if any run met a bad ready range (synchronises)."""
        self.gemm1.check()
        self.gemm2.check()

    # -- what the measured choice asks (streamring.gemm.choice) -------------------------------------------
    @classmethod
    def probe(cls, block_m: int) -> str:
        """"" when a library built from this source loads (never builds: :data:`NOT_BUILT` says it is absent)."""
        try:
            load_library(build=False)
            library_info()
            # the library loads without a GPU (it opens the driver only to run): it runs only where one is
            return "" if torch.cuda.is_available() else "CUTLASS library built, but no CUDA GPU here"
        except GemmLibraryMissing as exc:
            return f"{NOT_BUILT}: {str(exc)[:200]}"
        except Exception as exc:  # noqa: BLE001 - built for another source, cannot load, no GPU
            return f"CUTLASS library unavailable: {str(exc)[:200]}"

    @classmethod
    def left_out(cls, reason: str, instead: str) -> None:
        if reason.startswith(NOT_BUILT):
            notice_once("gemm-auto-absent", absent_text(
                f"gemm='auto' runs {instead} instead (no build starts inside a run)"))

    @classmethod
    def options(cls, choice, *, staging_y: bool) -> dict:
        out = {"bf16": torch.bfloat16, "f32": torch.float32}[choice.l1.out or "bf16"]
        return dict(tile_l1=choice.l1.tile, tile_l2=choice.l2.tile, l1_out_dtype=out, raster_l1=choice.l1.raster,
                    raster_l2=choice.l2.raster, swizzle_l1=choice.l1.swizzle, swizzle_l2=choice.l2.swizzle)

    @classmethod
    def variant_key(cls, choice) -> str:
        """``cutlass:<tile>:<out>:<raster>``, with ``:s<swizzle>`` appended when the swizzle is not 1."""
        if choice.swizzle != 1 and choice.swizzle not in KEY_SWIZZLES:
            raise ValueError(f"swizzle must be 1 or one of {KEY_SWIZZLES}, got {choice.swizzle!r}")
        return (f"cutlass:{choice.tile}:{choice.out or 'bf16'}:{choice.raster}"
                + (f":s{choice.swizzle}" if choice.swizzle != 1 else ""))

    @classmethod
    def parse_variant(cls, fields: list):
        swizzles = {f"s{s}": s for s in KEY_SWIZZLES}
        swizzle = 1 if len(fields) == 3 else swizzles.get(fields[3]) if len(fields) == 4 else None
        if swizzle is None or fields[1] not in ("bf16", "f32") or fields[2] not in RASTERS:
            return None
        return dict(tile=fields[0], out=fields[1], raster=fields[2], swizzle=swizzle)

    @classmethod
    def key_form(cls) -> str:
        return "cutlass:<tile>:<bf16|f32>:<m|n>[:s<2|4|8>]"

    @classmethod
    def runs_variant(cls, choice, block_m) -> bool:
        """The one-block tiles take 128-row blocks only."""
        return choice.tile not in BLOCK_TILES or block_m == BLOCK_TILE_ROWS

    @classmethod
    def fallback_variant(cls, rows_per_expert: float) -> tuple:
        tile = "pingpong64" if rows_per_expert < PINGPONG_BELOW_ROWS else "coop128"
        return dict(tile=tile, out="bf16"), f"{tile} at {rows_per_expert:g} rows per expert"
