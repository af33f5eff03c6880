"""Triton kernels of the expert-parallel dispatch and the owner's reduce: the rows routed to this PE's
experts pulled out of every source's ring slot, and each owner's k-ordered sum of its tokens' result rows.

Device code only, like :mod:`streamring.device.moe_triton` (the block consumer's kernels): every function
launches one kernel on the current torch stream and returns at once, so a forward stays capturable.
"""

from __future__ import annotations

import triton
import triton.language as tl


# ----------------------------------------------------------------------------------------------
# expert-parallel dispatch: pull the rows routed to this PE's experts out of every source's slot
# ----------------------------------------------------------------------------------------------
# A source's slot is read through `ring_* + delta_*[src]`: the ring's local base plus the byte
# (or element) distance to that source's copy in our address space (a P2P peer mapping of the
# symmetric ring, 0 for ourselves, or a local mirror filled by NVSHMEM gets where the peer has no
# mapping). Offsets come from RingLayout.descriptor() (the host passes them); nothing is re-derived.
@triton.jit(do_not_specialize=["chunk", "e_lo", "off_idx", "off_w", "me"])
def _ep_gather_kernel(ring_i64_ptr, ring_f32_ptr, delta_i64_ptr, delta_f32_ptr, src_list_ptr, valid_tab_ptr, chunk,
                      e_lo, off_idx, off_w, out_e_ptr, out_w_ptr, bad_ptr, pull_bytes_ptr, me, R: tl.constexpr,
                      C: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, E_LOC: tl.constexpr, E: tl.constexpr,
                      TB: tl.constexpr, ROW_BYTES: tl.constexpr, COUNT: tl.constexpr):
    # one program: TB whole tokens (their K routes) of source src_list[j]
    j = tl.program_id(0)
    tok = tl.program_id(1) * TB + tl.arange(0, TB)
    k = tl.arange(0, KP)
    p = tok[:, None] * K + k[None, :]
    pm = (tok < C)[:, None] & (k < K)[None, :]
    # src -1: no source in this place of the list (a ready-order step that took fewer than every source):
    # every route of it is "not mine", so the stage and place kernels never read a slot through it
    src = tl.load(src_list_ptr + j)
    has = src >= 0
    s0 = tl.maximum(src, 0)
    valid = tl.where(has, tl.load(valid_tab_ptr + chunk * R + s0), 0)
    d64 = tl.load(delta_i64_ptr + s0)
    d32 = tl.load(delta_f32_ptr + s0)
    live = pm & (tok < valid)[:, None]
    idx = tl.load(ring_i64_ptr + d64 + off_idx + p, mask=live, other=-1)
    w = tl.load(ring_f32_ptr + d32 + off_w + p, mask=live, other=0.0)
    # a hostile or corrupt peer: anything outside [-1, E) is counted and dropped, never indexed
    bad = live & ((idx < -1) | (idx >= E))
    loc = idx - e_lo
    mine = live & (loc >= 0) & (loc < E_LOC) & (idx < E)
    out = tl.where(mine, loc, E_LOC).to(tl.int32)
    tl.store(out_e_ptr + j * (C * K) + p, out, mask=pm)
    tl.store(out_w_ptr + j * (C * K) + p, w, mask=pm)
    nbad = tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0)
    tl.atomic_add(bad_ptr, nbad)
    if COUNT:
        # the bytes (x row + its scales) the dispatch pulls from a peer's slot for these tokens, both ways:
        # [0] one row per route to my experts (pull="route"), [1] one row per token with any such route
        # (pull="token"); my own slot is local memory, not counted
        if (src != me) & has:
            routes = tl.sum(tl.sum(mine.to(tl.int64), axis=1), axis=0)
            needed = tl.sum((tl.max(mine.to(tl.int32), axis=1) > 0).to(tl.int64), axis=0)
            tl.atomic_add(pull_bytes_ptr, routes * ROW_BYTES)
            tl.atomic_add(pull_bytes_ptr + 1, needed * ROW_BYTES)


