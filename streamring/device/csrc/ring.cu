// streamring device library: the verb kernels of the NVSHMEM backend and the
// device-side chunk-ready ring protocol.
//
// Build (streamring/device/build.py does this, cached):
//   nvcc -arch=sm_90 -rdc=true -I$NVSHMEM_INC -c ring.cu -o ring.o
//   nvcc -arch=sm_90 -dlink --cubin -o ring.cubin ring.o -L$NVSHMEM_LIB -lnvshmem_device
// Load with cuda.core.ObjectCode.from_cubin and register it with
// nvshmem.core.library_init before launching any kernel that calls NVSHMEM.
//
// Memory model (the contract of streamring/device/verbs.py):
//  * release = every thread's stores, then __threadfence_system (fence.sc.sys),
//    block barrier, then one thread's nvshmem_fence + signal/atomic;
//  * acquire = one thread's ld.acquire.sys of the generation word, block barrier,
//    then payload loads with ld.relaxed.sys (never stale L1 lines across replays).
//    libnvshmem 3.4.5's nvshmem_signal_wait_until has no trailing fence, so we
//    use our own acquire loads (with a deadline) instead.
//
// Two transports instantiate the same protocol functions:
//  * NvX  - the NVSHMEM device API (nvshmemx_signal_op, nvshmem_uint64_atomic_fetch_or,
//           nvshmem_fence, nvshmem_ptr / nvshmem_uint32_g). Needs the library's
//           device state, i.e. the context in which library_init ran.
//  * P2pX - plain PTX on peer pointers taken from nvshmem_ptr once on the host side
//           (sr_peer_table). Context-free: used for kernels launched in green contexts,
//           where the library's NVSHMEM device state is not initialised.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "ring_desc.cuh"

static_assert(sizeof(RingDesc) == RING_DESC_WORDS * 8, "RingDesc must be RING_DESC_WORDS packed 8-byte words");

