"""The DeepGEMM backend of the expert GEMMs: DeepGEMM's grouped FP8 GEMM
(``deep_gemm.m_grouped_fp8_gemm_nt_contiguous``) over the block consumer's ready blocks (availability,
the ``m_indices`` of a ready range, the psum layout of a forward's only allocation, scale layouts, the
row copy) and :class:`DeepGemmExperts`, the block consumer's L1/L2 through it (``gemm_impl="deep_gemm"``,
the last section).

DeepGEMM (commit 54e2261, deep_gemm 2.6.1; built by ``launch/build_deep_gemm.sh``, see
``docs/deep_gemm.md``) computes, for an ``[M, K]`` FP8 ``a`` whose rows are grouped contiguously,
``d[r] = (a[r] ⊙ a_sf[r]) @ (b[g] ⊙ b_sf[g])^T`` with ``g = m_indices[r]``. What its sources say
(``deep_gemm/include/deep_gemm/scheduler/gemm.cuh``, ``impls/sm90_fp8_gemm_1d2d.cuh``,
``csrc/jit_kernels/heuristics/sm90.hpp``, ``csrc/apis/layout.hpp``), and what this module makes of it:

* **Tile M is 128** for the contiguous layout on SM90 (``block_m`` = the "mk alignment", 128, not
  settable from Python), and the expert of a tile is read from ``m_indices`` of the tile's first row:
  every 128-row tile must belong to one expert. The block consumer's blocks therefore must be 128 rows
  (:data:`BLOCK_M`); rows of a block share its expert (padding rows of a partial block included).
* **Rows with m_indices = -1**: the math warpgroups skip the MMAs of a 64-row half whose first row is
  -1, but the producer still loads the A rows and expert 0's weight tiles (``max(0, -1)``), and the
  epilogue still **stores the tile: zeros**. So -1 rows cost loads and stores, and their rows of ``d``
  are overwritten with 0 - a caller that needs rows outside the ready range kept must give DeepGEMM a
  scratch output and copy the ready rows (:func:`copy_ready_rows`).
* **The kernel configuration depends on M** (``get_best_config`` with ``expected_m = m``: block N,
  stages, cluster / multicast side), on N, K and the SM count. Every call of one consumer is over the
  whole buffer, ``max_blocks * 128`` rows (-1 outside the ready range): M never depends on how many
  blocks are ready. (Each row's K loop and scale promotion are then the same whatever the range;
  multicast on or off only changes who loads the same bytes.)
* **The psum layout** (``use_psum_layout=True``, :func:`psum_layout`) is another scheduler
  (``GemmType::MGroupedContiguousWithPsumLayout``) over the same M, N, K: it walks only the allocated
  experts' tiles, and its configuration is chosen with the same ``expected_m``. Each row's arithmetic
  (its K loop, the 128-column scale promotion, the bf16 rounding) does not depend on which scheduler
  handed out its tile, so the batch call (psum) and a stream's calls (``m_indices``) give equal rows.
  That rests on DeepGEMM's sources read at 54e2261 and on measurement (``tests/unit/test_deep_gemm.py``:
  streamed == batch bitwise with the batch call on the psum layout; ``bench.gemm`` checks the two
  calls bitwise on the DeepSeek-V3 shapes): a DeepGEMM upgrade must re-run those checks.
* **Scales**: ``b_sf`` ``[G, N/128, K/128]`` float32 contiguous is used as is; ``a_sf`` must be
  MN-major and TMA-aligned (``[M, K/128]`` with strides ``(1, align(M, 4))``), else DeepGEMM
  transposes it itself on every call (its ``get_mn_major_tma_aligned_tensor``: an allocation and a JIT
  kernel). :func:`mn_major_scales` allocates such a buffer once; the consumer copies its row-major
  scales into it per call (``M`` is a multiple of 128, so ``align(M, 4) = M``).
* The output must be bf16 (the contiguous SM90 path asserts it).

:func:`deep_gemm_available` never builds or installs anything; the ``m_indices`` builder is plain
torch (device-side, no host synchronisation, capturable in a CUDA graph) and is tested on CPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .backends import Capabilities, GemmBackend, refuse_unsupported, register_backend
# the status bits of a ready range are the CUTLASS path's (one definition, re-exported here)
from .cutlass import STATUS_BITS, status_text  # noqa: F401

#: rows of a block for ``gemm="deep_gemm"``: DeepGEMM's contiguous-layout tile M on SM90
BLOCK_M = 128
FP8 = torch.float8_e4m3fn

# ----------------------------------------------------------------------------------------------
# availability
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Availability:
    """``bool(a)``: whether ``deep_gemm`` can run here; ``a.reason``: why not, or what was found."""

    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


_cached: Availability | None = None


def cuda_home() -> str | None:
    """The CUDA toolkit DeepGEMM's JIT compiles with (``$CUDA_HOME``, ``$CUDA_PATH``, ``nvcc`` on PATH,
    ``/usr/local/cuda``), as ``deep_gemm._find_cuda_home`` looks for it; None if none has ``bin/nvcc``."""
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(str(Path(nvcc).resolve().parent.parent))
    cands.append("/usr/local/cuda")
    for c in cands:
        if c and (Path(c) / "bin" / "nvcc").is_file():
            return c
    return None


def deep_gemm_available(refresh: bool = False) -> Availability:
    """Whether ``import deep_gemm`` works and can run its SM90 grouped GEMM here. Builds nothing.

    False (with the reason) without a CUDA GPU, on a GPU other than sm_90, without the package
    (``launch/build_deep_gemm.sh`` builds it from the carried source), when its import fails, when
    it lacks ``m_grouped_fp8_gemm_nt_contiguous``, or without an nvcc for its JIT.
    """
    global _cached
    if _cached is not None and not refresh:
        return _cached
    _cached = _probe()
    return _cached


def _probe() -> Availability:
    if not torch.cuda.is_available():
        return Availability(False, "no CUDA GPU")
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return Availability(False, f"DeepGEMM's SM90 kernels need sm_90, this GPU is sm_{cap[0]}{cap[1]}")
    if importlib.util.find_spec("deep_gemm") is None:
        return Availability(False, "the deep_gemm package is not installed (launch/build_deep_gemm.sh builds it from "
                                   "the carried source: docs/deep_gemm.md)")
    home = cuda_home()
    if home is None:
        return Availability(False, "no nvcc for DeepGEMM's JIT (set CUDA_HOME to a CUDA toolkit with bin/nvcc)")
    os.environ.setdefault("CUDA_HOME", home)
    try:
        dg = importlib.import_module("deep_gemm")
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason, not a crash
        return Availability(False, f"import deep_gemm failed: {type(exc).__name__}: {str(exc)[:300]}")
    if not hasattr(dg, "m_grouped_fp8_gemm_nt_contiguous"):
        return Availability(False, f"deep_gemm {getattr(dg, '__version__', '?')} has no m_grouped_fp8_gemm_nt_contiguous")
    return Availability(True, f"deep_gemm {getattr(dg, '__version__', '?')} at {Path(dg.__file__).parent}, "
                              f"CUDA_HOME={home}")


def load():
    """The ``deep_gemm`` module; raises RuntimeError with the reason when it is not available."""
    a = deep_gemm_available()
    if not a:
        raise RuntimeError(f"gemm='deep_gemm' is not available: {a.reason}")
    return importlib.import_module("deep_gemm")


# ----------------------------------------------------------------------------------------------
# the ready range -> m_indices
# ----------------------------------------------------------------------------------------------
def check_block_m(block_m: int, field: str = "block_m") -> None:
    """DeepGEMM's contiguous layout needs blocks of exactly :data:`BLOCK_M` rows."""
    if block_m != BLOCK_M:
        raise ValueError(f"{field} must be {BLOCK_M} for gemm='deep_gemm' (DeepGEMM's contiguous layout reads one "
                         f"expert per 128-row tile), got {block_m}")


