"""The block bookkeeping of the block-granular FP8 MoE consumer (``streamring.moe.blocks``): which expert owns
which block of rows, which blocks are ready and in what order the ready list holds them, in one single-program
Triton kernel per dispatch or seal (sequential over experts through prefix sums, hence deterministic).

Device code only: :func:`alloc_blocks` launches one kernel on the current torch stream and returns at once (no
host synchronisation), so a whole forward can be captured in one CUDA graph. The state lives in small int32
device tensors owned by the caller.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _hand_out_blocks(expert_blocks_ptr, block_expert_ptr, e, em, nb_old, new, base, MAXB: tl.constexpr):
    # Expert e's ``new[e]`` new blocks (its blocks nb_old[e].. in its own list) get the ids base[e]..: recorded
    # in its block list and as their expert.
    max_new = tl.max(new, 0)
    t = 0
    while t < max_new:  # (a while loop: Triton's interpreter cannot range() over a reduction)
        m = em & (t < new)
        tl.store(expert_blocks_ptr + e * MAXB + nb_old + t, base + t, mask=m)
        tl.store(block_expert_ptr + base + t, e, mask=m)
        t += 1


@triton.jit
def _publish_ready(expert_blocks_ptr, ready_list_ptr, block_rows_ptr, e, em, j0, nr, rbase, rows_ready, nb_old, base,
                   MAXB: tl.constexpr):
    # Expert e's blocks j0[e] .. j0[e] + nr[e] - 1 (of its own list) become ready: their ids go into the ready
    # list from rbase[e] on, and their routed rows (rows_ready) into block_rows.
    max_nr = tl.max(nr, 0)
    t = 0
    while t < max_nr:
        j = j0 + t
        m = em & (t < nr)
        # ids allocated in this call are arithmetic (same program: no read-after-write through memory)
        old_id = tl.load(expert_blocks_ptr + e * MAXB + j, mask=m & (j < nb_old), other=0)
        bid = tl.where(j >= nb_old, base + (j - nb_old), old_id)
        tl.store(ready_list_ptr + rbase + t, bid, mask=m)
        tl.store(block_rows_ptr + bid, rows_ready, mask=m)
        t += 1


@triton.jit
def _ready_range_by_expert(expert_blocks_ptr, block_expert_ptr, ready_list_ptr, e, em, lo, hi, nb,
                           MAXB: tl.constexpr, TILE: tl.constexpr):
    # Rewrite ready_list[lo, hi) expert by expert, each expert's blocks in the order of its own list. Every block
    # of that range became ready after ready index lo was written, and an expert's blocks become ready in its
    # list's order, so expert e's blocks in the range are the last cnt[e] of its nb[e] (all of them ready: the
    # caller has sealed). First a histogram of the range's experts, then the ids from the experts' own lists.
    cnt = tl.zeros(e.shape, dtype=tl.int32)
    i0 = lo
    while i0 < hi:
        idx = i0 + tl.arange(0, TILE)
        m = idx < hi
        bid = tl.load(ready_list_ptr + idx, mask=m, other=0)
        ex = tl.load(block_expert_ptr + bid, mask=m, other=-1)
        cnt += tl.sum(((ex[None, :] == e[:, None]) & m[None, :]).to(tl.int32), 1)
        i0 += TILE
    # every thread's loads of the range before any thread's stores into it
    tl.debug_barrier()
    gbase = lo + tl.cumsum(cnt, 0) - cnt
    first = nb - cnt
    max_cnt = tl.max(cnt, 0)
    t = 0
    while t < max_cnt:
        m = em & (t < cnt)
        bid = tl.load(expert_blocks_ptr + e * MAXB + first + t, mask=m, other=0)
        tl.store(ready_list_ptr + gbase + t, bid, mask=m)
        t += 1


# Integer arguments that change between launches of one forward (row counts, chunk indices,
# offsets) are not specialized: a new value must never trigger a compile (a module load in the
# middle of an enqueued stream can deadlock against a stream that waits on the ring).
@triton.jit(do_not_specialize=["hi_index", "by_expert_from"])
def _alloc_blocks_kernel(counts_ptr, state_ptr, expert_blocks_ptr, block_expert_ptr, ready_list_ptr, block_rows_ptr,
                         ready_hi_ptr, hi_index, pending_ptr, by_expert_from, E: tl.constexpr, EP: tl.constexpr,
                         BM: tl.constexpr, MAXB: tl.constexpr, SEAL: tl.constexpr, SEAL_IF: tl.constexpr,
                         BY_EXPERT: tl.constexpr, TILE: tl.constexpr):
    # state: [0, E) rows filled per expert, [E] blocks allocated, [E+1] blocks ready, [E+2] sealed (0/1).
    # A seal happens once per forward: a second seal (or one whose *pending_ptr, SEAL_IF, still has a
    # source) makes nothing ready and only writes ready_hi[hi_index]; no row is appended after a seal
    # (the dispatch seals only once every source of the last chunk is taken).
    # block_rows[b]: the routed rows of block b, written when b becomes ready (BM, or a sealed partial
    # block's fill) by this kernel, which also writes b into ready_list: a GEMM that reads b from the
    # ready list runs after this kernel in stream order, so it reads b's final count. (A count derived
    # from state[e] at GEMM time would race with a later dispatch's allocation on another stream.)
    e = tl.arange(0, EP)
    em = e < E
    fill_old = tl.load(state_ptr + e, mask=em, other=0)
    if SEAL:
        cnt = tl.zeros((EP,), dtype=tl.int32)
    else:
        cnt = tl.load(counts_ptr + e, mask=em, other=0)
    fill_new = fill_old + cnt
    nb_old = (fill_old + BM - 1) // BM
    nb_new = (fill_new + BM - 1) // BM
    new = nb_new - nb_old
    n_blocks = tl.load(state_ptr + E)
    n_ready = tl.load(state_ptr + E + 1)
    base = n_blocks + tl.cumsum(new, 0) - new  # block ids handed out expert by expert
    _hand_out_blocks(expert_blocks_ptr, block_expert_ptr, e, em, nb_old, new, base, MAXB)
    if SEAL:
        # end of stream: every partially filled block becomes ready
        sealed = tl.load(state_ptr + E + 2)
        go = sealed == 0
        if SEAL_IF:
            go = go & (tl.load(pending_ptr) == 0)
        j0 = fill_new // BM
        nr = ((fill_new % BM != 0) & go).to(tl.int32)
        rows_ready = fill_new % BM
        tl.store(state_ptr + E + 2, tl.where(go, 1, sealed))
    else:
        # a block becomes ready the moment its last row is appended
        j0 = fill_old // BM
        nr = fill_new // BM - fill_old // BM
        rows_ready = tl.full((EP,), BM, dtype=tl.int32)
    rbase = n_ready + tl.cumsum(nr, 0) - nr
    _publish_ready(expert_blocks_ptr, ready_list_ptr, block_rows_ptr, e, em, j0, nr, rbase, rows_ready, nb_old, base,
                   MAXB)
    tl.store(state_ptr + e, fill_new, mask=em)
    tl.store(state_ptr + E, n_blocks + tl.sum(new, 0))
    ready_new = n_ready + tl.sum(nr, 0)
    tl.store(state_ptr + E + 1, ready_new)
    tl.store(ready_hi_ptr + hi_index, ready_new)
    if SEAL and BY_EXPERT:
        if go:
            # the sealing call's range expert by expert: each expert's partial block beside its full blocks, so
            # that call reads each expert's weights in one run of tiles, not once for its full blocks and again
            # for its partial block at the end of the range. The ids and counts of this kernel's own stores are
            # read back below: a barrier first (one program, many threads).
            tl.debug_barrier()
            lo = tl.load(ready_hi_ptr + by_expert_from)
            _ready_range_by_expert(expert_blocks_ptr, block_expert_ptr, ready_list_ptr, e, em, lo, ready_new, nb_new,
                                   MAXB, TILE)


def alloc_blocks(counts, state, expert_blocks, block_expert, ready_list, block_rows, ready_hi, hi_index: int, *,
                 num_experts: int, block_m: int, seal: bool, seal_if_none_pending=None,
                 by_expert_from: int | None = None) -> None:
    """Append ``counts[e]`` rows to every expert, allocate blocks, publish newly ready blocks.

    Writes ``ready_hi[hi_index]`` = number of ready blocks after this call; the blocks that
    became ready are ``ready_list[ready_hi[hi_index-1] : ready_hi[hi_index]]`` (or, for a seal
    following a dispatch's allocation at the same ``hi_index``, the dispatch's and the seal's
    blocks), and ``block_rows[b]`` is the number of routed rows of each of them (``block_m`` but in
    a sealed partial block). ``state`` has ``num_experts + 3`` words.

    ``seal``: every partial block becomes ready, once per forward (``state[E+2]``; a later seal makes
    nothing ready). ``seal_if_none_pending`` (a device int64 source mask, with ``seal``): seal only if
    it is 0 (every source taken), decided on the device.

    ``by_expert_from`` (a ready index at most ``hi_index``, with ``seal``): if this call seals, the blocks
    ``ready_list[ready_hi[by_expert_from] : ready_hi[hi_index]]`` are rewritten expert by expert (each
    expert's blocks in its own list's order: its full blocks, then its partial one), the range of the GEMM call
    that has the partial blocks; nothing may read that range before this kernel (the caller's GEMM call of it
    comes after, in stream order). The same blocks, the same ``block_rows``: only their order in the range
    changes, which no GEMM row depends on.
    """
    ep = triton.next_power_of_2(num_experts)
    if by_expert_from is not None and not (seal and 0 <= by_expert_from <= hi_index):
        raise ValueError(f"alloc_blocks: by_expert_from={by_expert_from} needs seal=True and 0 <= by_expert_from "
                         f"<= hi_index={hi_index}")
    if state.numel() < num_experts + 3:
        raise ValueError(f"alloc_blocks: state needs num_experts + 3 = {num_experts + 3} words, got {state.numel()}")
    cond = seal_if_none_pending is not None
    if cond and not seal:
        raise ValueError("alloc_blocks: seal_if_none_pending needs seal=True")
    _alloc_blocks_kernel[(1,)](counts, state, expert_blocks, block_expert, ready_list, block_rows, ready_hi, hi_index,
                               seal_if_none_pending if cond else state,
                               hi_index if by_expert_from is None else by_expert_from, E=num_experts, EP=ep,
                               BM=block_m, MAXB=expert_blocks.shape[1], SEAL=seal, SEAL_IF=cond,
                               BY_EXPERT=by_expert_from is not None, TILE=max(16, min(128, 4096 // ep)),
                               num_warps=4)
