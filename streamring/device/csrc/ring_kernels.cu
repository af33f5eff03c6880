// streamring: the ring kernels a streamed layer enqueues (streamring/ring/device.py launches them
// through the typed launchers of streamring/device/kernels.py).
//
// Every kernel takes the ring's descriptor and its symmetric base; the ones that touch peers
// take `peers` (the device table of peer pointers: P2P transport) or nullptr (NVSHMEM device
// API), chosen once per ring by the host. num_chunks <= 0 in the descriptor makes every kernel
// return at once (the warm-up launches).
#include "ring_protocol.cuh"

// Owner reuse wait before writing chunk `chunk` (no-op for chunk < num_slots).
extern "C" __global__ void SR_ONE_WARP ring_reuse_wait(const RingDesc* d, uint8_t* buf, int me, int64_t chunk,
                                                       int inject) {
    if (threadIdx.x != 0 || d->num_chunks <= 0 || chunk < d->num_slots) return;
    uint64_t e = cur_epoch(d);
    owner_collect(d, buf, me, chunk % d->num_slots, chunk - d->num_slots, e, inject, RE_REUSE_TIMEOUT);
}

// End of stream: collect the acks of the last chunk of every slot, leaving every mask zero.
extern "C" __global__ void SR_ONE_WARP ring_drain(const RingDesc* d, uint8_t* buf, int me) {
    if (threadIdx.x != 0 || d->num_chunks <= 0) return;
    uint64_t e = cur_epoch(d);
    const int64_t n = d->num_chunks, S = d->num_slots;
    for (int64_t s = 0; s < S && s < n; ++s) {
        int64_t last = s + ((n - 1 - s) / S) * S;
        owner_collect(d, buf, me, s, last, e, 0, RE_DRAIN_TIMEOUT);
    }
}

// One thread increments the device epoch word. Put last in a captured graph (after every
// stream joined) so the next replay runs the next epoch.
extern "C" __global__ void SR_ONE_WARP ring_advance_epoch(const RingDesc* d) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        d->epoch[0] = d->epoch[0] + 1;
        __threadfence_system();
    }
}

// Progress policy spin_kernel (and the exact generation check of every policy): one thread per
// block spins (acquire, with deadline) until the route and layout generations of (src, chunk)
// are ready. Grid = #sources: block b waits for source src0 + b.
extern "C" __global__ void SR_ONE_WARP ring_spin_wait(const RingDesc* d, uint8_t* buf, int64_t src0, int64_t chunk,
                                                      int inject) {
    if (threadIdx.x != 0 || d->num_chunks <= 0 || (inject & INJ_SKIP_ACQUIRE)) return;
    uint64_t g = ring_make_gen(cur_epoch(d), chunk);
    acquire_wait(d, buf, src0 + blockIdx.x, chunk, g, inject);
}

// Publish one readiness generation (kind RING_ROUTE or RING_LAYOUT) of my slot's chunk `chunk`
// at every PE; the payload was written by earlier kernels of this stream (stream order). Before
// the release it writes the kind's metadata words of the slot (route: chunk index, token base,
// valid tokens, generation, time; layout: generation, time), so a consumer can check them
// (ring_acquire_checked); the release inside publish() orders payload and metadata before the
// generation. The valid count is `*valid_ptr` when given (a device word: the count of a forward
// whose token count lives on the device, e.g. a CUDA graph replayed with varying counts), else
// `valid`.
extern "C" __global__ void SR_ONE_WARP ring_publish(const RingDesc* d, uint8_t* buf, const uint64_t* peers, int me,
                                                    int64_t chunk, int kind, int64_t valid, const int64_t* valid_ptr) {
    if (d->num_chunks <= 0 || threadIdx.x != 0) return;
    const uint64_t g = ring_make_gen(cur_epoch(d), chunk);
    uint64_t* m = meta_words(d, buf, chunk % d->num_slots);
    if (kind == RING_ROUTE) {
        m[META_CHUNK] = (uint64_t)chunk;
        m[META_BASE] = (uint64_t)(chunk * d->tokens_per_slot);
        m[META_VALID] = (uint64_t)(valid_ptr ? *valid_ptr : valid);
        m[META_ROUTE_GEN] = g;
        m[META_ROUTE_NS] = global_timer_ns();
    } else {
        m[META_LAYOUT_GEN] = g;
        m[META_LAYOUT_NS] = global_timer_ns();
    }
    SR_WITH_TRANSPORT(buf, me, peers, publish(d, x, kind, chunk, g));
}