def ready_m_indices(ready_list: torch.Tensor, ready_hi: torch.Tensor, lo_index: int, hi_index: int, max_items: int,
                    block_expert: torch.Tensor, num_experts: int, block_m: int, out: torch.Tensor | None = None,
                    status: torch.Tensor | None = None) -> torch.Tensor:
    """``m_indices [num_blocks * block_m]`` int32: ``block_expert[b]`` on the rows of every block ``b`` of
    ``ready_list[ready_hi[lo_index] : ready_hi[hi_index]]`` (at most ``max_items`` of them), -1 elsewhere.

    The range is read on the device (torch ops only: no host synchronisation, capturable). The same
    rules as the CUTLASS setup kernel (``tests/helpers/ready_range_reference.py`` has both in plain Python): a range outside the list or
    negative computes nothing, a longer one is clamped to ``max_items``, an item whose block id or
    expert is out of range is skipped; each case ORs its bit (:data:`STATUS_BITS`) into ``status``
    (int32 ``[1]``) when given. ``out``: where to write (allocated otherwise).
    """
    num_blocks = block_expert.numel()
    dev = block_expert.device
    n_list = ready_list.numel()
    lo = ready_hi[lo_index].long()
    hi = ready_hi[hi_index].long()
    n = hi - lo
    outside = (n > 0) & ((lo < 0) | (hi > n_list))
    negative = n < 0
    n = torch.where(outside | negative, torch.zeros_like(n), n)
    clamped = n > max_items
    n = torch.clamp(n, max=max_items)
    pos = torch.arange(n_list, device=dev)
    in_range = (pos >= lo) & (pos < lo + n)
    ids = ready_list.long()
    bad_block = in_range & ((ids < 0) | (ids >= num_blocks))
    ids_c = ids.clamp(0, max(num_blocks - 1, 0))
    expert = block_expert.long()[ids_c]
    bad_expert = in_range & ~bad_block & ((expert < 0) | (expert >= num_experts))
    ok = in_range & ~bad_block & ~bad_expert
    # every item scatters into slot num_blocks (dropped) unless it is a good item of the range; equal
    # block ids carry equal experts, so duplicate indices write equal values (deterministic)
    target = torch.where(ok, ids_c, torch.full_like(ids_c, num_blocks))
    per_block = torch.full((num_blocks + 1,), -1, dtype=torch.long, device=dev)
    per_block.scatter_(0, target, torch.where(ok, expert, torch.full_like(expert, -1)))
    if out is None:
        out = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    elif out.dtype != torch.int32 or out.numel() != num_blocks * block_m or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int32 tensor of num_blocks*block_m = {num_blocks * block_m} "
                         f"elements, got {out.dtype} {tuple(out.shape)}")
    out.view(num_blocks, block_m).copy_(per_block[:num_blocks, None].expand(num_blocks, block_m))
    if status is not None:
        bits = (clamped.int() * 1 | negative.int() * 2 | bad_block.any().int() * 4 | bad_expert.any().int() * 8
                | outside.int() * 16)
        status.bitwise_or_(bits.to(status.dtype).reshape(1))
    return out


