// streamring: the cross-PE handoffs of the expert-parallel GPU layer (streamring/moe/ep_buffer.py).
//
// The ring carries each source's chunk (routing + FP8 activations) to every PE; these kernels
// carry the results back and synchronise the owner's reduce:
//
//  * combine area (one symmetric allocation per PE, laid out by ring.layout.CombineLayout):
//      arrived[max_chunks] uint64    rows of chunk c that reached this owner (signal words)
//      rows[max_tokens][topk][hidden] bf16   the L2 result of (logical token, k)
//  * a consumer's L2 writes each result row into its owner's rows[token][k] (P2P stores from the
//    GEMM's epilogue, or ep_put_rows with NVSHMEM puts where the owner has no pointer), then
//    ep_signal_arrivals / ep_put_rows ADD the number of rows to the owner's arrived[chunk]
//    (release), once per run of rows of one (owner, chunk) in a ready block;
//  * the owner waits until arrived[c] == expected[c] (acquire; ep_wait_arrivals) before it reads
//    the rows of chunk c, reduces them in the fixed k order, and resets arrived[c] to 0 before its
//    next epoch publishes anything (stream order), so no count is carried across epochs.
//
// Memory ordering of the P2P path, where the data (L2 epilogue stores into the owner) and the
// signal (this file) are different kernels of one stream: every store of the GEMM kernel happens
// before the signal kernel starts (stream order); each signalling thread executes
// fence.sc.sys (__threadfence_system) and then the release ADD, so the owner's acquire of the
// count observes the stores (the same cross-kernel pattern torch's symmetric-memory barrier
// relies on). Where the count is wrong or late, the owner records RE_COMBINE_COUNT /
// RE_COMBINE_TIMEOUT in the ring's status words and never reads a partial chunk silently.
#include "ring_protocol.cuh"

// Run-length over the rows of one ready block: (owner, chunk) runs of rows with owner >= 0
// (padding rows of a sealed partial block have owner -1). Rows of a block are appended in chunk
// order and, within a chunk, in source order, so runs are contiguous; `emit(src, chunk, n)`.
template <class F>
__device__ void for_each_run(const int* row_src, const int* row_chunk, int64_t row0, int block_m, F emit) {
    int cur_src = -1, cur_chunk = -1;
    uint64_t n = 0;
    for (int i = 0; i < block_m; ++i) {
        const int s = row_src[row0 + i], c = row_chunk[row0 + i];
        if (s != cur_src || c != cur_chunk) {
            if (n && cur_src >= 0) emit(cur_src, cur_chunk, n);
            cur_src = s, cur_chunk = c, n = 0;
        }
        ++n;
    }
    if (n && cur_src >= 0) emit(cur_src, cur_chunk, n);
}

// Consumer, after the L2 kernel of the ready range ready_list[ready_hi[lo_index] : ready_hi[hi_index]]
// stored its rows straight into the owners' combine rows (P2P): add each run's row count to the
// owner's arrived[chunk]. Grid = max_items (blocks beyond the range return), one thread works.
extern "C" __global__ void SR_ONE_WARP ep_signal_arrivals(const RingDesc* d, uint8_t* comb,
                                                          const uint64_t* comb_peers, int me, int64_t off_arrived,
                                                          const int* ready_list, const int* ready_hi,
                                                          int64_t lo_index, int64_t hi_index, const int* row_src,
                                                          const int* row_chunk, int block_m) {
    if (threadIdx.x != 0) return;
    const int lo = ready_hi[lo_index], hi = ready_hi[hi_index];
    if ((int)blockIdx.x >= hi - lo) return;
    const int64_t bid = ready_list[lo + blockIdx.x];
    __threadfence_system();  // the L2 stores (an earlier kernel of this stream) before the release ADDs
    uint64_t* arrived = (uint64_t*)(comb + off_arrived);
    SR_WITH_TRANSPORT(comb, me, comb_peers, for_each_run(row_src, row_chunk, bid * block_m, block_m,
                                                         [&](int src, int chunk, uint64_t n) {
                                                             x.signal_add(arrived + chunk, n, src);
                                                         }));
}