def ep_gather(ring_i64, ring_f32, delta_i64, delta_f32, src_list, valid_tab, chunk: int, e_lo: int, off_idx: int,
              off_w: int, out_e, out_w, bad, *, num_ranks: int, tokens_per_slot: int, topk: int, local_experts: int,
              num_experts: int, pull_bytes=None, me: int = -1, hidden: int = 0) -> None:
    """Read the routing of ``chunk`` of every source in ``src_list`` (int32, device; -1: no source,
    all of its routes "not mine") into ``out_e [n_src * C * K]`` (int32: the local expert, or
    ``local_experts`` for a route this PE does not serve, a masked route, a row past the source's
    ``valid_tab[chunk][src]`` tokens, or a corrupt id, counted in ``bad``) and ``out_w`` (float32
    routing weights). ``off_*`` are element offsets of the slot's ``topk_idx`` (int64) and
    ``topk_weights`` (float32) in the ring.

    ``pull_bytes`` (int64 ``[2]``, optional, with ``me`` = this PE and ``hidden``): adds the bytes the
    dispatch of these routes reads from peers' slots (x rows and their scales; sources other than
    ``me``) when it pulls one row per route (``[0]``) and one row per needed token (``[1]``)."""
    n_src = src_list.shape[0]
    tb = 32
    count = pull_bytes is not None
    if count and hidden <= 0:
        raise ValueError(f"ep_gather: counting pull_bytes needs hidden > 0, got {hidden}")
    grid = (n_src, triton.cdiv(tokens_per_slot, tb))
    _ep_gather_kernel[grid](ring_i64, ring_f32, delta_i64, delta_f32, src_list, valid_tab, chunk, e_lo, off_idx,
                            off_w, out_e, out_w, bad, pull_bytes if count else bad, me, R=num_ranks, C=tokens_per_slot,
                            K=topk, KP=triton.next_power_of_2(topk), E_LOC=local_experts, E=num_experts, TB=tb,
                            ROW_BYTES=hidden + 4 * (hidden // 128), COUNT=count, num_warps=4)


@triton.jit(do_not_specialize=["off_x", "off_sf"])
def _ep_stage_rows_kernel(flat_e_ptr, src_list_ptr, ring_u8_ptr, ring_f32_ptr, delta_u8_ptr, delta_f32_ptr, off_x,
                          off_sf, stage_x_ptr, stage_sf_ptr, C: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                          H: tl.constexpr, SFC: tl.constexpr, SFCP: tl.constexpr, E_LOC: tl.constexpr,
                          BH: tl.constexpr):
    # one program per (source j, token): pull the token's row and scales ONCE if any of its K routes is
    # to one of my experts, into stage row j * C + token (the expansion into the blocks reads it there)
    q = tl.program_id(0)
    k = tl.arange(0, KP)
    e = tl.load(flat_e_ptr + q * K + k, mask=k < K, other=E_LOC)
    if tl.min(e, axis=0) < E_LOC:
        j = q // C
        tok = (q % C).to(tl.int64)
        src = tl.load(src_list_ptr + j)
        xs = ring_u8_ptr + tl.load(delta_u8_ptr + src) + off_x + tok * H
        q64 = q.to(tl.int64)
        hh = tl.arange(0, BH)
        for h0 in range(0, H, BH):
            tl.store(stage_x_ptr + q64 * H + h0 + hh, tl.load(xs + h0 + hh))
        ss = tl.arange(0, SFCP)
        sfs = ring_f32_ptr + tl.load(delta_f32_ptr + src) + off_sf + tok * SFC
        tl.store(stage_sf_ptr + q64 * SFC + ss, tl.load(sfs + ss, mask=ss < SFC), mask=ss < SFC)


def ep_stage_rows(flat_e, src_list, ring_u8, ring_f32, delta_u8, delta_f32, off_x: int, off_sf: int, stage_x,
                  stage_sf, *, tokens_per_slot: int, topk: int, hidden: int, local_experts: int) -> None:
    """The per-token pull: copy each token of the sources in ``src_list`` that has any route to a local
    expert (``flat_e`` as from :func:`ep_gather`) once from its source's slot (``x`` row, ``x_sf``
    scales) into ``stage_x[j * C + token]`` (uint8 ``[n_src * C, H]``) / ``stage_sf`` (float32
    ``[n_src * C, H/128]``). After it (stream order) nothing reads the slot; :func:`ep_place_rows` with
    ``staged=(stage_x, stage_sf)`` expands the rows into the expert blocks."""
    n = src_list.shape[0] * tokens_per_slot
    if n == 0:
        return
    sfc = hidden // 128
    _ep_stage_rows_kernel[(n,)](flat_e, src_list, ring_u8, ring_f32, delta_u8, delta_f32, off_x, off_sf, stage_x,
                                stage_sf, C=tokens_per_slot, K=topk, KP=triton.next_power_of_2(topk), H=hidden,
                                SFC=sfc, SFCP=triton.next_power_of_2(sfc), E_LOC=local_experts,
                                BH=1024 if hidden % 1024 == 0 else 128, num_warps=4)


@triton.jit
def _bucket_sort_kernel(keys_ptr, n, sorted_ptr, order_ptr, counts_ptr, cstart_ptr, BLOCK: tl.constexpr):
    # one program per bucket b: its start is the number of keys below b, and its entries follow in index
    # order (a stable counting sort: the order a stable sort of the keys gives); its count is where they end
    b = tl.program_id(0)
    below = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), axis=0)
    for s in range(0, n, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        k = tl.load(keys_ptr + offs, mask=offs < n, other=2147483647)
        below += tl.sum((k < b).to(tl.int32), axis=0)
    tl.store(cstart_ptr + b, below)
    pos = below
    for s in range(0, n, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        k = tl.load(keys_ptr + offs, mask=offs < n, other=2147483647)
        m = (k == b) & (offs < n)
        dst = pos + tl.cumsum(m.to(tl.int32), axis=0) - 1
        tl.store(order_ptr + dst, offs.to(tl.int64), mask=m)
        tl.store(sorted_ptr + dst, tl.zeros([BLOCK], dtype=tl.int32) + b, mask=m)
        pos += tl.sum(m.to(tl.int32), axis=0)
    tl.store(counts_ptr + b, pos - below)


def bucket_sort(keys, num_buckets: int, sorted_out, order_out, counts_out, cstart_out, *, block: int = 4096) -> None:
    """A stable sort of int32 ``keys`` (each in ``[0, num_buckets)``) by counting, in one kernel:
    ``sorted_out`` (int32) and ``order_out`` (int64) are what ``torch.sort(keys, stable=True)`` returns,
    ``counts_out[b]`` / ``cstart_out[b]`` (int32, ``num_buckets``) the keys equal to / below ``b``.

    It replaces the radix sort, histogram and scan of a dispatch with one small program per bucket: in a
    captured graph, torch's radix sort and scan wait for an expert GEMM grid running on another stream to
    drain, whatever their priority, where small Triton kernels start beside it (``bench.sm_sharing``)."""
    n = keys.numel()
    _bucket_sort_kernel[(num_buckets,)](keys, n, sorted_out, order_out, counts_out, cstart_out, BLOCK=block,
                                        num_warps=8)


@triton.jit(do_not_specialize=["chunk", "off_x", "off_sf"])
def _ep_place_rows_kernel(sorted_e_ptr, order_ptr, counts_ptr, cstart_ptr, state_ptr, expert_blocks_ptr, src_list_ptr,
                          ring_u8_ptr, ring_f32_ptr, delta_u8_ptr, delta_f32_ptr, off_x, off_sf, flat_w_ptr, a_ptr,
                          asf_ptr, roww_ptr, row_src_ptr, row_tok_ptr, row_chunk_ptr, chunk, C: tl.constexpr,
                          K: tl.constexpr, H: tl.constexpr, SFC: tl.constexpr, SFCP: tl.constexpr,
                          E_LOC: tl.constexpr, BM: tl.constexpr, MAXB: tl.constexpr, BH: tl.constexpr,
                          STAGED: tl.constexpr):
    i = tl.program_id(0)
    e = tl.load(sorted_e_ptr + i).to(tl.int32)
    if e < E_LOC:  # routes of other PEs sort last (e == E_LOC) and are skipped
        f = tl.load(order_ptr + i).to(tl.int32)
        j = f // (C * K)
        r = f % (C * K)
        tok = r // K
        k = r % K
        src = tl.load(src_list_ptr + j)
        rank = i - tl.load(cstart_ptr + e)
        # state holds the fill *after* this dispatch's allocation: its rows of e start at fill - count
        pos = tl.load(state_ptr + e) - tl.load(counts_ptr + e) + rank
        bid = tl.load(expert_blocks_ptr + e * MAXB + pos // BM)
        row = (bid * BM + pos % BM).to(tl.int64)
        tok64 = tok.to(tl.int64)
        if STAGED:  # the token's row was pulled once into stage row j * C + token (ep_stage_rows)
            q64 = (j * C + tok).to(tl.int64)
            xs = ring_u8_ptr + q64 * H
            sfs = ring_f32_ptr + q64 * SFC
        else:  # straight out of the source's slot
            xs = ring_u8_ptr + tl.load(delta_u8_ptr + src) + off_x + tok64 * H
            sfs = ring_f32_ptr + tl.load(delta_f32_ptr + src) + off_sf + tok64 * SFC
        hh = tl.arange(0, BH)
        for h0 in range(0, H, BH):
            tl.store(a_ptr + row * H + h0 + hh, tl.load(xs + h0 + hh))
        ss = tl.arange(0, SFCP)
        tl.store(asf_ptr + row * SFC + ss, tl.load(sfs + ss, mask=ss < SFC), mask=ss < SFC)
        tl.store(roww_ptr + row, tl.load(flat_w_ptr + f))
        tl.store(row_src_ptr + row, src)
        tl.store(row_tok_ptr + row, (chunk * C + tok64) * K + k)
        tl.store(row_chunk_ptr + row, chunk)


def ep_place_rows(sorted_e, order, counts, cstart, state, expert_blocks, src_list, ring_u8, ring_f32, delta_u8,
                  delta_f32, off_x: int, off_sf: int, flat_w, a_u8, asf, roww, row_src, row_tok, row_chunk,
                  chunk: int, *, tokens_per_slot: int, topk: int, hidden: int, local_experts: int,
                  block_m: int, staged=None) -> None:
    """The dispatch copy: each route of ``chunk`` to a local expert (sorted by expert, stable) goes
    from its source's slot (``x`` row and its ``x_sf`` scales) into its expert block row, with the
    routing weight and where its result must go (``row_src``: owner PE, ``row_tok``: owner's
    combine row ``token * K + k``, ``row_chunk``). ``off_x`` is a byte offset, ``off_sf`` an
    element offset of the slot in the ring. ``staged=(stage_x, stage_sf)``: read each route's row from
    the stage rows :func:`ep_stage_rows` filled instead of the slot (the ring arguments are unused)."""
    n = sorted_e.shape[0]
    if n == 0:
        return
    sfc = hidden // 128
    bh = 1024 if hidden % 1024 == 0 else 128
    if staged is not None:
        ring_u8, ring_f32 = staged
    _ep_place_rows_kernel[(n,)](sorted_e, order, counts, cstart, state, expert_blocks, src_list, ring_u8, ring_f32,
                                delta_u8, delta_f32, off_x, off_sf, flat_w, a_u8, asf, roww, row_src, row_tok,
                                row_chunk, chunk, C=tokens_per_slot, K=topk, H=hidden, SFC=sfc,
                                SFCP=triton.next_power_of_2(sfc), E_LOC=local_experts, BM=block_m,
                                MAXB=expert_blocks.shape[1], BH=bh, STAGED=staged is not None, num_warps=4)


# One compiled kernel for every chunk and call: the pointers are row slices (a chunk's rows, a counter of
# the chunk) whose alignment changes with the chunk, and copy_slot changes with the caller; a kernel
# specialised on either would be compiled and loaded mid-forward at the first chunk or call that differs
# from the warm-up, while the consumer side already waits on the ring (or inside a graph capture).
@triton.jit(do_not_specialize=["n", "row0", "copy_slot"],
            do_not_specialize_on_alignment=["idx_ptr", "w_ptr", "slot_idx_ptr", "slot_w_ptr", "my_idx_ptr",
                                            "my_w_ptr", "expected_ptr"])
def _own_routes_kernel(idx_ptr, w_ptr, slot_idx_ptr, slot_w_ptr, my_idx_ptr, my_w_ptr, num_tokens_ptr, expected_ptr,
                       n, row0, copy_slot, K: tl.constexpr, BLOCK: tl.constexpr):
    # BLOCK (token, k) entries of the chunk's n rows; row0: the chunk's first row in the forward
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n * K
    idx = tl.load(idx_ptr + offs, mask=m, other=-1)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    if copy_slot != 0:
        tl.store(slot_idx_ptr + offs, idx, mask=m)
        tl.store(slot_w_ptr + offs, w, mask=m)
    live = (row0 + offs // K) < tl.load(num_tokens_ptr)
    mine = tl.where(live, idx, -1)
    tl.store(my_idx_ptr + offs, mine, mask=m)
    tl.store(my_w_ptr + offs, tl.where(live, w, 0.0), mask=m)
    tl.atomic_add(expected_ptr, tl.sum((m & (mine >= 0)).to(tl.int64), axis=0))


def own_routes(idx, w, my_idx, my_w, num_tokens, expected, *, row0: int, slot_idx=None, slot_w=None,
               block: int = 1024) -> None:
    """The producer's own view of one chunk's routes, in one kernel: ``my_idx`` = ``idx`` (int64 ``[n, K]``)
    with the rows at and past the forward's token count (``row0`` + row >= ``num_tokens``, a device int64
    ``[1]``) set to -1, ``my_w`` = ``w`` (float32 ``[n, K]``) with those rows 0, and the routed (token, k) pairs of
    ``my_idx`` added to ``expected`` (device int64 ``[1]``, zeroed by the caller before the forward: the
    owner's combine waits for that many result rows). ``slot_idx`` / ``slot_w`` given: ``idx`` / ``w``
    are copied there too (the ring slot, when the caller supplied the routing).

    One small kernel instead of torch's copies, mask and sum: it must start while the consumer's expert
    GEMM grid holds the SMs (the late PE's producer runs beside its consumer)."""
    n, k = idx.shape
    if n == 0:
        return
    copy = slot_idx is not None
    for name, t in (("idx", idx), ("w", w), ("my_idx", my_idx), ("my_w", my_w), ("slot_idx", slot_idx),
                    ("slot_w", slot_w)):
        if t is not None and not t.is_contiguous():  # rows of K entries, back to back, is what the kernel reads
            raise ValueError(f"own_routes: {name} must be contiguous [n, K], got strides {tuple(t.stride())}")
    _own_routes_kernel[(triton.cdiv(n * k, block),)](idx, w, slot_idx if copy else idx, slot_w if copy else w, my_idx,
                                                     my_w, num_tokens, expected, n, row0, int(copy), K=k,
                                                     BLOCK=block, num_warps=4)


@triton.jit
def _combine_owner_kernel(rows_ptr, idx_ptr, out_ptr, H: tl.constexpr, K: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    cols = hb * BH + tl.arange(0, BH)
    acc = tl.zeros((BH,), dtype=tl.float32)
    for k in tl.static_range(K):
        e = tl.load(idx_ptr + t * K + k) + tl.zeros((BH,), dtype=tl.int64)  # broadcast: a vector mask
        v = tl.load(rows_ptr + (t * K + k) * H + cols, mask=(cols < H) & (e >= 0), other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(tl.bfloat16))


def combine_owner(rows, topk_idx, out, *, topk: int) -> None:
    """Owner's reduce: ``out[t] = sum_k rows[t * K + k]`` over the routed ``k`` (``topk_idx >= 0``),
    in the order k = 0..K-1 (bf16 rows, float32 sum, bf16 out): the same order whatever the
    chunking, so the streamed and the batch outputs are bitwise equal."""
    t, h = out.shape
    if t == 0:
        return
    bh = 1024 if h % 1024 == 0 else 128
    _combine_owner_kernel[(t, h // bh)](rows, topk_idx, out, H=h, K=topk, BH=bh, num_warps=4)
