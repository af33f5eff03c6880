"""Triton kernels of the block-granular FP8 MoE consumer: the dispatch copy, the expert GEMMs over ready
blocks, the combine and the CUTLASS path's SwiGLU kernel. The producer's kernels (router logits, the routing
rule, the activations' FP8 quantization) are ``streamring.device.producer_triton``'s, importable from here too.

Device code only: every function here launches one kernel on the current torch stream and
returns at once (no host synchronisation), so a whole forward can be captured in one CUDA
graph. The block bookkeeping (which expert owns which block of rows, which blocks are ready) is
``streamring.device.block_alloc``'s; its state lives in small int32 device tensors owned by the caller
(``streamring.moe.blocks``).

Numerics (the contract the tests check):

* Activations: float8_e4m3fn with one float32 scale per token per 128 columns
  (``x_sf = max(amax, 1e-12) / 448``), exactly as the ring carries them.
* Weights: float8_e4m3fn with one float32 scale per 128x128 block.
* L1 (gate and up, one 128-column tile of each), SwiGLU ``silu(g) * u`` in float32, then the
  128-column group of ``h`` is re-quantized to FP8 with its own per-row scale (fused epilogue).
* L2 multiplies by the token's routing weight in the epilogue and stores bfloat16 ``Y`` per
  (token, k) row; :func:`combine` sums the k rows of a token in the fixed order k = 0..K-1.
* Every GEMM row's result depends only on that row's data and the expert's weights (the
  K loop order is fixed, rows are independent in the MMA), so the streamed and the batch
  path produce **bitwise identical** outputs when the rows of each expert are appended in the
  same (token) order - which the block allocator guarantees.

Grid order of the GEMMs: consecutive programs take *different blocks* with the *same* weight
tile (``GROUP`` blocks per group), so CTAs running together share each weight tile through
L2 instead of re-reading it from HBM once per block.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# (absolute imports: tests/helpers/ptx_queue.py loads this file alone)
from streamring.device.gemm_grid import GROUP_BLOCKS, TAIL_CTAS_PER_SM, grid_blocks
# the FP8 rule of the activations, which the L1 epilogue and the SwiGLU kernel below share with the producer;
# the producer's kernels are reached through this module too (the MoE layer, bench/, the PTX check)
from streamring.device.producer_triton import (  # noqa: F401
    ROUTER_LOGITS_LAUNCH, SELECT_EXPERTS_LAUNCH, _quant_fp8_rows, _quant_rows_kernel, quant_rows, router_logits,
    select_experts)


# ----------------------------------------------------------------------------------------------
# the dispatch copy (the block bookkeeping it follows: ``streamring.device.block_alloc``)
# ----------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["token_base"])
def _place_rows_kernel(sorted_e_ptr, order_ptr, counts_ptr, cstart_ptr, state_ptr, expert_blocks_ptr,
                       xq_ptr, xsf_ptr, tw_ptr, a_ptr, asf_ptr, roww_ptr, tokrow_ptr, token_base,
                       K: tl.constexpr, H: tl.constexpr, SFC: tl.constexpr, SFCP: tl.constexpr,
                       BM: tl.constexpr, MAXB: tl.constexpr, BH: tl.constexpr):
    i = tl.program_id(0)
    e = tl.load(sorted_e_ptr + i).to(tl.int32)
    f = tl.load(order_ptr + i).to(tl.int32)
    tok = f // K
    k = f % K
    rank = i - tl.load(cstart_ptr + e)
    # state holds the fill *after* this chunk's allocation: this chunk's rows of e start at fill - count
    pos = tl.load(state_ptr + e) - tl.load(counts_ptr + e) + rank
    bid = tl.load(expert_blocks_ptr + e * MAXB + pos // BM)
    row = (bid * BM + pos % BM).to(tl.int64)
    tok64 = tok.to(tl.int64)
    hh = tl.arange(0, BH)
    for h0 in range(0, H, BH):
        v = tl.load(xq_ptr + tok64 * H + h0 + hh)
        tl.store(a_ptr + row * H + h0 + hh, v)
    ss = tl.arange(0, SFCP)
    sv = tl.load(xsf_ptr + tok64 * SFC + ss, mask=ss < SFC)
    tl.store(asf_ptr + row * SFC + ss, sv, mask=ss < SFC)
    tl.store(roww_ptr + row, tl.load(tw_ptr + f))
    tl.store(tokrow_ptr + (token_base + tok64) * K + k, row)


def place_rows(sorted_e, order, counts, cstart, state, expert_blocks, xq_u8, xsf, topk_w, a_u8, asf, roww,
               tokrow, token_base: int, *, topk: int, block_m: int) -> None:
    """Copy each (token, k) of one chunk into its expert block row (the dispatch)."""
    n = sorted_e.shape[0]
    if n == 0:
        return
    h = xq_u8.shape[1]
    sfc = xsf.shape[1]
    bh = 1024 if h % 1024 == 0 else 128
    _place_rows_kernel[(n,)](sorted_e, order, counts, cstart, state, expert_blocks, xq_u8, xsf, topk_w, a_u8,
                             asf, roww, tokrow, token_base, K=topk, H=h, SFC=sfc,
                             SFCP=triton.next_power_of_2(sfc), BM=block_m, MAXB=expert_blocks.shape[1], BH=bh,
                             num_warps=4)


# ----------------------------------------------------------------------------------------------
# expert GEMMs over ready blocks
# ----------------------------------------------------------------------------------------------
@triton.jit
def _tile_of(pid, NT: tl.constexpr, GROUP: tl.constexpr, n_items):
    # programs [g*GROUP*NT, (g+1)*GROUP*NT) cover blocks [g*GROUP, (g+1)*GROUP) x all NT tiles,
    # blocks varying fastest: CTAs running together read the same weight tile.
    per_group = GROUP * NT
    g = pid // per_group
    r = pid % per_group
    first = g * GROUP
    gsize = tl.minimum(n_items - first, GROUP)
    gsize = tl.maximum(gsize, 1)
    return first + r % gsize, r // gsize, r < gsize * NT


@triton.jit
def _l1_tile(i, nt, lo, ready_list_ptr, block_expert_ptr, a_ptr, asf_ptr, w1_ptr, w1sf_ptr, h1_ptr, h1sf_ptr,
             H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, STAGES: tl.constexpr):
    BN: tl.constexpr = 128
    BK: tl.constexpr = 128
    NT: tl.constexpr = I // BN
    KS: tl.constexpr = H // BK
    bid = tl.load(ready_list_ptr + lo + i)
    e = tl.load(block_expert_ptr + bid).to(tl.int64)
    rows = bid.to(tl.int64) * BM + tl.arange(0, BM)
    kk = tl.arange(0, BK)
    ncol = nt * BN + tl.arange(0, BN)
    w_e = w1_ptr + e * (2 * I * H)
    s_e = w1sf_ptr + e * (2 * NT * KS)
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for ks in tl.range(0, KS, num_stages=STAGES):
        a = tl.load(a_ptr + rows[:, None] * H + ks * BK + kk[None, :])
        a_s = tl.load(asf_ptr + rows * KS + ks)
        wg = tl.load(w_e + ncol.to(tl.int64)[:, None] * H + ks * BK + kk[None, :])
        wu = tl.load(w_e + (I + ncol).to(tl.int64)[:, None] * H + ks * BK + kk[None, :])
        sg = tl.load(s_e + nt * KS + ks)
        su = tl.load(s_e + (NT + nt) * KS + ks)
        acc_g += tl.dot(a, tl.trans(wg)) * (a_s[:, None] * sg)
        acc_u += tl.dot(a, tl.trans(wu)) * (a_s[:, None] * su)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    q, s = _quant_fp8_rows(h)
    tl.store(h1_ptr + rows[:, None] * I + ncol[None, :], q)
    tl.store(h1sf_ptr + rows * NT + nt, s)


@triton.jit
def _l2_rows(i, nt, lo, ready_list_ptr, block_expert_ptr, h1_ptr, h1sf_ptr, w2_ptr, w2sf_ptr, roww_ptr, used,
             H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, STAGES: tl.constexpr):
    # L2 of one 128-column tile of ready block ``ready_list[lo + i]``, times the routing weight:
    # returns the bf16 tile and its rows / columns (stored by _l2_store). Only the block's first
    # ``used`` rows of h1 are read (the others enter the MMA as zeros: a row's result depends on its
    # own h1 row alone, so the used rows' bits are those of an unmasked read).
    BN: tl.constexpr = 128
    BK: tl.constexpr = 128
    NT: tl.constexpr = H // BN
    KS: tl.constexpr = I // BK
    bid = tl.load(ready_list_ptr + lo + i)
    e = tl.load(block_expert_ptr + bid).to(tl.int64)
    rows = bid.to(tl.int64) * BM + tl.arange(0, BM)
    kk = tl.arange(0, BK)
    ncol = nt * BN + tl.arange(0, BN)
    w_e = w2_ptr + e * (H * I)
    s_e = w2sf_ptr + e * (NT * KS)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    row_used = (tl.arange(0, BM) < used)[:, None]
    for ks in tl.range(0, KS, num_stages=STAGES):
        a = tl.load(h1_ptr + rows[:, None] * I + ks * BK + kk[None, :], mask=row_used, other=0.0)
        a_s = tl.load(h1sf_ptr + rows * KS + ks)
        w = tl.load(w_e + ncol.to(tl.int64)[:, None] * I + ks * BK + kk[None, :])
        ws = tl.load(s_e + nt * KS + ks)
        acc += tl.dot(a, tl.trans(w)) * (a_s[:, None] * ws)
    rw = tl.load(roww_ptr + rows)
    y = (acc * rw[:, None]).to(tl.bfloat16)
    return y, rows, ncol


@triton.jit
def _l2_store(y, rows, ncol, used, y_ptr, row_src_ptr, row_tok_ptr, comb_delta_ptr, H: tl.constexpr, BM: tl.constexpr,
              DIRECT: tl.constexpr):
    # DIRECT: ``used`` is not read (row_src < 0 marks the padding rows)
    if DIRECT:
        # straight into the owner's combine rows (P2P): owner = row_src, combine row = row_tok;
        # padding rows of a sealed partial block (row_src < 0) are not stored anywhere
        rs = tl.load(row_src_ptr + rows)
        rt = tl.load(row_tok_ptr + rows)
        dd = tl.load(comb_delta_ptr + tl.maximum(rs, 0))
        dst = y_ptr + dd[:, None] + rt[:, None] * H + ncol[None, :]
        tl.store(dst, y, mask=(rs >= 0)[:, None])
    else:
        # the rows past ``used`` (padding of a sealed partial block) are nobody's result: not stored
        # (at 1024 tokens with 64-row blocks that is half the rows: 117 MB of a 3.9 GB GEMM)
        tl.store(y_ptr + rows[:, None] * H + ncol[None, :], y, mask=(tl.arange(0, BM) < used)[:, None])


@triton.jit
def _gemm_tile(t, n_items, lo, ready_list_ptr, block_expert_ptr, x_ptr, xsf_ptr, w_ptr, wsf_ptr, out_ptr, outsf_ptr,
               roww_ptr, row_src_ptr, row_tok_ptr, comb_delta_ptr, block_rows_ptr, LAYER: tl.constexpr,
               NT: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, GROUP: tl.constexpr,
               STAGES: tl.constexpr, DIRECT: tl.constexpr):
    i, nt, ok = _tile_of(t, NT, GROUP, n_items)
    if (i < n_items) & ok:
        if LAYER == 1:
            _l1_tile(i, nt, lo, ready_list_ptr, block_expert_ptr, x_ptr, xsf_ptr, w_ptr, wsf_ptr, out_ptr, outsf_ptr,
                     H, I, BM, STAGES)
        else:
            used = tl.load(block_rows_ptr + tl.load(ready_list_ptr + lo + i))
            y, rows, ncol = _l2_rows(i, nt, lo, ready_list_ptr, block_expert_ptr, x_ptr, xsf_ptr, w_ptr, wsf_ptr,
                                     roww_ptr, used, H, I, BM, STAGES)
            _l2_store(y, rows, ncol, used, out_ptr, row_src_ptr, row_tok_ptr, comb_delta_ptr, H, BM, DIRECT)


@triton.jit
def _gemm_over_ready_tiles(ready_list_ptr, ready_hi_ptr, lo_index, hi_index, max_items, single_tiles, block_expert_ptr,
                           x_ptr, xsf_ptr, w_ptr, wsf_ptr, out_ptr, outsf_ptr, roww_ptr, row_src_ptr, row_tok_ptr,
                           comb_delta_ptr, block_rows_ptr, LAYER: tl.constexpr, NT: tl.constexpr,
                           H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, GROUP: tl.constexpr,
                           STAGES: tl.constexpr, PERSIST: tl.constexpr, DIRECT: tl.constexpr):
    # The tiles of L1 (LAYER 1: x = a, w = w1, out = h1 + scales) or L2 (LAYER 2: x = h1, w = w2, out = y or
    # the owners' combine rows) over the ready blocks ready_list[ready_hi[lo_index] : ready_hi[hi_index]].
    lo = tl.load(ready_hi_ptr + lo_index)
    hi = tl.load(ready_hi_ptr + hi_index)
    n_items = tl.minimum(hi - lo, max_items)
    if PERSIST:
        # CTA p < single_tiles computes tile p (one CTA per tile, as without PERSIST); the CTAs past them loop
        # over the remaining tiles. single_tiles 0: a fixed grid (fewer CTAs than the GPU holds) looping over
        # every tile, SM slots left to other streams' kernels; single_tiles > 0: the tiles of the blocks the
        # call is expected to have, and a small looping tail for any beyond them (see _grid)
        pid = tl.program_id(0)
        if pid < single_tiles:
            _gemm_tile(pid, n_items, lo, ready_list_ptr, block_expert_ptr, x_ptr, xsf_ptr, w_ptr, wsf_ptr, out_ptr,
                       outsf_ptr, roww_ptr, row_src_ptr, row_tok_ptr, comb_delta_ptr, block_rows_ptr, LAYER, NT, H,
                       I, BM, GROUP, STAGES, DIRECT)
        else:
            total = tl.cdiv(n_items, GROUP) * GROUP * NT
            stride = tl.num_programs(0) - single_tiles
            t = pid
            while t < total:  # (a while loop: the CPU interpreter cannot range() over loaded values)
                _gemm_tile(t, n_items, lo, ready_list_ptr, block_expert_ptr, x_ptr, xsf_ptr, w_ptr, wsf_ptr,
                           out_ptr, outsf_ptr, roww_ptr, row_src_ptr, row_tok_ptr, comb_delta_ptr, block_rows_ptr,
                           LAYER, NT, H, I, BM, GROUP, STAGES, DIRECT)
                t += stride
    else:
        _gemm_tile(tl.program_id(0), n_items, lo, ready_list_ptr, block_expert_ptr, x_ptr, xsf_ptr, w_ptr, wsf_ptr,
                   out_ptr, outsf_ptr, roww_ptr, row_src_ptr, row_tok_ptr, comb_delta_ptr, block_rows_ptr, LAYER,
                   NT, H, I, BM, GROUP, STAGES, DIRECT)


@triton.jit(do_not_specialize=["lo_index", "hi_index", "max_items", "single_tiles"])
def _l1_swiglu_kernel(ready_list_ptr, ready_hi_ptr, lo_index, hi_index, max_items, single_tiles, block_expert_ptr,
                      a_ptr, asf_ptr, w1_ptr, w1sf_ptr, h1_ptr, h1sf_ptr, H: tl.constexpr, I: tl.constexpr,
                      BM: tl.constexpr, GROUP: tl.constexpr, STAGES: tl.constexpr, PERSIST: tl.constexpr):
    # (h1sf_ptr stands in for L2's pointers, unused by LAYER 1)
    _gemm_over_ready_tiles(ready_list_ptr, ready_hi_ptr, lo_index, hi_index, max_items, single_tiles,
                           block_expert_ptr, a_ptr, asf_ptr, w1_ptr, w1sf_ptr, h1_ptr, h1sf_ptr, h1sf_ptr, h1sf_ptr,
                           h1sf_ptr, h1sf_ptr, h1sf_ptr, 1, I // 128, H, I, BM, GROUP, STAGES, PERSIST, False)


@triton.jit(do_not_specialize=["lo_index", "hi_index", "max_items", "single_tiles"])
def _l2_kernel(ready_list_ptr, ready_hi_ptr, lo_index, hi_index, max_items, single_tiles, block_expert_ptr, h1_ptr,
               h1sf_ptr, w2_ptr, w2sf_ptr, roww_ptr, y_ptr, row_src_ptr, row_tok_ptr, comb_delta_ptr, block_rows_ptr,
               H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, GROUP: tl.constexpr, STAGES: tl.constexpr,
               PERSIST: tl.constexpr, DIRECT: tl.constexpr):
    # (y_ptr stands in for L1's output scales, unused by LAYER 2)
    _gemm_over_ready_tiles(ready_list_ptr, ready_hi_ptr, lo_index, hi_index, max_items, single_tiles,
                           block_expert_ptr, h1_ptr, h1sf_ptr, w2_ptr, w2sf_ptr, y_ptr, y_ptr, roww_ptr, row_src_ptr,
                           row_tok_ptr, comb_delta_ptr, block_rows_ptr, 2, H // 128, H, I, BM, GROUP, STAGES,
                           PERSIST, DIRECT)


#: The expert GEMMs' launch: per GEMM, per block_m (the entry with the largest block_m at most the
#: buffer's), measured on one H200 by ``bench.triton_gemm_launch`` (docs/results/triton-gemm-launch-*.json).
#: STAGES: the K loop's software pipeline depth (cp.async ring in shared memory, tl.range(num_stages=...));
#: 5 stages of a 128-row L1 tile do not fit in shared memory. One launch per (GEMM, block_m) serves the
#: batch and the streamed path alike, and a launch changes no arithmetic (the benchmark checks the bits).
GEMM_LAUNCH = {
    "l1": {128: {"num_warps": 8, "STAGES": 4}, 64: {"num_warps": 8, "STAGES": 5}, 32: {"num_warps": 4, "STAGES": 4},
           16: {"num_warps": 4, "STAGES": 5}},
    "l2": {128: {"num_warps": 8, "STAGES": 4}, 64: {"num_warps": 4, "STAGES": 4}, 32: {"num_warps": 4, "STAGES": 4},
           16: {"num_warps": 4, "STAGES": 6}},
    # the persistent consumer's one kernel runs both GEMMs with one launch (streamring.device.persistent_moe)
    "persistent": {64: {"num_warps": 8, "STAGES": 3}, 0: {"num_warps": 4, "STAGES": 4}},
}


def _gemm_cfg(block_m: int, launch: dict | None = None, gemm: str = "l1") -> dict:
    if launch is not None:
        return {"num_warps": launch["num_warps"], "STAGES": launch["STAGES"]}
    table = GEMM_LAUNCH[gemm]
    return dict(table[max((k for k in table if k <= block_m), default=min(table))])


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count  # an MPS client: its share


def tail_ctas(device: torch.device) -> int:
    """The looping tail of a grid launched with ``expect_items`` on ``device``: ``TAIL_CTAS_PER_SM`` per SM the
    process sees (the CPU interpreter: as if one SM)."""
    return TAIL_CTAS_PER_SM * (_sm_count(device.index if device.index is not None else torch.cuda.current_device())
                               if device.type == "cuda" else 1)


def _grid(max_items: int, group: int, nt: int, max_ctas: int | None, expect_items: int | None,
          device: torch.device) -> tuple[tuple[int], dict, int]:
    """(grid, constexprs, single_tiles) of a GEMM over at most ``max_items`` ready blocks of ``nt`` tiles each.

    * ``max_ctas`` below the tiles: ``max_ctas`` CTAs looping over every tile (an SM-sparing persistent grid);
    * else ``expect_items``: one CTA per tile of the first ``gemm_grid.grid_blocks(expect_items, ...)``
      blocks (the expectation rounded up to the tile order's groups) and a tail of :func:`tail_ctas` CTAs
      looping over the tiles past them, so a call launches CTAs for the blocks it is expected to have, not for every block its bound allows (a CTA past the ready
      blocks still costs its launch, about 11 SM-us per block of tiles); blocks past the expectation run on
      the tail, about 5 % slower;
    * else (or when the tail would not launch fewer CTAs): one CTA per tile of ``max_items`` blocks.

    Every form computes each tile in the same CTA code (the same bits)."""
    tiles = triton.cdiv(max_items, group) * group * nt
    if max_ctas is not None and max_ctas < tiles:
        return (max(1, int(max_ctas)),), {"PERSIST": True}, 0
    if expect_items is not None:
        single = grid_blocks(int(expect_items), max_items, group) * nt
        tail = tail_ctas(device)
        if single + tail < tiles:
            return (single + tail,), {"PERSIST": True}, single
    return (tiles,), {"PERSIST": False}, tiles


def expert_l1(ready_list, ready_hi, lo_index: int, hi_index: int, max_items: int, block_expert, a, asf, w1, w1sf, h1,
              h1sf, *, block_m: int, group: int = GROUP_BLOCKS, max_ctas: int | None = None,
              expect_items: int | None = None, launch: dict | None = None):
    """L1 + SwiGLU + FP8 re-quantization of the ready blocks
    ``ready_list[ready_hi[lo_index] : ready_hi[hi_index]]``.

    The range is read on the device (the launch needs no host sync); ``max_items`` bounds the
    launch grid (``hi - lo`` must not exceed it); ``expect_items``, the blocks the call is expected to have, sizes
    it for those (:func:`_grid`), ``max_ctas`` caps it. Returns Triton's compiled-kernel handle
    (registers, shared memory: for occupancy reports). ``launch``: ``{"num_warps", "STAGES"}`` instead
    of :data:`GEMM_LAUNCH`'s (for the benchmark that measures them).
    """
    if max_items <= 0:
        return None
    e, two_i, h = w1.shape
    i = two_i // 2
    nt = i // 128
    grid, persist, single = _grid(max_items, group, nt, max_ctas, expect_items, a.device)
    return _l1_swiglu_kernel[grid](ready_list, ready_hi, lo_index, hi_index, max_items, single, block_expert, a, asf,
                                   w1, w1sf, h1, h1sf, H=h, I=i, BM=block_m, GROUP=group,
                                   **_gemm_cfg(block_m, launch), **persist)


def expert_l2(ready_list, ready_hi, lo_index: int, hi_index: int, max_items: int, block_expert, h1, h1sf, w2, w2sf,
              roww, y, block_rows, *, block_m: int, group: int = GROUP_BLOCKS,
              max_ctas: int | None = None, expect_items: int | None = None, direct=None, launch: dict | None = None):
    """L2 of the ready blocks, times the routing weight, as bf16 rows (returns the kernel handle).

    Of block ``b`` only the first ``block_rows[b]`` rows hold a route (see
    :func:`streamring.device.block_alloc.alloc_blocks`): the ``h1`` rows of the others (the padding of a sealed
    partial block) are not read (their scales and routing weights are), and their results are not stored.
    ``direct=None``: row ``r`` goes to ``y[r]``. ``direct=(row_src, row_tok, comb_delta)``: row ``r``
    goes straight into its owner's combine rows, ``y + comb_delta[row_src[r]] + row_tok[r] * H``
    (``y`` is then this PE's combine rows, ``comb_delta`` int64 element distances to each PE's copy);
    rows with ``row_src < 0`` (padding of a sealed block) are not stored. ``expect_items``, ``max_ctas`` and
    ``launch``: as :func:`expert_l1`'s.
    """
    if max_items <= 0:
        return None
    e, h, i = w2.shape
    nt = h // 128
    grid, persist, single = _grid(max_items, group, nt, max_ctas, expect_items, h1.device)
    if direct is None:
        row_src = row_tok = comb_delta = roww  # unused (DIRECT is a constexpr False)
    else:
        row_src, row_tok, comb_delta = direct
    return _l2_kernel[grid](ready_list, ready_hi, lo_index, hi_index, max_items, single, block_expert, h1, h1sf, w2,
                            w2sf, roww,
                            y, row_src, row_tok, comb_delta, block_rows, H=h, I=i, BM=block_m, GROUP=group, **_gemm_cfg(block_m, launch, "l2"),
                            **persist, DIRECT=direct is not None)


@triton.jit
def _combine_kernel(tokrow_ptr, y_ptr, out_ptr, H: tl.constexpr, K: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    cols = hb * BH + tl.arange(0, BH)
    acc = tl.zeros((BH,), dtype=tl.float32)
    for k in tl.static_range(K):
        r = tl.load(tokrow_ptr + t * K + k)
        acc += tl.load(y_ptr + r * H + cols).to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(tl.bfloat16))


def combine(tokrow, y, out, *, topk: int) -> None:
    """``out[t] = sum_k y[tokrow[t, k]]`` in the order k = 0..K-1 (bf16 out, fp32 sum)."""
    t, h = out.shape
    if t == 0:
        return
    bh = 1024 if h % 1024 == 0 else 128
    _combine_kernel[(t, h // bh)](tokrow, y, out, H=h, K=topk, BH=bh, num_warps=4)


@triton.jit(do_not_specialize=["idx"])
def _stamp_kernel(ptr, idx):
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(ptr + idx, t)


def stamp(buf, idx: int) -> None:
    """Write the GPU %globaltimer (ns) into ``buf[idx]`` when the stream reaches this point.
    Pass the whole buffer and an index (a sliced view would change the pointer's alignment
    and with it Triton's specialization)."""
    _stamp_kernel[(1,)](buf, idx, num_warps=1)


# ----------------------------------------------------------------------------------------------
# CUTLASS path helpers (streamring.gemm.cutlass computes the GEMMs; these kernels do the rest)
# ----------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["lo_index", "hi_index", "max_items"])
def _swiglu_quant_kernel(ready_list_ptr, ready_hi_ptr, lo_index, hi_index, max_items, gu_ptr, h1_ptr, h1sf_ptr,
                         roww_ptr, h1sfw_ptr, I: tl.constexpr, BM: tl.constexpr, RB: tl.constexpr):
    NT: tl.constexpr = I // 128
    pid = tl.program_id(0)
    i = pid // NT
    nt = pid % NT
    lo = tl.load(ready_hi_ptr + lo_index)
    hi = tl.load(ready_hi_ptr + hi_index)
    n_items = tl.minimum(hi - lo, max_items)
    if i < n_items:
        bid = tl.load(ready_list_ptr + lo + i)
        cols = nt * 128 + tl.arange(0, 128)
        for r0 in tl.static_range(0, BM, RB):  # RB rows at a time: the tile stays in registers
            rows = bid.to(tl.int64) * BM + r0 + tl.arange(0, RB)
            g = tl.load(gu_ptr + rows[:, None] * (2 * I) + cols[None, :]).to(tl.float32)
            u = tl.load(gu_ptr + rows[:, None] * (2 * I) + I + cols[None, :]).to(tl.float32)
            # exactly the fused epilogue of _l1_tile: SwiGLU in float32, per-row 128-column FP8 group
            h = g / (1.0 + tl.exp(-g)) * u
            q, s = _quant_fp8_rows(h)
            tl.store(h1_ptr + rows[:, None] * I + cols[None, :], q)
            tl.store(h1sf_ptr + rows * NT + nt, s)
            # the routing weight, folded into L2's activation scales: L2 = sum_k (q . w) * (s * rw) * w_sf
            # gives the weighted row in one rounding to bf16, as the Triton L2's epilogue multiply does
            rw = tl.load(roww_ptr + rows)
            tl.store(h1sfw_ptr + rows * NT + nt, s * rw)


def swiglu_quant_blocks(ready_list, ready_hi, lo_index: int, hi_index: int, max_items: int, gu, h1, h1sf, roww, h1sf_w,
                        *, block_m: int) -> None:
    """SwiGLU + FP8 re-quantization of the ready blocks' L1 output (the CUTLASS path's L1 epilogue).

    ``gu [rows, 2I]`` (float32 or bfloat16: gate columns ``[0, I)``, up ``[I, 2I)``) ->
    ``h1 [rows, I]`` float8_e4m3fn and ``h1sf [rows, I/128]`` exactly as the fused Triton L1 epilogue
    computes them from its accumulators, plus ``h1sf_w = h1sf * roww[row]`` (L2's activation scales
    with the routing weight folded in). Only the rows of the blocks
    ``ready_list[ready_hi[lo_index] : ready_hi[hi_index]]`` (at most ``max_items``) are touched; the
    range is read on the device.
    """
    if max_items <= 0:
        return
    two_i = gu.shape[1]
    i = two_i // 2
    if two_i % 256 or h1.shape[1] != i or h1sf.shape[1] != i // 128 or h1sf_w.shape != h1sf.shape:
        raise ValueError(f"swiglu_quant_blocks: gu {tuple(gu.shape)}, h1 {tuple(h1.shape)}, h1sf {tuple(h1sf.shape)}, "
                         f"h1sf_w {tuple(h1sf_w.shape)} do not fit [rows, 2I] -> [rows, I], [rows, I/128]")
    _swiglu_quant_kernel[(max_items * (i // 128),)](ready_list, ready_hi, lo_index, hi_index, max_items, gu, h1, h1sf,
                                                    roww, h1sf_w, I=i, BM=block_m, RB=min(block_m, 32),
                                                    num_warps=4)