// Consumer, after the L2 kernel of the ready range wrote its rows into the local staging rows
// y[row][hidden] (bf16): copy each valid row into its owner's combine rows[token*topk + k] (row_tok),
// then add the runs' counts to the owners' arrived words. Grid = (max_items, parts): CTA (b, p) copies part p
// of ready block b's rows (block_m / parts rows, rounded up) and adds only its part's counts, after its own
// stores are fenced, so each ADD still publishes rows that are complete; several parts per block put more
// CTAs on the copy where a decode forward has few blocks (one CTA per block left most SMs idle).
// P2P (comb_peers given: every owner's combine area is load/store reachable): each warp copies whole
// rows with 16-byte stores through the peer pointer; every thread fences (system scope) after its
// stores, the block barrier follows, and thread 0's release ADD (P2pX::signal_add) publishes the
// count, so an owner that acquires the full count (ep_wait_arrivals) reads complete rows. NVSHMEM (no
// pointer, or the transport forced to 'nv'): nvshmemx_putmem_block per row, nvshmem_quiet (every
// put complete at its owner), the barrier, then the ADD. Rows are whole multiples of 16 bytes
// (hidden % 128 == 0) and every base is 16-byte aligned. SR_P2P_ROW_COPY=0 (a build define) takes the
// NVSHMEM path on P2P too, to measure one against the other.
#ifndef SR_P2P_ROW_COPY
#define SR_P2P_ROW_COPY 1
#endif
extern "C" __global__ void ep_put_rows(const RingDesc* d, uint8_t* comb, const uint64_t* comb_peers, int me,
                                       int64_t off_arrived, int64_t off_rows, const uint8_t* y_stage,
                                       int64_t hidden, const int* ready_list, const int* ready_hi,
                                       int64_t lo_index, int64_t hi_index, const int* row_src,
                                       const int64_t* row_tok, const int* row_chunk, int block_m) {
    const int lo = ready_hi[lo_index], hi = ready_hi[hi_index];
    if ((int)blockIdx.x >= hi - lo) return;
    const int per_part = (block_m + (int)gridDim.y - 1) / (int)gridDim.y;
    const int r0 = (int)blockIdx.y * per_part, r1 = min(block_m, r0 + per_part);
    if (r0 >= r1) return;
    const int64_t bid = ready_list[lo + blockIdx.x];
    const int64_t row_bytes = hidden * 2;
    if (SR_P2P_ROW_COPY && comb_peers) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
        const int64_t vecs = row_bytes / 16;
        for (int i = r0 + warp; i < r1; i += warps) {
            const int64_t row = bid * block_m + i;
            const int src = row_src[row];
            if (src < 0) continue;  // padding row of a sealed partial block
            const uint4* from = (const uint4*)(y_stage + row * row_bytes);
            uint4* to = (uint4*)((uint8_t*)comb_peers[src] + off_rows + row_tok[row] * row_bytes);
            for (int64_t v = lane; v < vecs; v += 32) to[v] = from[v];
        }
        __threadfence_system();  // this thread's row stores before the barrier and the release ADD
    } else {
        for (int i = r0; i < r1; ++i) {
            const int64_t row = bid * block_m + i;
            const int src = row_src[row];
            if (src < 0) continue;  // padding row of a sealed partial block
            nvshmemx_putmem_block(comb + off_rows + row_tok[row] * row_bytes, y_stage + row * row_bytes,
                                  row_bytes, src);
        }
        nvshmem_quiet();  // every thread: its part of the puts is complete at the owners
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    uint64_t* arrived = (uint64_t*)(comb + off_arrived);
    SR_WITH_TRANSPORT(comb, me, comb_peers, for_each_run(row_src, row_chunk, bid * block_m + r0, r1 - r0,
                                                         [&](int src, int chunk, uint64_t n) {
                                                             x.signal_add(arrived + chunk, n, src);
                                                         }));
}

// Consumer, NVSHMEM path of the dispatch: copy the slot of `chunk` of the sources src_list[grid]
// (device int32: every source, or those ring_wait_any took; -1: none, nothing is copied) into the local
// mirror (mirror + src * mirror_stride, at the ring's own offsets) with RMA gets, after the acquire; the
// dispatch kernels then read the mirror instead of peer memory. Blocking gets: the data is in the mirror when the
// kernel ends (stream order for the readers).
extern "C" __global__ void ep_pull_slots(const RingDesc* d, uint8_t* buf, uint8_t* mirror, int64_t mirror_stride,
                                         const int* src_list, int64_t chunk) {
    if (d->num_chunks <= 0) return;  // warm-up launch
    const int64_t src = src_list[blockIdx.x];
    if (src < 0) return;
    const int64_t s = chunk % d->num_slots;
    uint8_t* dst = mirror + src * mirror_stride;
    const int64_t off[4] = {d->off_topk_idx + s * d->stride_topk_idx_slot,
                            d->off_topk_weights + s * d->stride_topk_weights_slot, d->off_x + s * d->stride_x_slot,
                            d->off_x_sf + s * d->stride_x_sf_slot};
    const int64_t len[4] = {d->stride_topk_idx_slot, d->stride_topk_weights_slot, d->stride_x_slot,
                            d->stride_x_sf_slot};
    for (int r = 0; r < 4; ++r) nvshmemx_getmem_block(dst + off[r], buf + off[r], len[r], (int)src);
}

