"""The Triton kernel of the DeepGEMM path (``gemm.deep_gemm``): copy the ready blocks' rows.

Kept apart from ``moe_triton`` (the Triton GEMM path's kernels) and from ``gemm.deep_gemm`` (which
imports without Triton). One launch on the current torch stream, the ready range read on the
device, nothing read back: capturable in a CUDA graph.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["lo_index", "hi_index", "max_items"])
def _copy_ready_rows_kernel(ready_list_ptr, ready_hi_ptr, lo_index, hi_index, max_items, src_ptr, dst_ptr,
                            H: tl.constexpr, BM: tl.constexpr, RB: tl.constexpr, BH: tl.constexpr):
    NH: tl.constexpr = (H + BH - 1) // BH
    pid = tl.program_id(0)
    i = pid // NH
    hb = pid % NH
    lo = tl.load(ready_hi_ptr + lo_index)
    hi = tl.load(ready_hi_ptr + hi_index)
    n_items = tl.minimum(hi - lo, max_items)
    if i < n_items:
        bid = tl.load(ready_list_ptr + lo + i)
        cols = hb * BH + tl.arange(0, BH)
        cmask = cols < H
        for r0 in tl.static_range(0, BM, RB):
            rows = bid.to(tl.int64) * BM + r0 + tl.arange(0, RB)
            offs = rows[:, None] * H + cols[None, :]
            v = tl.load(src_ptr + offs, mask=cmask[None, :])
            tl.store(dst_ptr + offs, v, mask=cmask[None, :])


def copy_ready_rows(ready_list, ready_hi, lo_index: int, hi_index: int, max_items: int, src, dst, *,
                    block_m: int) -> None:
    """``dst[rows of b] = src[rows of b]`` for the ready blocks ``b`` (see ``gemm.deep_gemm``)."""
    if max_items <= 0:
        return
    h = src.shape[1]
    bh = 1024 if h >= 1024 else triton.next_power_of_2(h)
    nh = -(-h // bh)
    _copy_ready_rows_kernel[(max_items * nh,)](ready_list, ready_hi, lo_index, hi_index, max_items, src, dst, H=h,
                                               BM=block_m, RB=min(block_m, 16), BH=bh, num_warps=4)
