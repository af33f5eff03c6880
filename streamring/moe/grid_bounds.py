"""The GEMM grid bounds of the expert-parallel pipeline's calls, in blocks of ``block_m`` rows.

The host sizes every GEMM call's grid before the device knows how many blocks are ready (a CUDA graph
replays it unchanged), so a Triton call launches one CTA per (block, tile) up to its bound, and the CTAs
past the ready blocks read the range and exit. One definition for the block consumer (its capacity and a
dispatch's bound), the pipeline, which launches the calls, and the cost model, which prices the CTAs past
the ready blocks. Plain integers (no torch)."""

from __future__ import annotations


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