// Owner: wait until the rows of chunks [first_chunk, first_chunk + num_chunks) arrived (arrived[c] ==
// expected[c], acquire) so that the reduce reads only complete chunks of this forward. A count above
// the expectation is a violation (RE_COMBINE_COUNT); the deadline records RE_COMBINE_TIMEOUT, both
// with the chunk. One thread.
extern "C" __global__ void SR_ONE_WARP ep_wait_arrivals(const RingDesc* d, const uint8_t* comb, int64_t off_arrived,
                                                        const int64_t* expected, int64_t first_chunk,
                                                        int64_t num_chunks) {
    if (threadIdx.x != 0 || blockIdx.x != 0 || d->num_chunks <= 0) return;
    const uint64_t* arrived = (const uint64_t*)(comb + off_arrived);
    const long long start = clock64();
    for (int64_t c = first_chunk; c < first_chunk + num_chunks; ++c) {
        const uint64_t want = (uint64_t)expected[c];
        const uint64_t note = pack_wait(RE_COMBINE_TIMEOUT, -1, c);
        for (int64_t spins = 0;; ++spins) {
            const uint64_t seen = ld_acquire_sys_u64(arrived + c);
            if (seen == want) {
                if (spins > 4096) end_slow_wait(d, WB_COMBINE, note);
                break;
            }
            if (seen > want) {
                record_error(d, RE_COMBINE_COUNT, -1, c, seen, want);
                return;
            }
            if (aborted(d) || clock64() - start > d->deadline_cycles) {
                record_error(d, RE_COMBINE_TIMEOUT, -1, c, seen, want);
                return;
            }
            if (spins == 4096) note_slow_wait(d, WB_COMBINE, note, want);
            __nanosleep(64);
        }
    }
    // the reduce that follows (another kernel of this stream) reads rows other PEs stored
    fence_acq_rel_sys();
}

// A straggler on purpose: one thread spins for *ns nanoseconds of %globaltimer (a device word, so a
// captured graph can be replayed with and without the delay).
extern "C" __global__ void SR_ONE_WARP ep_delay(const int64_t* ns) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const int64_t wait = *ns;
    if (wait <= 0) return;
    const uint64_t t0 = global_timer_ns();
    while (global_timer_ns() - t0 < (uint64_t)wait) __nanosleep(1000);
}

// Latency benchmark of the ring across PEs: PE `me` and PE `peer` bounce chunks 0 .. nchunks-1
// (nchunks <= num_slots: no slot is reused, so no acknowledgement is needed). The initiator
// publishes both generations of chunk c (`together`: one release for both, publish_both(); else two
// publish() calls, as the layer's producer does) and acquires the peer's chunk c (acquire_wait, as
// the layer's consumer does); the responder acquires, then publishes. out_ns[c] = the initiator's
// round trip of chunk c. One thread; advance the epoch between launches.
extern "C" __global__ void ring_pingpong(const RingDesc* d, uint8_t* buf, const uint64_t* peers, int me, int peer,
                                         int initiator, int together, int64_t nchunks, uint64_t* out_ns) {
    if (threadIdx.x != 0 || blockIdx.x != 0 || d->num_chunks <= 0) return;
    const uint64_t e = cur_epoch(d);
    SR_WITH_TRANSPORT(buf, me, peers, {
        for (int64_t c = 0; c < nchunks; ++c) {
            const uint64_t g = ring_make_gen(e, c);
            if (initiator) {
                const uint64_t t0 = global_timer_ns();
                if (together) {
                    publish_both(d, x, c, g);
                } else {
                    publish(d, x, RING_ROUTE, c, g);
                    publish(d, x, RING_LAYOUT, c, g);
                }
                if (!acquire_wait(d, buf, peer, c, g, 0)) return;
                out_ns[c] = global_timer_ns() - t0;
            } else {
                if (!acquire_wait(d, buf, peer, c, g, 0)) return;
                if (together) {
                    publish_both(d, x, c, g);
                } else {
                    publish(d, x, RING_ROUTE, c, g);
                    publish(d, x, RING_LAYOUT, c, g);
                }
            }
        }
    });
}

// The physical floor of the same handoff: one flag, st.release.sys into the peer's memory and
// ld.acquire.sys spin on our own, `iters` round trips of values base+1 .. base+iters.
// out_ns[0] = the initiator's total time (round trip = out_ns[0] / iters).
extern "C" __global__ void flag_pingpong(uint64_t* my_flag, uint64_t* peer_flag, int initiator, int64_t iters,
                                         uint64_t base, int64_t deadline_cycles, uint64_t* out_ns) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const long long start = clock64();
    const uint64_t t0 = global_timer_ns();
    for (int64_t i = 1; i <= iters; ++i) {
        const uint64_t v = base + (uint64_t)i;
        if (initiator) st_release_sys_u64(peer_flag, v);
        while (ld_acquire_sys_u64(my_flag) < v) {
            if (clock64() - start > deadline_cycles) {
                out_ns[0] = 0;
                return;
            }
        }
        if (!initiator) st_release_sys_u64(peer_flag, v);
    }
    out_ns[0] = global_timer_ns() - t0;
}
