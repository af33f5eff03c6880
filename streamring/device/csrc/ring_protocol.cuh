// streamring: the chunk-ready ring protocol on the device, using only the descriptor's offsets.
//
// The steps and their ordering argument are those of streamring/ring/protocol.py (rules 1-8 of its
// module docstring); this file is their device form:
//  * publish      - rule 1: payload stores, release, then the generation SET at every PE;
//  * acquire_wait - rule 2: ld.acquire.sys of both generations (with a deadline) before any read;
//  * ack_slot     - rule 3: every read done (caller's fence + barrier), release, fetch_or of my bit;
//  * owner_collect- rules 3/4: full mask (acquire) before reuse; record, then clear the mask;
//  * classify     - rule 6: epoch-tagged generations (no ABA across wraps or graph replays).
// libnvshmem 3.4.5's nvshmem_signal_wait_until has no trailing fence and no deadline, so the
// waits here are our own acquire loops with a clock64 deadline.
#pragma once

#include "ring_desc.cuh"
#include "transport.cuh"

// Kernels launched as one warp per block (the ring's waits, acknowledgements and publications, the
// owner's arrival wait, the arrival counts, the benchmark's delay) are capped at 32 registers, so one
// fits on an SM beside a CTA of an expert GEMM: a CUTLASS or DeepGEMM SM90 FP8 CTA of 384 threads at
// 168 registers holds 64,512 of the SM's 65,536 and leaves 1,024, one warp's worth at 32 (it leaves
// shared memory too: 217,600 B of the 233,472). Without the cap (ring_wait_any compiles to 66), a wait
// that spins while a persistent, statically scheduled GEMM grid is launched keeps one of that grid's
// CTAs off every SM until the wait ends, and that CTA's share of the tiles starts only then; the
// spills the cap costs are a few local loads per probe of a loop that polls memory anyway.
// tests/unit/test_gpu.py compiles every such kernel and checks its registers.
#ifndef SR_ONE_WARP
#define SR_ONE_WARP __maxnreg__(32)
#endif

static __device__ __forceinline__ uint64_t* word_at(uint8_t* buf, int64_t off) { return (uint64_t*)(buf + off); }
static __device__ __forceinline__ uint64_t* route_gen_word(const RingDesc* d, uint8_t* buf, int64_t src,
                                                           int64_t slot) {
    return word_at(buf, d->off_route_ready_gen + (src * d->num_slots + slot) * 8);
}
static __device__ __forceinline__ uint64_t* layout_gen_word(const RingDesc* d, uint8_t* buf, int64_t src,
                                                            int64_t slot) {
    return word_at(buf, d->off_layout_ready_gen + (src * d->num_slots + slot) * 8);
}
static __device__ __forceinline__ uint64_t* consumed_gen_word(const RingDesc* d, uint8_t* buf, int64_t src,
                                                              int64_t slot) {
    return word_at(buf, d->off_consumed_gen + (src * d->num_slots + slot) * 8);
}
static __device__ __forceinline__ uint64_t* ack_word(const RingDesc* d, uint8_t* buf, int64_t slot, int64_t w) {
    return word_at(buf, d->off_ack_mask + (slot * d->mask_words + w) * 8);
}
static __device__ __forceinline__ uint64_t* meta_words(const RingDesc* d, uint8_t* buf, int64_t slot) {
    return word_at(buf, d->off_meta + slot * d->meta_words * 8);
}
static __device__ __forceinline__ uint64_t* wake_word(const RingDesc* d, uint8_t* buf, int kind, int64_t src,
                                                      int64_t slot) {
    return word_at(buf, d->off_wake + ((kind * d->num_ranks + src) * d->num_slots + slot) * 8);
}
static __device__ __forceinline__ uint64_t full_mask(const RingDesc* d, int64_t w) {
    int64_t n = d->num_ranks - 64 * w;
    if (n >= 64) return ~0ull;
    return (1ull << n) - 1ull;
}
static __device__ __forceinline__ uint64_t cur_epoch(const RingDesc* d) { return ld_relaxed_sys_u64(d->epoch); }

// code | src << 8 | chunk << 24: an error (RS_FIRST_ERROR) or a slow wait (the wait beacon) names what
// it is about (src -1 reads back as 0xffff: no single source, e.g. the owner's combine).
static __device__ __forceinline__ uint64_t pack_wait(int code, int64_t src, int64_t chunk) {
    return (uint64_t)code | ((uint64_t)(src & 0xffff) << 8) | ((uint64_t)(chunk & 0xffffffffll) << 24);
}