def psum_layout(state: torch.Tensor, expert_blocks: torch.Tensor, ready_hi: torch.Tensor, lo_index: int,
                hi_index: int, num_experts: int, block_m: int, out: torch.Tensor | None = None,
                status: torch.Tensor | None = None) -> torch.Tensor:
    """DeepGEMM's psum ``grouped_layout [num_experts]`` int32 of blocks laid out expert by expert:
    ``psum[e] = 128 * (blocks of experts < e) + rows of e``.

    With ``use_psum_layout=True`` DeepGEMM's scheduler walks expert ``e``'s tiles from
    ``align(psum[e-1], 128)`` to ``psum[e]`` and schedules nothing past the last expert's rows: the
    unused blocks at the end of the buffer (the worst-case capacity) cost no loads and no stores,
    unlike ``m_indices`` = -1 rows. It needs every expert's blocks contiguous, in expert order, and
    the call to cover every block: what one ``alloc_blocks`` call hands out
    (:meth:`~streamring.moe.blocks.BlockConsumer.covers_one_allocation` says when the host knows it).
    Checked on the device against the block table: ``expert_blocks[e, j] == start[e] + j`` for every
    allocated block, every allocated block ready and inside ``ready_hi[lo_index] : ready_hi[hi_index]``;
    otherwise the psum is all zeros (DeepGEMM computes nothing) and bit 32 is ORed into ``status``.

    ``state`` is the consumer's ``[E + 3]`` words (rows per expert, blocks allocated, blocks ready, sealed);
    ``block_m`` its block rows. DeepGEMM aligns each expert's start to 128 rows, so only a consumer of
    :data:`BLOCK_M`-row blocks may pass the result to it (``DeepGemmExperts`` requires that); other
    sizes are for tests of the layout rule. Torch ops only: no host synchronisation, capturable.
    """
    E = num_experts
    fill = state[:E].long()
    nb = (fill + block_m - 1) // block_m
    start = torch.cumsum(nb, 0) - nb
    j = torch.arange(expert_blocks.shape[1], device=expert_blocks.device)
    owned = j[None, :] < nb[:, None]
    misplaced = (owned & (expert_blocks.long() != start[:, None] + j[None, :])).any()
    allocated, ready = state[E].long(), state[E + 1].long()
    span = ready_hi[hi_index].long() - ready_hi[lo_index].long()
    bad = misplaced | (ready != allocated) | (span != allocated) | (nb.sum() != allocated)
    psum = torch.where(bad, torch.zeros_like(fill), start * block_m + fill)
    if out is None:
        out = torch.empty(E, dtype=torch.int32, device=state.device)
    elif out.dtype != torch.int32 or out.numel() != E or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int32 tensor of num_experts = {E} elements, got "
                         f"{out.dtype} {tuple(out.shape)}")
    out.copy_(psum)
    if status is not None:
        status.bitwise_or_((bad.int() * 32).to(status.dtype).reshape(1))
    return out