// ------------------------------------------------------------------------------------------
// PTX helpers
// ------------------------------------------------------------------------------------------
__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint64_t ld_relaxed_sys_u64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint32_t ld_relaxed_sys_u32(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_relaxed_sys_u64(uint64_t* p, uint64_t v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys_u64(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t atom_or_release_sys(uint64_t* p, uint64_t v) {
    uint64_t old;
    asm volatile("atom.release.sys.global.or.b64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    return old;
}
__device__ __forceinline__ uint64_t atom_add_release_sys(uint64_t* p, uint64_t v) {
    uint64_t old;
    asm volatile("atom.release.sys.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    return old;
}
__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// ------------------------------------------------------------------------------------------
// (a) verb kernels: one launch per host verb, then a stream sync on the host.
//     Pointers are symmetric addresses (this PE's copy); pe is the target.
//     op: 0 = SET, 1 = ADD (translated here so Python never depends on enum values).
// ------------------------------------------------------------------------------------------
__device__ __forceinline__ int sr_sig_op(int op) { return op == 1 ? NVSHMEM_SIGNAL_ADD : NVSHMEM_SIGNAL_SET; }

extern "C" __global__ void sr_put(uint8_t* dst, const uint8_t* src, uint64_t nbytes, int pe) {
    nvshmemx_putmem_block(dst, src, nbytes, pe);
}

extern "C" __global__ void sr_get(uint8_t* dst, const uint8_t* src, uint64_t nbytes, int pe) {
    nvshmemx_getmem_block(dst, src, nbytes, pe);
}

// Payload first, then the signal (nvshmemx_putmem_signal_block fences in between).
extern "C" __global__ void sr_put_signal(uint8_t* dst, const uint8_t* src, uint64_t nbytes, uint64_t* sig,
                                         uint64_t value, int op, int pe) {
    nvshmemx_putmem_signal_block(dst, src, nbytes, sig, value, sr_sig_op(op), pe);
}

// Release: the device signal_op of libnvshmem 3.4.5 has no leading fence; add one
// (quiet: completes earlier puts to every PE, fence.sc.sys: our local stores).
extern "C" __global__ void sr_signal_op(uint64_t* sig, uint64_t value, int op, int pe) {
    nvshmem_quiet();
    __threadfence_system();
    nvshmemx_signal_op(sig, value, sr_sig_op(op), pe);
}

// Acquire load of our own signal word; *out may be mapped host memory.
extern "C" __global__ void sr_signal_fetch(const uint64_t* sig, uint64_t* out) {
    uint64_t v = ld_acquire_sys_u64(sig);
    *out = v;
    __threadfence_system();
}

extern "C" __global__ void sr_atomic_fetch_or(uint64_t* dst, uint64_t value, int pe, uint64_t* out) {
    nvshmem_quiet();
    __threadfence_system();
    *out = nvshmem_uint64_atomic_fetch_or(dst, value, pe);
    __threadfence_system();
}

extern "C" __global__ void sr_atomic_fetch_add(uint64_t* dst, uint64_t value, int pe, uint64_t* out) {
    nvshmem_quiet();
    __threadfence_system();
    *out = nvshmem_uint64_atomic_fetch_add(dst, value, pe);
    __threadfence_system();
}

extern "C" __global__ void sr_fence() {
    __threadfence_system();
    nvshmem_fence();
}

extern "C" __global__ void sr_quiet() {
    nvshmem_quiet();
    __threadfence_system();
}

// out[pe] = nvshmem_ptr(base, pe) (0 where the peer is not load/store reachable).
extern "C" __global__ void sr_peer_table(const uint8_t* base, uint64_t* out, int npes) {
    for (int pe = threadIdx.x; pe < npes; pe += blockDim.x) out[pe] = (uint64_t)nvshmem_ptr(base, pe);
}

extern "C" __global__ void sr_my_pe(int* out) {
    out[0] = nvshmem_my_pe();
    out[1] = nvshmem_n_pes();
}

// ------------------------------------------------------------------------------------------
// transports
// ------------------------------------------------------------------------------------------
struct NvX {
    uint8_t* buf;  // symmetric base of the ring buffer (this PE's copy)
    int me;
    __device__ const uint8_t* peer_base(int pe) const { return (const uint8_t*)nvshmem_ptr(buf, pe); }
    // order everything before (local stores, puts, reads) before what follows, system scope
    __device__ void release() const {
        __threadfence_system();
        nvshmem_fence();
    }
    __device__ void signal_set(uint64_t* sym, uint64_t v, int pe) const {
        nvshmemx_signal_op(sym, v, NVSHMEM_SIGNAL_SET, pe);
    }
    __device__ uint64_t fetch_or(uint64_t* sym, uint64_t v, int pe) const {
        return nvshmem_uint64_atomic_fetch_or(sym, v, pe);
    }
    __device__ uint32_t load32(const uint32_t* sym, int pe, const uint8_t* pb) const {
        if (pb) return ld_relaxed_sys_u32((const uint32_t*)(pb + ((const uint8_t*)sym - buf)));
        return nvshmem_uint32_g(sym, pe);
    }
    __device__ uint64_t load64(const uint64_t* sym, int pe, const uint8_t* pb) const {
        if (pb) return ld_relaxed_sys_u64((const uint64_t*)(pb + ((const uint8_t*)sym - buf)));
        return nvshmem_uint64_g(sym, pe);
    }
};

struct P2pX {
    uint8_t* buf;
    int me;
    const uint64_t* peers;  // peers[pe]: pe's copy of the buffer in our address space
    __device__ const uint8_t* peer_base(int pe) const { return (const uint8_t*)peers[pe]; }
    __device__ uint64_t* translate(uint64_t* sym, int pe) const {
        return (uint64_t*)((uint8_t*)peers[pe] + ((uint8_t*)sym - buf));
    }
    __device__ void release() const { __threadfence_system(); }
    __device__ void signal_set(uint64_t* sym, uint64_t v, int pe) const { st_release_sys_u64(translate(sym, pe), v); }
    __device__ uint64_t fetch_or(uint64_t* sym, uint64_t v, int pe) const {
        return atom_or_release_sys(translate(sym, pe), v);
    }
    __device__ uint32_t load32(const uint32_t* sym, int, const uint8_t* pb) const {
        return ld_relaxed_sys_u32((const uint32_t*)(pb + ((const uint8_t*)sym - buf)));
    }
    __device__ uint64_t load64(const uint64_t* sym, int, const uint8_t* pb) const {
        return ld_relaxed_sys_u64((const uint64_t*)(pb + ((const uint8_t*)sym - buf)));
    }
};

// ------------------------------------------------------------------------------------------
// (b) device-side protocol, using only the descriptor's offsets
// ------------------------------------------------------------------------------------------
__device__ __forceinline__ uint64_t* word_at(uint8_t* buf, int64_t off) { return (uint64_t*)(buf + off); }
__device__ __forceinline__ uint64_t* route_gen_word(const RingDesc* d, uint8_t* buf, int64_t src, int64_t slot) {
    return word_at(buf, d->off_route_ready_gen + (src * d->num_slots + slot) * 8);
}
__device__ __forceinline__ uint64_t* layout_gen_word(const RingDesc* d, uint8_t* buf, int64_t src, int64_t slot) {
    return word_at(buf, d->off_layout_ready_gen + (src * d->num_slots + slot) * 8);
}
__device__ __forceinline__ uint64_t* consumed_gen_word(const RingDesc* d, uint8_t* buf, int64_t src, int64_t slot) {
    return word_at(buf, d->off_consumed_gen + (src * d->num_slots + slot) * 8);
}
__device__ __forceinline__ uint64_t* ack_word(const RingDesc* d, uint8_t* buf, int64_t slot, int64_t w) {
    return word_at(buf, d->off_ack_mask + (slot * d->mask_words + w) * 8);
}
__device__ __forceinline__ uint64_t* meta_words(const RingDesc* d, uint8_t* buf, int64_t slot) {
    return word_at(buf, d->off_meta + slot * d->meta_words * 8);
}
__device__ __forceinline__ uint64_t* wake_word(const RingDesc* d, uint8_t* buf, int kind, int64_t src, int64_t slot) {
    return word_at(buf, d->off_wake + ((kind * d->num_ranks + src) * d->num_slots + slot) * 8);
}
__device__ __forceinline__ uint64_t full_mask(const RingDesc* d, int64_t w) {
    int64_t n = d->num_ranks - 64 * w;
    if (n >= 64) return ~0ull;
    return (1ull << n) - 1ull;
}
__device__ __forceinline__ uint64_t cur_epoch(const RingDesc* d) { return ld_relaxed_sys_u64(d->epoch); }

__device__ void record_error(const RingDesc* d, int code, int64_t src, int64_t chunk, uint64_t seen, uint64_t want) {
    unsigned long long packed = (unsigned long long)code | ((unsigned long long)(src & 0xffff) << 8) |
                                ((unsigned long long)(chunk & 0xffffffffll) << 24);
    if (atomicCAS(&d->status[RS_FIRST_ERROR], 0ull, packed) == 0ull) {
        d->status[RS_BAD_SEEN] = seen;
        d->status[RS_BAD_WANT] = want;
    }
    if (code == RE_ACQUIRE_TIMEOUT || code == RE_REUSE_TIMEOUT || code == RE_DRAIN_TIMEOUT) {
        atomicAdd(&d->status[RS_TIMEOUTS], 1ull);
        atomicExch(&d->status[RS_ABORT], 1ull);
    } else {
        atomicAdd(&d->status[RS_VIOLATIONS], 1ull);
    }
    __threadfence_system();
}

__device__ __forceinline__ bool aborted(const RingDesc* d) {
    return ld_relaxed_sys_u64((const uint64_t*)&d->status[RS_ABORT]) != 0;
}

// Splitmix64 finaliser: the synthetic payload is a function of (src, generation, word).
__device__ __forceinline__ uint64_t mix64(uint64_t v) {
    v ^= v >> 30;
    v *= 0xBF58476D1CE4E5B9ull;
    v ^= v >> 27;
    v *= 0x94D049BB133111EBull;
    v ^= v >> 31;
    return v;
}
__device__ __forceinline__ uint32_t pattern32(int64_t src, uint64_t gen, int64_t region, int64_t i) {
    return (uint32_t)mix64(gen * 0x9E3779B97F4A7C15ull ^ ((uint64_t)src << 56) ^ ((uint64_t)region << 48) ^
                           (uint64_t)i);
}

// Is the generation `seen` ready, older, or a violation, compared with `want`? (protocol.classify_gen)
// 0 = ready, 1 = older (keep waiting), 2 = violation.
__device__ __forceinline__ int classify(const RingDesc* d, uint64_t seen, uint64_t want, int inject) {
    if (inject & INJ_IGNORE_EPOCH) {
        seen &= 0xffffffffull;
        want &= 0xffffffffull;
    }
    if (seen == want) return 0;
    if (seen == 0) return 1;
    uint64_t se = seen >> RING_SEQ_BITS, we = want >> RING_SEQ_BITS;
    uint64_t ss = seen & 0xffffffffull, ws = want & 0xffffffffull;
    if (se < we) return 1;
    if (se == we && ss < ws && (ws - ss) % (uint64_t)d->num_slots == 0) return 1;
    return 2;
}

// Acquire: wait until both generations of (src, chunk) equal `g` (one thread).
// Returns true when ready; on a deadline or a violation it records the error and returns false.
__device__ bool acquire_wait(const RingDesc* d, uint8_t* buf, int64_t src, int64_t chunk, uint64_t g, int inject) {
    int64_t slot = chunk % d->num_slots;
    const uint64_t* words[2] = {route_gen_word(d, buf, src, slot), layout_gen_word(d, buf, src, slot)};
    long long start = clock64();
    for (int k = 0; k < 2; ++k) {
        while (true) {
            uint64_t seen = ld_acquire_sys_u64(words[k]);  // acquire (system scope)
            int st = classify(d, seen, g, inject);
            if (st == 0) break;
            if (st == 2) {
                record_error(d, RE_NEWER_GEN, src, chunk, seen, g);
                return false;
            }
            if (aborted(d) || clock64() - start > d->deadline_cycles) {
                record_error(d, RE_ACQUIRE_TIMEOUT, src, chunk, seen, g);
                return false;
            }
            __nanosleep(32);
        }
    }
    __threadfence_system();  // belt and braces: no later load is satisfied before the acquire
    return true;
}

// Owner: wait until every PE acknowledged the chunk `prev_chunk` held in `slot`, record
// consumed_gen[me][slot] := gen(prev), then clear the mask (rule 4). One thread.
__device__ bool owner_collect(const RingDesc* d, uint8_t* buf, int me, int64_t slot, int64_t prev_chunk,
                              uint64_t epoch, int inject, int err_code) {
    if (!(inject & INJ_SKIP_ACK_WAIT)) {
        long long start = clock64();
        for (int64_t w = 0; w < d->mask_words; ++w) {
            uint64_t want = full_mask(d, w);
            while (true) {
                uint64_t seen = ld_acquire_sys_u64(ack_word(d, buf, slot, w));
                if (seen == want) break;
                if (aborted(d) || clock64() - start > d->deadline_cycles) {
                    record_error(d, err_code, me, prev_chunk, seen, want);
                    return false;
                }
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

template <class X>
__device__ __forceinline__ void publish_route(const RingDesc* d, const X& x, int64_t chunk, uint64_t g) {
    publish(d, x, RING_ROUTE, chunk, g);
}
template <class X>
__device__ __forceinline__ void publish_layout(const RingDesc* d, const X& x, int64_t chunk, uint64_t g) {
    publish(d, x, RING_LAYOUT, chunk, g);
}

// The synthetic payload of a publication kind: (region id, offset, bytes) triples.
struct Span {
    int64_t off;
    int64_t bytes;
};
__device__ __forceinline__ int payload_spans(const RingDesc* d, int kind, int64_t slot, Span* out) {
    if (kind == RING_ROUTE) {
        out[0] = {d->off_topk_idx + slot * d->stride_topk_idx_slot, d->stride_topk_idx_slot};
        out[1] = {d->off_topk_weights + slot * d->stride_topk_weights_slot, d->stride_topk_weights_slot};
    } else {
        out[0] = {d->off_x + slot * d->stride_x_slot, d->stride_x_slot};
        out[1] = {d->off_x_sf + slot * d->stride_x_sf_slot, d->stride_x_sf_slot};
    }
    return 2;
}

// Producer body: fill my slot with the pattern of generation g (all threads), then publish.
template <class X>
__device__ void produce_block(const RingDesc* d, const X& x, int kind, int64_t chunk, int inject,
                              long long delay_cycles, uint64_t* t_pub) {
    __shared__ uint64_t s_epoch;
    if (threadIdx.x == 0) s_epoch = cur_epoch(d);
    __syncthreads();
    const uint64_t g = ring_make_gen(s_epoch, chunk);
    const int64_t slot = chunk % d->num_slots;
    if ((inject & INJ_SIGNAL_BEFORE_PAYLOAD) && threadIdx.x == 0) publish(d, x, kind, chunk, g);
    if (delay_cycles > 0 && threadIdx.x == 0) {
        long long t0 = clock64();
        while (clock64() - t0 < delay_cycles) {
        }
    }
    __syncthreads();
    Span spans[2];
    int n = payload_spans(d, kind, slot, spans);
    for (int r = 0; r < n; ++r) {
        uint32_t* p = (uint32_t*)(x.buf + spans[r].off);
        int64_t words = spans[r].bytes / 4;
        for (int64_t i = threadIdx.x; i < words; i += blockDim.x) p[i] = pattern32(x.me, g, kind * 2 + r, i);
    }
    if (threadIdx.x == 0) {
        uint64_t* m = meta_words(d, x.buf, slot);
        uint64_t now = global_timer_ns();
        if (kind == RING_ROUTE) {
            m[RING_META_CHUNK] = (uint64_t)chunk;
            m[RING_META_BASE] = (uint64_t)(chunk * d->tokens_per_slot);
            m[RING_META_VALID] = (uint64_t)d->tokens_per_slot;
            m[RING_META_ROUTE_GEN] = g;
            m[RING_META_ROUTE_NS] = now;
        } else {
            m[RING_META_LAYOUT_GEN] = g;
            m[RING_META_LAYOUT_NS] = now;
        }
    }
    __threadfence_system();  // every thread: its payload stores before the barrier
    __syncthreads();
    if (threadIdx.x == 0 && !(inject & INJ_SIGNAL_BEFORE_PAYLOAD)) {
        // stamp just before the release: publish -> acquire latency starts here
        if (t_pub) atomicMax((unsigned long long*)&t_pub[chunk], (unsigned long long)global_timer_ns());
        publish(d, x, kind, chunk, g);
    }
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

// Consumer body for one source (one block): acquire, verify the payload on device, ack.
template <class X>
__device__ void consume_block(const RingDesc* d, const X& x, int64_t src, int64_t chunk, int inject,
                              long long hold_cycles, uint64_t* t_acq) {
    __shared__ uint64_t s_epoch;
    __shared__ int s_ok;
    __shared__ const uint8_t* s_pb;
    __shared__ unsigned int s_bad;
    const int64_t slot = chunk % d->num_slots;
    if (threadIdx.x == 0) {
        s_epoch = cur_epoch(d);
        s_bad = 0;
        s_pb = x.peer_base((int)src);
        uint64_t g = ring_make_gen(s_epoch, chunk);
        s_ok = (inject & INJ_SKIP_ACQUIRE) ? 1 : (acquire_wait(d, x.buf, src, chunk, g, inject) ? 1 : 0);
        if (s_ok && t_acq) t_acq[src * d->num_chunks + chunk] = global_timer_ns();
    }
    __syncthreads();
    if (!s_ok) return;  // error recorded; never ack what we could not acquire
    const uint64_t g = ring_make_gen(s_epoch, chunk);
    for (int pass = 0; pass < (hold_cycles > 0 ? 2 : 1); ++pass) {
        if (pass == 1 && threadIdx.x == 0) {
            long long t0 = clock64();
            while (clock64() - t0 < hold_cycles) {
            }
        }
        __syncthreads();
        for (int kind = 0; kind < 2; ++kind) {
            Span spans[2];
            int n = payload_spans(d, kind, slot, spans);
            for (int r = 0; r < n; ++r) {
                const uint32_t* p = (const uint32_t*)(x.buf + spans[r].off);
                int64_t words = spans[r].bytes / 4;
                for (int64_t i = threadIdx.x; i < words; i += blockDim.x) {
                    uint32_t v = x.load32(p + i, (int)src, s_pb);
                    if (v != pattern32(src, g, kind * 2 + r, i)) atomicAdd(&s_bad, 1u);
                }
            }
        }
        if (threadIdx.x == 0) {
            const uint64_t* m = meta_words(d, x.buf, slot);
            uint64_t c = x.load64(m + RING_META_CHUNK, (int)src, s_pb);
            uint64_t rg = x.load64(m + RING_META_ROUTE_GEN, (int)src, s_pb);
            uint64_t lg = x.load64(m + RING_META_LAYOUT_GEN, (int)src, s_pb);
            if (c != (uint64_t)chunk || rg != g || lg != g) {
                record_error(d, RE_META, src, chunk, c != (uint64_t)chunk ? c : (rg != g ? rg : lg),
                             c != (uint64_t)chunk ? (uint64_t)chunk : g);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0 && s_bad) {
            record_error(d, pass == 0 ? RE_PAYLOAD : RE_CHANGED_WHILE_HELD, src, chunk, s_bad, 0);
            s_bad = 0;
        }
        __syncthreads();
    }
    __threadfence_system();  // every thread: its reads are complete before the ack
    __syncthreads();
    if (threadIdx.x == 0) ack_slot(d, x, src, chunk, g, inject);
}

// ------------------------------------------------------------------------------------------
// kernels (both transports). Launch: produce/reuse/drain 1 block; consume grid = #sources.
// ------------------------------------------------------------------------------------------
// Owner reuse wait before writing chunk `chunk` (no-op for chunk < num_slots).
extern "C" __global__ void ring_reuse_wait(const RingDesc* d, uint8_t* buf, int me, int64_t chunk, int inject) {
    if (threadIdx.x != 0 || d->num_chunks <= 0 || chunk < d->num_slots) return;
    uint64_t e = cur_epoch(d);
    owner_collect(d, buf, me, chunk % d->num_slots, chunk - d->num_slots, e, inject, RE_REUSE_TIMEOUT);
}

// End of stream: collect the acks of the last chunk of every slot, leaving every mask zero.
extern "C" __global__ void ring_drain(const RingDesc* d, uint8_t* buf, int me) {
    if (threadIdx.x != 0 || d->num_chunks <= 0) return;
    uint64_t e = cur_epoch(d);
    const int64_t n = d->num_chunks, S = d->num_slots;
    for (int64_t s = 0; s < S && s < n; ++s) {
        int64_t last = s + ((n - 1 - s) / S) * S;
        owner_collect(d, buf, me, s, last, e, 0, RE_DRAIN_TIMEOUT);
    }
}

// advance_epoch: one thread increments the device epoch word. Put last in a captured graph
// (after every stream joined) so the next replay runs the next epoch.
extern "C" __global__ void ring_advance_epoch(const RingDesc* d) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        d->epoch[0] = d->epoch[0] + 1;
        __threadfence_system();
    }
}

// Progress policy b: a one-thread kernel that spins (acquire, with deadline) until the route
// and layout generations of (src, chunk) are ready. Launch grid = #sources to wait for
// all of them (block b waits for source src0 + b).
extern "C" __global__ void ring_spin_wait(const RingDesc* d, uint8_t* buf, int64_t src0, int64_t chunk, int inject) {
    if (threadIdx.x != 0 || d->num_chunks <= 0 || (inject & INJ_SKIP_ACQUIRE)) return;
    uint64_t g = ring_make_gen(cur_epoch(d), chunk);
    acquire_wait(d, buf, src0 + blockIdx.x, chunk, g, inject);
}

#define RING_KERNELS(SUFFIX, XTYPE, XINIT)                                                                   \
    extern "C" __global__ void ring_publish_##SUFFIX(const RingDesc* d, uint8_t* buf, const uint64_t* peers, \
                                                     int me, int64_t chunk, int kind) {                      \
        XTYPE x = XINIT;                                                                                     \
        if (d->num_chunks <= 0) return; /* warm-up launch */                                                 \
        if (threadIdx.x == 0) publish(d, x, kind, chunk, ring_make_gen(cur_epoch(d), chunk));                \
    }                                                                                                        \
    extern "C" __global__ void ring_produce_##SUFFIX(const RingDesc* d, uint8_t* buf, const uint64_t* peers, \
                                                     int me, int64_t chunk, int kind, int inject,            \
                                                     long long delay_cycles, uint64_t* t_pub) {              \
        XTYPE x = XINIT;                                                                                     \
        if (d->num_chunks <= 0) return;                                                                      \
        produce_block(d, x, kind, chunk, inject, delay_cycles, t_pub);                                       \
    }                                                                                                        \
    extern "C" __global__ void ring_consume_##SUFFIX(const RingDesc* d, uint8_t* buf, const uint64_t* peers, \
                                                     int me, int64_t src0, int64_t chunk, int inject,        \
                                                     long long hold_cycles, uint64_t* t_acq) {               \
        XTYPE x = XINIT;                                                                                     \
        if (d->num_chunks <= 0) return;                                                                      \
        consume_block(d, x, src0 + blockIdx.x, chunk, inject, hold_cycles, t_acq);                           \
    }                                                                                                        \
    /* Ack only (the MoE consumer): the caller's kernels already acquired (ring_spin_wait) and */          \
    /* copied the slot out; stream order puts their reads before this kernel. Grid = #sources. */          \
    extern "C" __global__ void ring_ack_##SUFFIX(const RingDesc* d, uint8_t* buf, const uint64_t* peers,     \
                                                 int me, int64_t src0, int64_t chunk) {                      \
        XTYPE x = XINIT;                                                                                     \
        if (d->num_chunks <= 0 || threadIdx.x != 0) return;                                                  \
        __threadfence_system();                                                                              \
        ack_slot(d, x, src0 + blockIdx.x, chunk, ring_make_gen(cur_epoch(d), chunk), 0);                     \
    }

RING_KERNELS(nv, NvX, (NvX{buf, me}))
RING_KERNELS(p2p, P2pX, (P2pX{buf, me, peers}))