// Record an error in the status words. The first one keeps its details: RS_FIRST_ERROR packs
// pack_wait(code, src, chunk) | (field + 1) << 56 (field: the META_* word of an RE_META, else -1).
static __device__ void record_error(const RingDesc* d, int code, int64_t src, int64_t chunk, uint64_t seen,
                                    uint64_t want, int field = -1) {
    unsigned long long packed = pack_wait(code, src, chunk) | ((unsigned long long)((field + 1) & 0xff) << 56);
    if (atomicCAS(&d->status[RS_FIRST_ERROR], 0ull, packed) == 0ull) {
        d->status[RS_BAD_SEEN] = seen;
        d->status[RS_BAD_WANT] = want;
    }
    if (code == RE_ACQUIRE_TIMEOUT || code == RE_REUSE_TIMEOUT || code == RE_DRAIN_TIMEOUT ||
        code == RE_COMBINE_TIMEOUT) {
        atomicAdd(&d->status[RS_TIMEOUTS], 1ull);
        atomicExch(&d->status[RS_ABORT], 1ull);
    } else {
        atomicAdd(&d->status[RS_VIOLATIONS], 1ull);
    }
    __threadfence_system();
}

// A wait that goes slow writes what it waits for into the wait beacon, in pinned host memory. Why host
// memory: under MPS the heap of a peer whose process died is unmapped, and this PE's next access to it
// ends its context with an illegal-address fault; the status words (device memory) are then unreadable,
// host memory is not, so the host can still say which source, chunk and generation the forward waited
// for. One pair of words per kind of wait (WB_*): the last slow wait of each kind wins, and a slow wait
// that ends well takes its note back (if no later wait of its kind overwrote it), so what the host reads
// after a fault are the waits still pending. Relaxed system-scope stores with no ordering duty (a
// diagnostic, read by the host after the forward ended or faulted); the two words of a kind may come
// from two waits of that kind, and a wait ending as another of its kind notes itself may erase that note.
static __device__ void note_slow_wait(const RingDesc* d, int kind, uint64_t packed, uint64_t want) {
    if (d->wait_beacon == nullptr) return;
    st_relaxed_sys_u64(&d->wait_beacon[2 * kind + WB_WANT], want);
    st_relaxed_sys_u64(&d->wait_beacon[2 * kind + WB_PACKED], packed);
}
static __device__ void end_slow_wait(const RingDesc* d, int kind, uint64_t packed) {
    if (d->wait_beacon == nullptr) return;
    if (ld_relaxed_sys_u64(&d->wait_beacon[2 * kind + WB_PACKED]) == packed)
        st_relaxed_sys_u64(&d->wait_beacon[2 * kind + WB_PACKED], 0ull);
}

static __device__ __forceinline__ bool aborted(const RingDesc* d) {
    return ld_relaxed_sys_u64((const uint64_t*)&d->status[RS_ABORT]) != 0;
}

// Is the generation `seen` ready, older, or a violation, compared with `want`? (ring.layout.classify_gen)
static __device__ __forceinline__ int classify(const RingDesc* d, uint64_t seen, uint64_t want, int inject) {
    if (inject & INJ_IGNORE_EPOCH) {
        seen &= RING_SEQ_MASK;
        want &= RING_SEQ_MASK;
    }
    if (seen == want) return GEN_READY;
    if (seen == 0) return GEN_OLDER;
    uint64_t se = seen >> RING_SEQ_BITS, we = want >> RING_SEQ_BITS;
    uint64_t ss = seen & RING_SEQ_MASK, ws = want & RING_SEQ_MASK;
    if (se < we) return GEN_OLDER;
    if (se == we && ss < ws && (ws - ss) % (uint64_t)d->num_slots == 0) return GEN_OLDER;
    return GEN_VIOLATION;
}

