"""The persistent expert consumer: ONE kernel launch per forward whose CTAs claim work items.

A work item is (ready-list position, 128-column N-tile, L1 or L2) of the block consumer's ready
list (``streamring.moe.blocks.BlockConsumer``); the claim order is ``queue_order.item_of`` (groups of
``GROUP`` positions, position fastest, each group's L2 after the next group's L1). The dispatch side
feeds the queue: after each dispatch step a one-thread kernel publishes the number of ready
positions (``queue_publish``), and the seal publishes the final count with the ``SEALED`` bit.

Per CTA, loop: claim ``t`` (relaxed atomic add on the claim counter) ->

* wait until position ``pos`` is ready or the queue is sealed (acquire; deadline; skipped when the
  last ready word this CTA acquired already covers ``pos``); then claim the next item (its round trip
  overlaps this item's tile);
* sealed and ``t >= total_items(final count)``: the CTA ends; ``pos`` past the final count: no-op;
* L1 item: L1 + SwiGLU + FP8 of one tile into ``h1``, then a release add on ``l1_done[pos]``;
* L2 item: wait until ``l1_done[pos] == I/128`` (acquire; deadline), L2 of one tile stored straight
  into the owners' combine rows (``moe_triton._l2_store(DIRECT)``), then an acq_rel add on
  ``l2_done[pos]``; the add that returns ``H/128 - 1`` (the block's last L2 tile) signals the
  owners: a system fence, then for each (owner ``row_src``, chunk ``row_chunk``) of the block's rows
  a release ADD of its row count to that owner's ``arrived[chunk]`` (``csrc/ep_kernels.cu``'s
  ``ep_signal_arrivals``, moved into the L2 epilogue).

Memory ordering, each pairing in one place (P: producer side, C: consumer side):

* dispatch -> item. P: the dispatch kernels copy rows and write ``ready_list``/``block_expert``/``row_*``;
  ``queue_publish`` follows them in stream order, fences and release-max()es the ready word (gpu
  scope). C: thread 0 acquires the ready word (an acquire RMW that adds 0), Triton broadcasts the
  value through shared memory with ``bar.sync``, so every thread's later loads of the block follow
  the acquire (one-thread acquire + barrier, as ``csrc/ptx.cuh``) and every thread takes the same
  branch.
* L1 tiles -> L2 of the same block. P: every thread fences (acq_rel.gpu) after its h1 stores, a
  barrier, then one thread's release add on ``l1_done[pos]``. C: the L2 item's acquire of
  ``l1_done[pos] == NT1`` (same broadcast), then its h1 loads (plain ``ld.global``/``cp.async``, never
  ``.nc``: h1 is written by other CTAs of this kernel; the PTX check looks for it).
* L2 tiles -> the owner. Each L2 tile: its stores into the owners, fence.acq_rel.sys in every
  thread, a barrier, then an acq_rel.sys add on ``l2_done[pos]``; the last tile's add acquires every
  other tile's release, then fence.sc.sys and the release.sys ADDs on the owners' ``arrived`` words,
  which the owner acquires (``ep_wait_arrivals``) before it reads the rows.

Why the queue cannot deadlock: every item depends only on (a) the dispatch's publications and (b)
for an L2 item, the L1 items of its block, which have smaller claim indices. A claimed item belongs
to a CTA that is running (it claimed it), so by induction on the claim index every claimed item
completes once the dispatch publishes, and the dispatch never waits for the consumer (its slot
acks come right after its copies; the owners' arrival waits come after this kernel in stream
order). The dispatch (and the producers) must get SMs while the persistent grid spins: the caller
launches at most (SMs - k) CTAs so that k SMs stay free for the other streams' kernels. CTAs that
are not resident yet have claimed nothing, so a grid larger than what fits only runs slower.

Waits never hang: every wait checks the ring's abort word and a deadline (``%globaltimer`` ns; under
Triton's CPU interpreter, which has no inline asm, ``INTERP_SPIN_NS`` per spin) and on expiry records
the error exactly as ``record_error`` in ``csrc/ring_protocol.cuh`` does (first-error CAS packing
code | src << 8 | chunk << 24 with src = -1 and chunk = the ready-list position, seen/want words,
the timeouts counter, the abort flag), then the CTA ends. Codes: ``RE_QUEUE_TIMEOUT`` (ready wait),
``RE_L1_WAIT_TIMEOUT`` (an L2 item's wait for its block's L1 tiles), in ``ringdesc.ERRORS``.

Deliberate mutations (tests; ``QUEUE_INJECT_BITS``): ``claim-before-ready`` (no ready wait: an item
computes whatever the ready list holds at its position), ``l2-before-l1`` (no wait for ``l1_done``),
``arrival-before-store`` (the L2 tile adds to ``l2_done`` and the last tile signals the owners
before the tile's stores; on a GPU a ~20 us pause then widens the window).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .moe_triton import _gemm_cfg, _l1_tile, _l2_rows, _l2_store
from .producer_triton import INTERPRET
from .queue_order import COUNT_MASK, CTRL_CLAIM, CTRL_READY, CTRL_WORDS, L1, L2, SEALED, total_items
from .ringdesc import ERRORS, RS_ABORT, RS_BAD_SEEN, RS_BAD_WANT, RS_FIRST_ERROR, RS_TIMEOUTS

QUEUE_INJECT_BITS = {"none": 0, "claim-before-ready": 1, "l2-before-l1": 2, "arrival-before-store": 4}
#: under the interpreter a deadline counts spins, each worth this many nanoseconds
INTERP_SPIN_NS = 1000

_NATIVE = tl.constexpr(not INTERPRET)
_SEALED = tl.constexpr(SEALED)
_COUNT_MASK = tl.constexpr(COUNT_MASK)
_CLAIM = tl.constexpr(CTRL_CLAIM)
_READY = tl.constexpr(CTRL_READY)
_CTRL_WORDS = tl.constexpr(CTRL_WORDS)
_RS_ABORT = tl.constexpr(RS_ABORT)
_RS_BAD_SEEN = tl.constexpr(RS_BAD_SEEN)
_RS_BAD_WANT = tl.constexpr(RS_BAD_WANT)
_RS_FIRST_ERROR = tl.constexpr(RS_FIRST_ERROR)
_RS_TIMEOUTS = tl.constexpr(RS_TIMEOUTS)
_RE_QUEUE_TIMEOUT = tl.constexpr(ERRORS["RE_QUEUE_TIMEOUT"][0])
_RE_L1_WAIT_TIMEOUT = tl.constexpr(ERRORS["RE_L1_WAIT_TIMEOUT"][0])
_SPIN_NS = tl.constexpr(INTERP_SPIN_NS)
_L2 = tl.constexpr(L2)
_L1 = tl.constexpr(L1)


# ----------------------------------------------------------------------------------------------
# waiting, fencing, recording (no-ops or spin counts under the interpreter)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _now_ns(spins, NW: tl.constexpr):
    # CTA-uniform time: every thread reads %globaltimer, the max over the CTA (a reduction through
    # shared memory) gives all threads the same value, so a deadline is taken by all threads or none
    if _NATIVE:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [tl.arange(0, 32 * NW)], dtype=tl.int64,
                                      is_pure=False, pack=1)
        now = tl.max(t, axis=0)
    else:
        now = spins.to(tl.int64) * _SPIN_NS
    return now


@triton.jit
def _backoff(spins):
    # poll flat out first (a block published a moment ago is the common case), then sleep between polls
    if _NATIVE:
        if spins > 32:
            tl.inline_asm_elementwise("nanosleep.u32 200;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)


@triton.jit
def _fence_gpu():
    # this thread's earlier stores before its later ones, GPU scope (the h1 of an L1 tile before the
    # barrier and the release add of l1_done)
    if _NATIVE:
        tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def _fence_sys():
    # as _fence_gpu, system scope: the L2 tile's stores went into peers' memory over NVLink
    if _NATIVE:
        tl.inline_asm_elementwise("fence.acq_rel.sys;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def _fence_sc_sys():
    # __threadfence_system: what ep_signal_arrivals executes before its release ADDs
    if _NATIVE:
        tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _pause_us(us: tl.constexpr, NW: tl.constexpr):
    # a deliberate pause on a GPU (tests: the arrival-before-store mutation widens its window with it, a
    # stalled L1 tile makes its L2 items wait); callers skip it under the interpreter (no inline asm).
    # Timed on %globaltimer: nanosleep alone may return after any time in [0, 2t]
    t0 = _now_ns(0, NW)
    now = t0
    while now - t0 < us * 1000:
        tl.inline_asm_elementwise("nanosleep.u32 1000;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)
        now = _now_ns(0, NW)


@triton.jit
def _record_timeout(status_ptr, code: tl.constexpr, pos, seen, want):
    # record_error of csrc/ring_protocol.cuh for a timeout code: first error (CAS from 0) packs
    # code | src << 8 | chunk << 24 (src -1: the wait is this PE's own; chunk: the ready-list position),
    # the first recorder also writes seen/want; every timeout counts and raises the abort flag
    # (every other wait of the ring, CUDA or Triton, then gives up too)
    packed = ((pos.to(tl.int64) & 0xFFFFFFFF) << 24) | (code | (0xFFFF << 8))
    old = tl.atomic_cas(status_ptr + _RS_FIRST_ERROR, packed * 0, packed, sem="relaxed", scope="sys")
    if old == 0:
        tl.atomic_xchg(status_ptr + _RS_BAD_SEEN, seen.to(tl.int64), sem="relaxed", scope="sys")
        tl.atomic_xchg(status_ptr + _RS_BAD_WANT, want.to(tl.int64), sem="relaxed", scope="sys")
    tl.atomic_add(status_ptr + _RS_TIMEOUTS, 1, sem="relaxed", scope="sys")
    tl.atomic_xchg(status_ptr + _RS_ABORT, 1, sem="relaxed", scope="sys")
    _fence_sc_sys()


@triton.jit
def _wait_ready(ctrl_ptr, status_ptr, pos, deadline_ns, NW: tl.constexpr):
    # The ready word once position `pos` is ready or the queue is sealed; -1 after a timeout or an
    # abort (recorded). Acquire: pairs with queue_publish's release; a scalar atomic runs in one thread
    # and is broadcast (shared memory + bar.sync), so the loop and its outcome are CTA-uniform.
    word = tl.atomic_add(ctrl_ptr + _READY, 0, sem="acquire", scope="gpu")
    spins = pos * 0
    start = _now_ns(spins, NW)
    while (word >= 0) & ((word & _COUNT_MASK) <= pos) & ((word & _SEALED) == 0):
        spins += 1
        _backoff(spins)
        abort = tl.atomic_add(status_ptr + _RS_ABORT, 0, sem="relaxed", scope="sys")
        if (abort != 0) | (_now_ns(spins, NW) - start > deadline_ns):
            _record_timeout(status_ptr, _RE_QUEUE_TIMEOUT, pos, word, pos + 1)
            word = -1
        else:
            word = tl.atomic_add(ctrl_ptr + _READY, 0, sem="acquire", scope="gpu")
    return word


@triton.jit
def _wait_count(count_ptr, want: tl.constexpr, status_ptr, pos, deadline_ns, NW: tl.constexpr):
    # True once *count_ptr == want (acquire: pairs with the release adds of the block's L1 tiles);
    # False after a timeout or an abort (recorded as RE_L1_WAIT_TIMEOUT). CTA-uniform as _wait_ready.
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    spins = pos * 0
    start = _now_ns(spins, NW)
    failed = pos * 0
    while (seen < want) & (failed == 0):
        spins += 1
        _backoff(spins)
        abort = tl.atomic_add(status_ptr + _RS_ABORT, 0, sem="relaxed", scope="sys")
        if (abort != 0) | (_now_ns(spins, NW) - start > deadline_ns):
            _record_timeout(status_ptr, _RE_L1_WAIT_TIMEOUT, pos, seen, seen * 0 + want)
            failed = 1
        else:
            seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    return failed == 0


# ----------------------------------------------------------------------------------------------
# the item order (queue_order.item_of / total_items, in Triton)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _item_of(t, NT1: tl.constexpr, NT2: tl.constexpr, GROUP: tl.constexpr):
    S1: tl.constexpr = GROUP * NT1
    PAIR: tl.constexpr = GROUP * (NT1 + NT2)
    u = tl.maximum(t - S1, 0)
    first = t < S1
    q = tl.where(first, 0, u // PAIR + 1)
    w = tl.where(first, t, u % PAIR)
    is_l2 = (~first) & (w >= S1)
    g = tl.where(is_l2, q - 1, q)
    r = tl.where(is_l2, w - S1, w)
    return is_l2, g * GROUP + r % GROUP, r // GROUP


@triton.jit
def _total_items(n, NT1: tl.constexpr, NT2: tl.constexpr, GROUP: tl.constexpr):
    return GROUP * NT1 + tl.cdiv(n, GROUP) * (GROUP * (NT1 + NT2))


# ----------------------------------------------------------------------------------------------
# the L2 epilogue's signals
# ----------------------------------------------------------------------------------------------
@triton.jit
def _signal_arrivals(pos, ready_list_ptr, row_src_ptr, row_chunk_ptr, arrived_ptr, arrived_delta_ptr,
                     BM: tl.constexpr):
    # One release ADD per (owner, chunk) of the block's rows (padding rows, row_src < 0, are nobody's):
    # the first row of each key adds the key's row count (ep_signal_arrivals adds per contiguous run;
    # the sums are the same, and a key that recurs apart is still added exactly once here).
    bid = tl.load(ready_list_ptr + pos)
    r = tl.arange(0, BM)
    rows = bid.to(tl.int64) * BM + r
    src = tl.load(row_src_ptr + rows)
    ch = tl.load(row_chunk_ptr + rows)
    same = (src[:, None] == src[None, :]) & (ch[:, None] == ch[None, :])
    earlier = tl.sum((same & (r[None, :] < r[:, None])).to(tl.int32), axis=1)
    count = tl.sum(same.to(tl.int32), axis=1)
    d = tl.load(arrived_delta_ptr + tl.maximum(src, 0))
    # every L2 tile of the block happened before (acquired through l2_done); their stores and ours
    # before the ADDs that the owner's ld.acquire of arrived[chunk] pairs with
    _fence_sc_sys()
    tl.atomic_add(arrived_ptr + d + ch, count.to(tl.int64), mask=(earlier == 0) & (src >= 0), sem="release",
                  scope="sys")


@triton.jit
def _witness_unwritten(pos, ready_list_ptr, row_src_ptr, row_tok_ptr, comb_ptr, comb_delta_ptr, witness_ptr,
                       H: tl.constexpr, BM: tl.constexpr):
    # Tests only (WITNESS): what an owner would read right at the arrival signal: count the elements of
    # the block's result rows still holding the poison (NaN) the test filled the combine rows with.
    bid = tl.load(ready_list_ptr + pos)
    rows = bid.to(tl.int64) * BM + tl.arange(0, BM)
    rs = tl.load(row_src_ptr + rows)
    rt = tl.load(row_tok_ptr + rows)
    dd = tl.load(comb_delta_ptr + tl.maximum(rs, 0))
    cols = tl.arange(0, 128)
    n = tl.sum(rs * 0, axis=0)
    for h0 in tl.static_range(0, H, 128):
        v = tl.load(comb_ptr + dd[:, None] + rt[:, None] * H + h0 + cols[None, :], mask=(rs >= 0)[:, None], other=0.0)
        # NaN from its bits (exponent all ones, mantissa not 0): the interpreter's bf16 says NaN == NaN
        b = v.to(tl.int16, bitcast=True).to(tl.int32)
        n += tl.sum(tl.sum((((b & 0x7F80) == 0x7F80) & ((b & 0x7F) != 0)).to(tl.int32), axis=1), axis=0)
    tl.atomic_add(witness_ptr, n)


@triton.jit
def _l2_done(pos, l2_done_ptr, ready_list_ptr, row_src_ptr, row_tok_ptr, row_chunk_ptr, comb_ptr, comb_delta_ptr,
             arrived_ptr, arrived_delta_ptr, witness_ptr, NT2: tl.constexpr, H: tl.constexpr, BM: tl.constexpr,
             WITNESS: tl.constexpr):
    # this tile's stores (every thread) before one thread's acq_rel add: release for the other tiles'
    # last one, acquire of theirs when this is the last
    _fence_sys()
    tl.debug_barrier()
    old = tl.atomic_add(l2_done_ptr + pos, 1, sem="acq_rel", scope="sys")
    if old == NT2 - 1:
        _signal_arrivals(pos, ready_list_ptr, row_src_ptr, row_chunk_ptr, arrived_ptr, arrived_delta_ptr, BM)
        if WITNESS:
            _witness_unwritten(pos, ready_list_ptr, row_src_ptr, row_tok_ptr, comb_ptr, comb_delta_ptr, witness_ptr,
                               H, BM)


# ----------------------------------------------------------------------------------------------
# one claimed item
# ----------------------------------------------------------------------------------------------
@triton.jit
def _ready_word(ctrl_ptr, status_ptr, pos, known, deadline_ns, NW: tl.constexpr, SKIP_READY: tl.constexpr):
    # The ready word for position ``pos``: ``known`` (the last word this CTA acquired) where it already
    # covers pos, else a new acquire (_wait_ready: -1 after a timeout or an abort). The claim-before-ready
    # mutation (SKIP_READY) reads the word once, without waiting.
    if SKIP_READY:
        word = tl.atomic_add(ctrl_ptr + _READY, 0, sem="acquire", scope="gpu")
    else:
        if ((known & _COUNT_MASK) > pos) | ((known & _SEALED) != 0):
            word = known
        else:
            word = _wait_ready(ctrl_ptr, status_ptr, pos, deadline_ns, NW)
    return word


@triton.jit
def _trace_claim(trace_ptr, t, is_l2, pos, tile):
    # tests (TRACE): claim t was computed by this CTA (+ 1), as an L2 item or not, at this position and tile
    tl.store(trace_ptr + t * 4, tl.program_id(0) + 1)
    tl.store(trace_ptr + t * 4 + 1, is_l2.to(tl.int32))
    tl.store(trace_ptr + t * 4 + 2, pos)
    tl.store(trace_ptr + t * 4 + 3, tile)


@triton.jit
def _l1_item(pos, tile, l1_done, ready_list_ptr, block_expert_ptr, a_ptr, asf_ptr, w1_ptr, w1sf_ptr, h1_ptr, h1sf_ptr,
             H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, GROUP: tl.constexpr, STAGES: tl.constexpr,
             NW: tl.constexpr, STALL_L1_US: tl.constexpr):
    # L1 + SwiGLU + FP8 of one tile of position ``pos``'s block into h1, then the release of that h1
    if _NATIVE and STALL_L1_US > 0:  # tests: the first group's L1 tiles run late (L2 items wait)
        if pos < GROUP:
            _pause_us(STALL_L1_US, NW)
    _l1_tile(pos, tile, 0, ready_list_ptr, block_expert_ptr, a_ptr, asf_ptr, w1_ptr, w1sf_ptr, h1_ptr,
             h1sf_ptr, H, I, BM, STAGES)
    # release of this tile's h1: every thread fences its own stores, the barrier joins them,
    # then one thread's release add (pairs with the acquire in the L2 item's _wait_count)
    _fence_gpu()
    tl.debug_barrier()
    tl.atomic_add(l1_done + pos, 1, sem="release", scope="gpu")


@triton.jit
def _l2_item(pos, tile, l1_done, l2_done, ready_list_ptr, block_expert_ptr, h1_ptr, h1sf_ptr, w2_ptr, w2sf_ptr,
             roww_ptr, comb_ptr, row_src_ptr, row_tok_ptr, row_chunk_ptr, comb_delta_ptr, arrived_ptr,
             arrived_delta_ptr, status_ptr, witness_ptr, deadline_ns, NT1: tl.constexpr, NT2: tl.constexpr,
             H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, STAGES: tl.constexpr, NW: tl.constexpr,
             WITNESS: tl.constexpr, SKIP_L1_WAIT: tl.constexpr, ARRIVAL_FIRST: tl.constexpr):
    # One L2 tile of position ``pos``'s block, once the block's L1 tiles are released (the l2-before-l1
    # mutation, SKIP_L1_WAIT, does not wait), stored straight into the owners' combine rows, then its
    # l2_done add (the block's last tile signals the owners; the arrival-before-store mutation,
    # ARRIVAL_FIRST, adds and signals before the stores). Returns whether the block's h1 was there: False
    # after a timeout or an abort of the wait (recorded), and nothing computed.
    if SKIP_L1_WAIT:
        ready_h1 = pos >= 0
    else:
        ready_h1 = _wait_count(l1_done + pos, NT1, status_ptr, pos, deadline_ns, NW)
    if ready_h1:
        y, rows, ncol = _l2_rows(pos, tile, 0, ready_list_ptr, block_expert_ptr, h1_ptr, h1sf_ptr, w2_ptr,
                                 w2sf_ptr, roww_ptr, BM, H, I, BM, STAGES)
        if ARRIVAL_FIRST:
            _l2_done(pos, l2_done, ready_list_ptr, row_src_ptr, row_tok_ptr, row_chunk_ptr, comb_ptr,
                     comb_delta_ptr, arrived_ptr, arrived_delta_ptr, witness_ptr, NT2, H, BM, WITNESS)
            if _NATIVE:
                _pause_us(200, NW)
            _l2_store(y, rows, ncol, BM, comb_ptr, row_src_ptr, row_tok_ptr, comb_delta_ptr, H, BM, True)
        else:
            _l2_store(y, rows, ncol, BM, comb_ptr, row_src_ptr, row_tok_ptr, comb_delta_ptr, H, BM, True)
            _l2_done(pos, l2_done, ready_list_ptr, row_src_ptr, row_tok_ptr, row_chunk_ptr, comb_ptr,
                     comb_delta_ptr, arrived_ptr, arrived_delta_ptr, witness_ptr, NT2, H, BM, WITNESS)
    return ready_h1


# ----------------------------------------------------------------------------------------------
# the kernel
# ----------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["cap", "deadline_ns"])
def _persistent_moe_kernel(ctrl_ptr, ready_list_ptr, block_expert_ptr, a_ptr, asf_ptr, w1_ptr, w1sf_ptr, h1_ptr,
                           h1sf_ptr, w2_ptr, w2sf_ptr, roww_ptr, comb_ptr, row_src_ptr, row_tok_ptr, row_chunk_ptr,
                           comb_delta_ptr, arrived_ptr, arrived_delta_ptr, status_ptr, trace_ptr, witness_ptr, cap,
                           deadline_ns, H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, GROUP: tl.constexpr,
                           STAGES: tl.constexpr, NW: tl.constexpr, INJECT: tl.constexpr, TRACE: tl.constexpr,
                           WITNESS: tl.constexpr, STALL_L1_US: tl.constexpr):
    NT1: tl.constexpr = I // 128
    NT2: tl.constexpr = H // 128
    SKIP_READY: tl.constexpr = (INJECT & 1) != 0
    SKIP_L1_WAIT: tl.constexpr = (INJECT & 2) != 0
    ARRIVAL_FIRST: tl.constexpr = (INJECT & 4) != 0
    l1_done = ctrl_ptr + _CTRL_WORDS
    l2_done = l1_done + cap
    # no position at or past `cap` can ever be ready: claims from end_cap on have nothing to do
    end_cap = _total_items(cap, NT1, NT2, GROUP)
    # the claim itself orders nothing (relaxed): what an item reads is ordered by its own waits
    t = tl.atomic_add(ctrl_ptr + _CLAIM, 1, sem="relaxed", scope="gpu")
    # the last ready word this CTA acquired: a position it already covers needs no new acquire (that
    # acquire already follows the publication of the position; the word only grows)
    known = t * 0
    while t < end_cap:
        is_l2, pos, tile = _item_of(t, NT1, NT2, GROUP)
        word = _ready_word(ctrl_ptr, status_ptr, pos, known, deadline_ns, NW, SKIP_READY)
        known = tl.maximum(known, word)
        stop = word < 0
        n = word & _COUNT_MASK
        sealed = (word & _SEALED) != 0
        stop = stop | (sealed & (t >= _total_items(n, NT1, NT2, GROUP)))
        if SKIP_READY:  # mutation: whatever the ready list holds at pos, unless the seal says it is empty
            work = (~stop) & (pos < cap) & ~(sealed & (pos >= n))
        else:
            work = (~stop) & (pos < n)
        # claim the next item before computing this one: the claim's round trip hides behind the tile.
        # (Still deadlock-free: the held item has a larger index than the current one, which depends only
        # on smaller ones; items that wait for the held one have larger indices still.)
        if stop:
            t_next = end_cap
        else:
            t_next = tl.atomic_add(ctrl_ptr + _CLAIM, 1, sem="relaxed", scope="gpu")
        if work:
            if TRACE:
                _trace_claim(trace_ptr, t, is_l2, pos, tile)
            if is_l2:
                ready_h1 = _l2_item(pos, tile, l1_done, l2_done, ready_list_ptr, block_expert_ptr, h1_ptr, h1sf_ptr,
                                    w2_ptr, w2sf_ptr, roww_ptr, comb_ptr, row_src_ptr, row_tok_ptr, row_chunk_ptr,
                                    comb_delta_ptr, arrived_ptr, arrived_delta_ptr, status_ptr, witness_ptr,
                                    deadline_ns, NT1, NT2, H, I, BM, STAGES, NW, WITNESS, SKIP_L1_WAIT, ARRIVAL_FIRST)
                stop = stop | ~ready_h1
            else:
                _l1_item(pos, tile, l1_done, ready_list_ptr, block_expert_ptr, a_ptr, asf_ptr, w1_ptr, w1sf_ptr, h1_ptr,
                         h1sf_ptr, H, I, BM, GROUP, STAGES, NW, STALL_L1_US)
        t = tl.where(stop, end_cap, t_next)


@triton.jit(do_not_specialize=["index"])
def _queue_publish_kernel(ctrl_ptr, ready_hi_ptr, index, SEAL: tl.constexpr):
    # ready_hi[index] was written by alloc_blocks, the rows by the dispatch copy: both earlier kernels
    # of this stream, complete before this one starts
    n = tl.load(ready_hi_ptr + index)
    if SEAL:
        n = n | _SEALED
    _fence_gpu()
    # release (pairs with the consumer's acquire in _wait_ready); max: the word only grows, and the
    # sealed word is larger than any count
    tl.atomic_max(ctrl_ptr + _READY, n, sem="release", scope="gpu")


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------
def queue_publish(ctrl, ready_hi, index: int, *, seal: bool) -> None:
    """Publish ``ready_hi[index]`` ready positions (``seal``: the final count, with the SEALED bit) into
    the queue's ready word ``ctrl[CTRL_READY]`` (release), on the current stream."""
    _queue_publish_kernel[(1,)](ctrl, ready_hi, index, SEAL=seal, num_warps=1)