// Consumer: acquire both generations of (src0 + blockIdx.x, chunk), then check the source's
// metadata words and record its valid count in valid_tab (check_meta). Grid = #sources, one
// thread works.
extern "C" __global__ void SR_ONE_WARP ring_acquire_checked(const RingDesc* d, uint8_t* buf, const uint64_t* peers,
                                                            int me, int64_t src0, int64_t chunk, int* valid_tab,
                                                            int inject) {
    if (threadIdx.x != 0 || d->num_chunks <= 0) return;
    const int64_t src = src0 + blockIdx.x;
    const uint64_t g = ring_make_gen(cur_epoch(d), chunk);
    if (!(inject & INJ_SKIP_ACQUIRE) && !acquire_wait(d, buf, src, chunk, g, inject)) {
        valid_tab[chunk * d->num_ranks + src] = 0;  // timed out or violated: the rows are absent
        return;
    }
    SR_WITH_TRANSPORT(buf, me, peers, check_meta(d, x, src, chunk, g, valid_tab, inject));
}

// Acknowledge (src0 + blockIdx.x, chunk): the caller's earlier kernels on this stream acquired
// (ring_spin_wait) and copied what they need out of the slot; stream order puts their reads
// before this kernel, whose release precedes the fetch_or. Grid = #sources.
extern "C" __global__ void SR_ONE_WARP ring_ack(const RingDesc* d, uint8_t* buf, const uint64_t* peers, int me,
                                                int64_t src0, int64_t chunk) {
    if (d->num_chunks <= 0 || threadIdx.x != 0) return;
    __threadfence_system();
    const uint64_t g = ring_make_gen(cur_epoch(d), chunk);
    SR_WITH_TRANSPORT(buf, me, peers, ack_slot(d, x, src0 + blockIdx.x, chunk, g, 0));
}

// Both generation words of (src, slot), acquire-loaded: GEN_READY when both are `g`, GEN_VIOLATION when
// either is (the offending word in *bad), else not ready yet. One probe of ring_wait_any's scans.
static __device__ __forceinline__ int probe_source(const RingDesc* d, uint8_t* buf, int src, int64_t slot, uint64_t g,
                                                   int inject, uint64_t* bad) {
    const uint64_t r = ld_acquire_sys_u64(route_gen_word(d, buf, src, slot));
    const uint64_t l = ld_acquire_sys_u64(layout_gen_word(d, buf, src, slot));
    const int cr = classify(d, r, g, inject), cl = classify(d, l, g, inject);
    if (cr == GEN_VIOLATION || cl == GEN_VIOLATION) {
        *bad = cr == GEN_VIOLATION ? r : l;
        return GEN_VIOLATION;
    }
    return cr == GEN_READY && cl == GEN_READY ? GEN_READY : GEN_OLDER;
}