// Acquire: wait until both generations of (src, chunk) equal `g` (one thread).
// Returns true when ready; on a deadline or a violation it records the error and returns false.
static __device__ bool acquire_wait(const RingDesc* d, uint8_t* buf, int64_t src, int64_t chunk, uint64_t g,
                                    int inject) {
    int64_t slot = chunk % d->num_slots;
    const uint64_t* words[2] = {route_gen_word(d, buf, src, slot), layout_gen_word(d, buf, src, slot)};
    long long start = clock64();
    const uint64_t note = pack_wait(RE_ACQUIRE_TIMEOUT, src, chunk);
    bool slow = false;
    for (int k = 0; k < 2; ++k) {
        for (int64_t spins = 0;; ++spins) {
            uint64_t seen = ld_acquire_sys_u64(words[k]);  // acquire (system scope)
            int st = classify(d, seen, g, inject);
            if (st == GEN_READY) break;
            if (st == GEN_VIOLATION) {
                record_error(d, RE_NEWER_GEN, src, chunk, seen, g);
                return false;
            }
            if (aborted(d) || clock64() - start > d->deadline_cycles) {
                record_error(d, RE_ACQUIRE_TIMEOUT, src, chunk, seen, g);
                return false;
            }
            // poll flat out first (the publish->acquire latency is what the ring is for), then back
            // off so a long wait does not hammer the memory system
            if (spins == 4096 && !slow) {
                note_slow_wait(d, WB_ACQUIRE, note, g);
                slow = true;
            }
            if (spins > 4096) __nanosleep(64);
        }
    }
    if (slow) end_slow_wait(d, WB_ACQUIRE, note);
    // the ld.acquire above already orders this thread's later loads; the fence extends it to what the
    // block does after its barrier (a kernel that acquires, then reads the slot with many threads)
    fence_acq_rel_sys();
    return true;
}

// A consumer's check of the metadata words of (src, chunk)'s slot, read from the source's copy after
// the acquire and before anything of the slot is used. A peer controls these words: the chunk index,
// the token base and both generations (`g`) must be exactly this chunk's, and the valid count must lie
// in [0, tokens_per_slot] (a peer's count is not known in advance: it varies per forward). The count
// is then recorded in valid_tab[chunk * num_ranks + src] for the data kernels; on any other value
// RE_META names the word (the first that differs), the count stays 0, and the data kernels treat the
// source's rows as absent, so nothing indexes past the slot. Returns true when all match. One thread.
// (INJ_IGNORE_EPOCH, a deliberate mutation, leaves the generation words unchecked.)
template <class X>
__device__ bool check_meta(const RingDesc* d, const X& x, int64_t src, int64_t chunk, uint64_t g, int* valid_tab,
                           int inject) {
    int* learned = valid_tab + chunk * d->num_ranks + src;
    *learned = 0;
    const uint8_t* pb = x.peer_base((int)src);
    const uint64_t* m = meta_words(d, x.buf, chunk % d->num_slots);
    const int word[4] = {META_CHUNK, META_BASE, META_ROUTE_GEN, META_LAYOUT_GEN};
    const uint64_t want[4] = {(uint64_t)chunk, (uint64_t)(chunk * d->tokens_per_slot), g, g};
    for (int i = 0; i < 4; ++i) {
        const uint64_t seen = x.load64(m + word[i], (int)src, pb);
        const bool unchecked = (inject & INJ_IGNORE_EPOCH) && i >= 2;
        if (seen != want[i] && !unchecked) {
            record_error(d, RE_META, src, chunk, seen, want[i], word[i]);
            return false;
        }
    }
    // unsigned compare: a negative count reads as a huge one and is refused the same way
    const uint64_t valid = x.load64(m + META_VALID, (int)src, pb);
    if (valid > (uint64_t)d->tokens_per_slot) {
        record_error(d, RE_META, src, chunk, valid, (uint64_t)d->tokens_per_slot, META_VALID);
        return false;
    }
    *learned = (int)valid;
    return true;
}