def grouped_gemm(dg, a, b, d, layout: torch.Tensor, psum: bool) -> None:
    """``d = a @ b^T`` per expert through ``dg.m_grouped_fp8_gemm_nt_contiguous``: ``layout`` is the psum
    layout (:func:`psum_layout`, ``psum=True``) or the ``m_indices`` of a ready range
    (:func:`ready_m_indices`). ``a``, ``b``: ``(fp8 tensor, float32 scales)`` pairs; ``d`` bf16."""
    if psum:
        dg.m_grouped_fp8_gemm_nt_contiguous(a, b, d, layout, use_psum_layout=True)
    else:
        dg.m_grouped_fp8_gemm_nt_contiguous(a, b, d, layout)


def mn_major_scales(rows: int, cols: int, device) -> torch.Tensor:
    """A ``[rows, cols]`` float32 buffer laid out MN-major (strides ``(1, rows)``), zeroed: what DeepGEMM
    takes as activation scales without transposing them (``rows`` must be a multiple of 4, TMA)."""
    if rows % 4:
        raise ValueError(f"rows must be a multiple of 4 (TMA alignment of MN-major scales), got {rows}")
    return torch.zeros(cols, rows, dtype=torch.float32, device=device).t()


# ----------------------------------------------------------------------------------------------
# copy the ready rows (a scratch output -> the consumer's y, rows elsewhere untouched)
# ----------------------------------------------------------------------------------------------
def copy_ready_rows(ready_list, ready_hi, lo_index: int, hi_index: int, max_items: int, src: torch.Tensor,
                    dst: torch.Tensor, *, block_m: int) -> None:
    """``dst[rows of b] = src[rows of b]`` for the blocks ``b`` of the ready range (read on the device);
    every other row of ``dst`` is left as it is. ``src``, ``dst``: ``[rows, H]`` of one dtype."""
    from . import deep_gemm_triton as T

    if src.shape != dst.shape or src.dtype != dst.dtype or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"src and dst must be contiguous and alike, got {src.dtype} {tuple(src.shape)} and "
                         f"{dst.dtype} {tuple(dst.shape)}")
    T.copy_ready_rows(ready_list, ready_hi, lo_index, hi_index, max_items, src, dst, block_m=block_m)