def persistent_moe(ctrl, cap: int, ready_list, block_expert, a, asf, w1, w1sf, h1, h1sf, w2, w2sf, roww, comb_rows,
                   row_src, row_tok, row_chunk, comb_delta, arrived, arrived_delta, status, *, ctas: int,
                   deadline_ns: int, block_m: int, group: int = 8, inject: int = 0, trace=None, witness=None,
                   stall_l1_us: int = 0):
    """Launch the persistent consumer (``ctas`` CTAs) on the current stream; returns Triton's kernel handle.

    ``ctrl`` int32 ``[CTRL_WORDS + 2 * cap]`` (claim counter, ready word, ``l1_done[cap]``, ``l2_done[cap]``),
    zeroed before the launch; ``cap`` the ready list's capacity. The block consumer's buffers (``a``/``h1``
    float8_e4m3fn); ``comb_rows`` this PE's combine rows (bf16 ``[rows, H]``) with ``comb_delta`` (int64
    element distances to every PE's copy); ``arrived`` this PE's arrival words (int64) with ``arrived_delta``
    (int64 word distances to every PE's copy); ``status`` the ring's RS_* words (int64). ``inject``: bits of
    :data:`QUEUE_INJECT_BITS`. ``trace`` (int32 ``[total_items(cap) * 4]``: CTA + 1, L2?, position, tile of
    every computed claim), ``witness`` (int64 ``[1]``: poisoned elements an owner would read at the
    arrival signals) and ``stall_l1_us`` (the first group's L1 tiles pause this long first, on a GPU) are
    for tests.
    """
    if not isinstance(ctas, int) or ctas < 1:
        raise ValueError(f"ctas must be an integer >= 1, got {ctas!r}")
    _, h, i = w2.shape
    cfg = _gemm_cfg(block_m, gemm="persistent")
    nw = cfg["num_warps"]
    if trace is not None and trace.numel() < 4 * total_items(cap, i // 128, h // 128, group):
        raise ValueError(f"trace must hold 4 * total_items(cap) = {4 * total_items(cap, i // 128, h // 128, group)} "
                         f"int32, got {trace.numel()}")
    return _persistent_moe_kernel[(ctas,)](
        ctrl, ready_list, block_expert, a, asf, w1, w1sf, h1, h1sf, w2, w2sf, roww, comb_rows, row_src, row_tok,
        row_chunk, comb_delta, arrived, arrived_delta, status, ctrl if trace is None else trace,
        arrived if witness is None else witness, cap, int(deadline_ns), H=h, I=i, BM=block_m, GROUP=group,
        STAGES=cfg["STAGES"], NW=nw, INJECT=int(inject), TRACE=trace is not None, WITNESS=witness is not None,
        STALL_L1_US=int(stall_l1_us), num_warps=nw)
