"""The GEMM grid bounds of the expert-parallel pipeline's calls, and the blocks each call is expected to have,
in blocks of ``block_m`` rows.

The host sizes every GEMM call's grid before the device knows how many blocks are ready (a CUDA graph
replays it unchanged). A bound is the most blocks a call can have (whatever the routing); the expectation is
what it has when the routes spread evenly over the PEs, with headroom for a PE loaded past its share. A
Triton call launches one CTA per (block, tile) for the expected blocks and a small looping tail for any past
them, up to the bound (``moe_triton._grid``): the CTAs past the ready blocks read the range and exit, and
cost their launch. One definition for the block consumer (its capacity and a dispatch's bound), the
pipeline, which launches the calls, and the cost model, which prices the CTAs past the ready blocks. Plain
integers (no torch)."""

from __future__ import annotations

from ..device.gemm_grid import EXPECT_HEADROOM


def consumer_max_blocks(ranks: int, token_capacity: int, topk: int, block_m: int, local_experts: int) -> int:
    """A PE's block capacity (``BlockConsumer.max_blocks``): every route of ``ranks`` sources' forwards of
    ``token_capacity`` tokens in whole blocks, and one partial block per local expert."""
    return -(-ranks * token_capacity * topk // block_m) + local_experts


def step_bound(ranks: int, steps_per_chunk: int, chunk_tokens: int, topk: int, block_m: int, local_experts: int,
               max_blocks: int) -> int:
    """The bound of an ungrouped dispatch step: its share of a chunk's routes of every source in full
    blocks, plus one block per expert completed by rows carried from an earlier step."""
    entries = ranks * chunk_tokens * topk
    return min(max_blocks, entries // steps_per_chunk // block_m + local_experts)


def grouped_step_bound(ranks: int, j: int, chunk_tokens: int, topk: int, block_m: int, local_experts: int,
                       max_blocks: int) -> int:
    """The bound of grouped dispatch step ``j`` of a chunk: it takes at most ``ranks - j`` of the chunk's
    sources (each earlier step took at least one), so their full blocks, one block per expert completed by
    rows carried from an earlier chunk, and the seal's partial blocks."""
    rows = (ranks - j) * chunk_tokens * topk
    return min(max_blocks, rows // block_m + 2 * local_experts)


def seal_bound(step_blocks: int, local_experts: int, max_blocks: int) -> int:
    """The bound of the seal's call, which has the last step's blocks (bounded by ``step_blocks``) and one
    partial block per local expert."""
    return min(max_blocks, step_blocks + local_experts)



def uniform_blocks(rows: int, ranks: int, topk: int, block_m: int, local_experts: int, partial: int,
                   headroom: float = EXPECT_HEADROOM) -> int:
    """The blocks a PE is expected to get from ``rows`` rows of any sources when their routes spread evenly over
    the ``ranks`` PEs: its share of the routes, ``rows * topk / ranks``, times ``headroom`` (a PE loaded past
    its share: ``gemm_grid.EXPECT_HEADROOM``; 1: the even share itself), in full blocks, plus ``partial``
    blocks per local expert (1: the expert's partial block; 2: also one completed by rows carried from an
    earlier call). An expectation (a grid's ``expect_items``), never a bound: skewed routing can give a PE
    more."""
    # in integers (the headroom to a thousandth): a float quotient can land a hair above a whole number
    milli = round(headroom * 1000)
    return -(-rows * topk * milli // (ranks * block_m * 1000)) + partial * local_experts


def step_expect(ranks: int, steps_per_chunk: int, chunk_rows: int, topk: int, block_m: int,
                local_experts: int, headroom: float = EXPECT_HEADROOM) -> int:
    """The blocks an ungrouped dispatch step is expected to make ready: its share of every source's chunk of
    ``chunk_rows`` rows (as many as this PE's), routed evenly (:func:`step_bound`'s expectation)."""
    return uniform_blocks(ranks * chunk_rows // steps_per_chunk, ranks, topk, block_m, local_experts, 1, headroom)


def grouped_step_expect(ranks: int, j: int, chunk_rows: int, topk: int, block_m: int, local_experts: int,
                        headroom: float = EXPECT_HEADROOM) -> int:
    """The blocks grouped dispatch step ``j`` is expected to make ready: step 0 every source's chunk (the
    sources on time together) with a block per expert completed by rows carried from an earlier chunk and the
    seal's partial blocks, as :func:`grouped_step_bound`; a later step one source's chunk (a late source; on
    time it takes none) and the seal's partial blocks. A later step's blocks are expected, not left to the
    grid's looping tail, because the tail keeps each CTA's tiles: when other kernels share the SMs (an MPS
    peer, the producer) its slowest CTA sets the call's time."""
    if j == 0:
        return uniform_blocks(chunk_rows * ranks, ranks, topk, block_m, local_experts, 2, headroom)
    return uniform_blocks(chunk_rows, ranks, topk, block_m, local_experts, 1, headroom)