// Owner: wait until every PE acknowledged the chunk `prev_chunk` held in `slot`, record
// consumed_gen[me][slot] := gen(prev), then clear the mask (rule 4). One thread.
static __device__ bool owner_collect(const RingDesc* d, uint8_t* buf, int me, int64_t slot, int64_t prev_chunk,
                                     uint64_t epoch, int inject, int err_code) {
    if (!(inject & INJ_SKIP_ACK_WAIT)) {
        long long start = clock64();
        for (int64_t w = 0; w < d->mask_words; ++w) {
            uint64_t want = full_mask(d, w);
            // WB_ACK: the mask word in the source field, the ranks still to acknowledge as the want word
            const uint64_t note = pack_wait(err_code, w, prev_chunk);
            for (int64_t spins = 0;; ++spins) {
                uint64_t seen = ld_acquire_sys_u64(ack_word(d, buf, slot, w));
                if (seen == want) {
                    if (spins > 4096) end_slow_wait(d, WB_ACK, note);
                    break;
                }
                if (aborted(d) || clock64() - start > d->deadline_cycles) {
                    record_error(d, err_code, me, prev_chunk, seen, want);
                    return false;
                }
                if (spins == 4096) note_slow_wait(d, WB_ACK, note, want & ~seen);
                __nanosleep(32);
            }
        }
    }
    st_relaxed_sys_u64(consumed_gen_word(d, buf, me, slot), ring_make_gen(epoch, prev_chunk));
    for (int64_t w = 0; w < d->mask_words; ++w) atomicExch((unsigned long long*)ack_word(d, buf, slot, w), 0ull);
    __threadfence_system();
    return true;
}

// Publish one readiness generation of my slot at every PE (payload already in the slot).
// Called by one thread after the block's payload stores and a block barrier.
template <class X>
__device__ void publish(const RingDesc* d, const X& x, int kind, int64_t chunk, uint64_t g) {
    int64_t slot = chunk % d->num_slots;
    uint64_t* gw = kind == RING_ROUTE ? route_gen_word(d, x.buf, x.me, slot) : layout_gen_word(d, x.buf, x.me, slot);
    x.release();  // rule 1: payload before generation
    for (int pe = 0; pe < d->num_ranks; ++pe) x.signal_set(gw, g, pe);
    if (d->off_wake >= 0) {
        // Doorbell for the stream_wait policy: the lap of this slot within the stream (1, 2, ...),
        // epoch-free so that a value baked into a captured cuStreamWaitValue64 stays right.
        x.release();
        uint64_t lap = (uint64_t)(chunk / d->num_slots) + 1;
        uint64_t* ww = wake_word(d, x.buf, kind, x.me, slot);
        for (int pe = 0; pe < d->num_ranks; ++pe) x.signal_set(ww, lap, pe);
    }
    atomicAdd(&d->status[RS_PUBLISHED], 1ull);
}

// Publish both readiness generations of my slot with one release (a producer whose routing and
// layout are ready together): the same ordering as two publish() calls, one fence instead of two.
template <class X>
__device__ void publish_both(const RingDesc* d, const X& x, int64_t chunk, uint64_t g) {
    const int64_t slot = chunk % d->num_slots;
    uint64_t* rw = route_gen_word(d, x.buf, x.me, slot);
    uint64_t* lw = layout_gen_word(d, x.buf, x.me, slot);
    x.release();  // rule 1: payload before generation
    for (int pe = 0; pe < d->num_ranks; ++pe) {
        x.signal_set(rw, g, pe);
        x.signal_set(lw, g, pe);
    }
    atomicAdd(&d->status[RS_PUBLISHED], 2ull);
}

// Acknowledge (src, chunk) at the owner: one thread, after every read of the slot by this PE
// is complete (the caller's fence/barrier). Resets this PE's doorbells of the slot on its
// last lap first (stream_wait policy), then release + fetch_or of my bit in the owner's mask.
template <class X>
__device__ void ack_slot(const RingDesc* d, const X& x, int64_t src, int64_t chunk, uint64_t g, int inject) {
    const int64_t slot = chunk % d->num_slots;
    if (d->off_wake >= 0 && chunk + d->num_slots >= d->num_chunks) {
        // Last lap of this slot in the stream: reset our doorbells of (src, slot) BEFORE the
        // ack, so the owner's next-epoch doorbell (which needs this ack first) cannot be lost.
        st_relaxed_sys_u64(wake_word(d, x.buf, RING_ROUTE, src, slot), 0);
        st_relaxed_sys_u64(wake_word(d, x.buf, RING_LAYOUT, src, slot), 0);
    }
    x.release();
    int64_t w = x.me / 64;
    uint64_t bit = 1ull << (x.me % 64);
    uint64_t old = x.fetch_or(ack_word(d, x.buf, slot, w), bit, (int)src);
    if ((old & bit) && !(inject & INJ_SKIP_ACK_WAIT)) record_error(d, RE_DOUBLE_ACK, src, chunk, old, bit);
    st_relaxed_sys_u64(consumed_gen_word(d, x.buf, src, slot), g);  // own record (diagnostics)
    atomicAdd(&d->status[RS_CONSUMED], 1ull);
}