// Consumer, ready order (the RFC's later optimisation: process sources independently): wait
// (acquire, deadline) until ANY source still pending for `chunk` has both generations ready; then,
// with max_take > 1, keep taking pending sources that are ready until max_take are taken, none is
// pending, or window_ns have passed since the first was found (one dispatch step then serves every
// source that arrived together: one GEMM call instead of one per source). Every taken source's
// metadata is checked and its valid count recorded as ring_acquire_checked does; it leaves *pending
// (one bit per source; reset to every source when `first`) and goes to chosen[0..max_take), in the
// order taken, the rest -1. The data kernels that follow read the sources from `chosen`, so the
// order and the grouping are decided on the device at run time (a CUDA graph stays fixed).
//
// Ordering: each taken source has its own acquire loads of both generation words, each followed by
// the same check_meta; the data kernels follow the one __threadfence_system in stream order, and
// ring_ack_chosen releases before the acknowledgements. A grouped step (acquire A, acquire B, copy A
// and B, ack A and B) is trace-equivalent to the model checker's ready order (acquire A, copy, ack A,
// then B; streamring.verify.ep): B's acquire and copy read only B's slot and generation words, which
// no other process writes while B is unacknowledged by this consumer, and A's ack writes only A's
// mask, so they commute; the grouped order only holds A's slot longer, as a slow consumer does.
//
// Nothing pending at entry (an earlier step of this chunk took every source): nothing is waited for
// and chosen is all -1 (the step's data kernels then do nothing). One thread. On a violation or the
// deadline while waiting for the FIRST source the error is recorded and the lowest pending source is
// taken with no rows (the forward then fails its checks; nothing waits forever); a violation seen
// while gathering more ends the gathering and leaves that source pending for a later step.
// num_ranks <= 64.
extern "C" __global__ void SR_ONE_WARP ring_wait_any(const RingDesc* d, uint8_t* buf, const uint64_t* peers, int me,
                                                     int64_t chunk, int* valid_tab, uint64_t* pending, int first,
                                                     int* chosen, int max_take, int64_t window_ns, int inject) {
    if (threadIdx.x != 0 || blockIdx.x != 0 || d->num_chunks <= 0) return;
    const uint64_t all = full_mask(d, 0);
    if (first) *pending = all;
    for (int i = 0; i < max_take; ++i) chosen[i] = -1;
    uint64_t m = *pending;
    if (!m) return;
    const uint64_t g = ring_make_gen(cur_epoch(d), chunk);
    const int64_t slot = chunk % d->num_slots;
    const long long start = clock64();
    int pick = __ffsll((long long)m) - 1;
    bool ok = false, slow = false;
    for (int64_t spins = 0; m && !ok; ++spins) {
        for (uint64_t left = m; left; left &= left - 1) {
            const int src = __ffsll((long long)left) - 1;
            uint64_t bad = 0;
            const int st = probe_source(d, buf, src, slot, g, inject, &bad);
            if (st == GEN_VIOLATION) {
                record_error(d, RE_NEWER_GEN, src, chunk, bad, g);
                pick = src;
                m = 0;
                break;
            }
            if (st == GEN_READY) {
                pick = src;
                ok = true;
                break;
            }
        }
        if (!ok && m && (aborted(d) || clock64() - start > d->deadline_cycles)) {
            record_error(d, RE_ACQUIRE_TIMEOUT, pick, chunk, m, 0);
            break;
        }
        if (spins == 4096 && !ok && m) {
            note_slow_wait(d, WB_ACQUIRE_ANY, pack_wait(RE_ACQUIRE_TIMEOUT, 0, chunk), m);
            slow = true;
        }
        if (spins > 4096) __nanosleep(64);
    }
    // the note is taken back only when one was made: a host-memory load costs a PCIe round trip
    if (ok && slow) end_slow_wait(d, WB_ACQUIRE_ANY, pack_wait(RE_ACQUIRE_TIMEOUT, 0, chunk));
    uint64_t taken = 1ull << pick;
    int n = 1;
    chosen[0] = pick;
    if (ok && max_take > 1) {
        // gather the sources that arrive with the first: bounded by window_ns (a window of 0 takes only
        // those ready at once), never past the deadline of the first wait
        const uint64_t t0 = global_timer_ns();
        uint64_t rest = *pending & ~taken;
        bool stop = false;
        while (rest && n < max_take && !stop) {
            for (uint64_t left = rest; left && n < max_take; left &= left - 1) {
                const int src = __ffsll((long long)left) - 1;
                uint64_t bad = 0;
                const int st = probe_source(d, buf, src, slot, g, inject, &bad);
                if (st == GEN_VIOLATION) {
                    stop = true;  // a later step's first wait records it
                    break;
                }
                if (st == GEN_READY) {
                    taken |= 1ull << src;
                    rest &= ~(1ull << src);
                    chosen[n++] = src;
                }
            }
            if (global_timer_ns() - t0 >= (uint64_t)window_ns || aborted(d) ||
                clock64() - start > d->deadline_cycles)
                break;
        }
    }
    __threadfence_system();
    for (int i = 0; i < n; ++i) {
        if (ok) {
            SR_WITH_TRANSPORT(buf, me, peers, check_meta(d, x, chosen[i], chunk, g, valid_tab, inject));
        } else {
            valid_tab[chunk * d->num_ranks + chosen[i]] = 0;
        }
    }
    *pending &= ~taken;
}

// Acknowledge chunk `chunk` of the sources chosen[0..count) that are not -1: the ready-order form of
// ring_ack (the sources were taken on the device by ring_wait_any; the reads of their slots are
// earlier kernels of this stream, and the release below precedes every fetch_or).
extern "C" __global__ void SR_ONE_WARP ring_ack_chosen(const RingDesc* d, uint8_t* buf, const uint64_t* peers, int me,
                                                       const int* chosen, int count, int64_t chunk) {
    if (d->num_chunks <= 0 || threadIdx.x != 0 || blockIdx.x != 0) return;
    __threadfence_system();
    const uint64_t g = ring_make_gen(cur_epoch(d), chunk);
    for (int i = 0; i < count; ++i) {
        if (chosen[i] < 0) continue;
        SR_WITH_TRANSPORT(buf, me, peers, ack_slot(d, x, (int64_t)chosen[i], chunk, g, 0));
    }
}