# ----------------------------------------------------------------------------------------------
# The block consumer's expert GEMMs through DeepGEMM (gemm_impl="deep_gemm")
# ----------------------------------------------------------------------------------------------
# Same contract as :class:`streamring.gemm.cutlass.CutlassExperts` (and the Triton path): L1 (gate and up),
# SwiGLU, FP8 re-quantization of ``h`` with per-row 128-column scales, L2 times the routing weight,
# bf16 ``y`` rows; only the ready blocks ``ready_list[ready_hi[lo] : ready_hi[hi]]`` are computed, the
# range is read on the device, everything runs on the current stream without host synchronisation.
#
# Per call (the module doc says what DeepGEMM wants and why):
#
# 1. ``m_indices`` of the ready range: the expert on the rows of every ready block, -1 elsewhere;
#    the activation scales copied into an MN-major buffer;
# 2. L1: ``deep_gemm.m_grouped_fp8_gemm_nt_contiguous`` over the whole block buffer
#    (``max_blocks * 128`` rows: the same kernel configuration whatever the range) into ``gu`` (bf16,
#    the only output DeepGEMM's contiguous path has). A call that covers the forward's only allocation
#    (the batch path: one dispatch, the seal, one call over every block;
#    :meth:`~streamring.moe.blocks.BlockConsumer.covers_one_allocation`) passes the psum layout instead
#    of ``m_indices`` (:func:`psum_layout`): DeepGEMM then schedules
#    only the allocated blocks, not the worst-case buffer's -1 rows, which it would load and store;
# 3. :func:`~streamring.device.moe_triton.swiglu_quant_blocks`: ``h1``, ``h1_sf``, and
#    ``h1_sf_w = h1_sf * routing weight`` (L2's activation scales), copied MN-major;
# 4. L2 with those scales: the routing weight is applied inside the scale promotion, ``y`` is rounded
#    to bf16 once. DeepGEMM writes zeros on every -1 row, so by default L2 goes into a scratch buffer
#    and only the ready blocks' rows are copied into ``y`` (``keep_rows_outside_range``); a caller whose
#    ``y`` is a staging buffer read right after each call (the expert-parallel layer, which puts the
#    range's rows to their owners at once) or that computes every block in one call (the batch path)
#    passes False and L2 writes ``y`` directly.
#
# Bitwise streamed == batch: DeepGEMM computes each row from that row's data and its expert's weights
# with a configuration fixed by (rows of the buffer, N, K, SMs), whichever layout (psum or ``m_indices``)
# schedules its tile (the module doc says what that rests on, and what re-checks it);
# the SwiGLU/quant kernel is row-local, the copy is exact.


