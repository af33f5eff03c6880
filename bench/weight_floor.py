"""The weight-read floor of the expert GEMMs: a kernel that reads exactly the bytes they must read.

At decode sizes the layer's time is bound by reading each local expert's FP8 weights once (L1 ``[2I, H]``, L2
``[H, I]``, and their 128x128 block scales). :func:`floor_graph` captures one read of every byte of this PE's
``w1``, ``w1_sf``, ``w2``, ``w2_sf`` (``FP8BlocksView``, :meth:`MoEWeights.fp8_blocks`) into a graph: a Triton kernel per tensor, each program
reading a contiguous run of 32-bit words with wide loads and folding them (xor) into one row of words it stores
(so nothing is optimised away). Timed on every PE at once, as the layer is (``bench.common.timed``: the slowest PE), it is
the floor on the same PEs and SM share: ``floor_ms``; a row's ``over_floor`` is its time over it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: 32-bit words per program and loop step (16 KB a step, wide enough for 16-byte loads in every thread)
BLOCK = 4096
#: loop steps per program (a program reads BLOCK * STEPS words: 1 MB)
STEPS = 64


@triton.jit
def _read_words_kernel(src_ptr, n_words, out_ptr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * BLOCK * STEPS
    acc = tl.full([BLOCK], 0, tl.int32)
    for i in range(STEPS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(src_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)


def read_once(t: torch.Tensor, out: torch.Tensor) -> None:
    """Read every byte of ``t`` (contiguous, a multiple of 4 bytes) once; ``out`` (int32, at least
    :func:`programs_for` ``(t) * BLOCK`` words) receives one folded row of ``BLOCK`` words per program."""
    words = t.contiguous().view(torch.uint8).view(torch.int32)
    n = words.numel()
    grid = (programs_for(t),)
    _read_words_kernel[grid](words, n, out, BLOCK=BLOCK, STEPS=STEPS, num_warps=8)


def programs_for(t: torch.Tensor) -> int:
    return -(-(t.numel() * t.element_size() // 4) // (BLOCK * STEPS))


def weight_tensors(fw) -> list[torch.Tensor]:
    """What the expert GEMMs must read of this PE's experts: FP8 weights and their block scales."""
    return [fw.w1, fw.w1_sf, fw.w2, fw.w2_sf]


def weight_bytes(fw) -> int:
    return sum(t.numel() * t.element_size() for t in weight_tensors(fw))


def floor_graph(fw):
    """A CUDA graph reading every weight byte of ``fw`` once (compiled and run once eagerly first)."""
    ts = weight_tensors(fw)
    out = torch.zeros(max(programs_for(t) for t in ts) * BLOCK, dtype=torch.int32, device=ts[0].device)
    for t in ts:
        read_once(t, out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(g, stream=side):
        for t in ts:
            read_once(t, out)
    torch.cuda.current_stream().wait_stream(side)
    g.keep_alive = (out, ts)  # the graph reads these: keep them while it lives
    return g