@register_backend
class DeepGemmExperts(GemmBackend):
    """DeepGEMM buffers for one :class:`~streamring.moe.blocks.BlockConsumer` (allocated here, once): the
    ``deep_gemm`` backend of :mod:`streamring.gemm.backends`.

    ``psum``: let a call over the forward's only allocation pass the psum layout (module doc).
    Raises ValueError unless ``bc.block_m`` is 128 and RuntimeError (with the reason) when DeepGEMM
    is not available (:func:`deep_gemm_available`).
    """

    name = "deep_gemm"
    # DeepGEMM's SM90 FP8 GEMM kernels (JIT-compiled: sm90_fp8_gemm_1d2d_impl and its kin)
    capabilities = Capabilities(persistent_grid=True, kernel_names=("fp8_gemm",), block_sizes=(BLOCK_M,))
    title = "DeepGEMM"

    def __init__(self, bc, *, keep_rows_outside_range: bool = True, psum: bool = True):
        check_block_m(bc.block_m, "block_m (BlockConsumer.block_m, the plan's block_m)")
        self.dg = load()
        from ..device.moe_triton import swiglu_quant_blocks  # Triton only here: the module imports without it

        self._swiglu_quant = swiglu_quant_blocks
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
        self.a_sf_mn = mn_major_scales(rows, H // 128, dev)
        self.gu = torch.zeros(rows, 2 * I, dtype=torch.bfloat16, device=dev)
        self.h1_sf_w = torch.zeros(rows, I // 128, dtype=torch.float32, device=dev)
        self.h1_sf_w_mn = mn_major_scales(rows, I // 128, dev)
        self.y_scratch = (torch.zeros(rows, H, dtype=torch.bfloat16, device=dev)
                          if self.keep_rows_outside_range and bc.y is not None else None)

    def indices(self, lo_index: int, hi_index: int, max_items: int) -> None:
        """``m_indices`` of the ready range (bad ranges set bits of :attr:`status_word`)."""
        bc = self.bc
        ready_m_indices(bc.ready_list, bc.ready_hi, lo_index, hi_index, max_items, bc.block_expert,
                        bc.shape.num_experts, bc.block_m, out=self.m_indices, status=self.status_word)

    def build_psum_layout(self, lo_index: int, hi_index: int) -> None:
        """The psum layout of every allocated block (checked on the device: :attr:`status_word` bit 32)."""
        bc = self.bc
        psum_layout(bc.state, bc.expert_blocks, bc.ready_hi, lo_index, hi_index, bc.shape.num_experts,
                    bc.block_m, out=self.psum, status=self.status_word)

    def _grouped(self, a, b, d, psum: bool) -> None:
        grouped_gemm(self.dg, a, b, d, self.psum if psum else self.m_indices, psum)

    def l1_swiglu(self, lo_index: int, hi_index: int, max_items: int, fw, psum: bool = False) -> None:
        """L1 + SwiGLU/requant of the ready blocks (``m_indices`` must be current: :meth:`indices`; with
        ``psum``, :attr:`psum`: :meth:`build_psum_layout`)."""
        bc = self.bc
        self.a_sf_mn.copy_(bc.a_sf)
        self._grouped((bc.a.view(FP8), self.a_sf_mn), (fw.w1, fw.w1_sf), self.gu, psum)
        self._swiglu_quant(bc.ready_list, bc.ready_hi, lo_index, hi_index, max_items, self.gu, bc.h1.view(FP8),
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
            copy_ready_rows(bc.ready_list, bc.ready_hi, lo_index, hi_index, max_items, self.y_scratch, bc.y,
                            block_m=bc.block_m)

    def compute(self, lo_index: int, hi_index: int, max_items: int, fw, *, max_ctas: int | None = None,
                expect_items: int | None = None, out=None, direct=None) -> None:
        """L1 + SwiGLU/requant and L2 of the ready blocks into ``bc.y`` (:mod:`~streamring.gemm.backends`);
        ``max_ctas``, ``out`` and ``direct`` are refused (ValueError): DeepGEMM's grid and
        configuration follow the device's SM count (``expect_items`` is ignored for the same reason)."""
        refuse_unsupported(self.name, max_ctas=max_ctas, out=out, direct=direct)
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
            raise RuntimeError(f"DeepGemmExperts: status {s:#x}: {status_text(s)}")

    # -- what the measured choice asks (streamring.gemm.choice) -------------------------------------------
    @classmethod
    def probe(cls, block_m: int) -> str:
        a = deep_gemm_available()
        return "" if a else a.reason

    @classmethod
    def require(cls, block_m: int) -> None:
        check_block_m(block_m, "block_m")
        a = deep_gemm_available()
        if not a:
            raise RuntimeError(f"gemm='deep_gemm' is not available: {a.reason}")

    @classmethod
    def options(cls, choice, *, staging_y: bool) -> dict:
        """``staging_y``: the caller reads each range's rows right away, so DeepGEMM may overwrite the others."""
        return dict(keep_rows_outside_range=not staging_y)
