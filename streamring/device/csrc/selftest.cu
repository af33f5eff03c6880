// streamring: the synthetic producer and consumer of the GPU self-test (`streamring gpu-check`,
// streamring/gpu_check.py). A producer fills its slot with a pattern that is a function of
// (source, generation, region, word) and publishes; a consumer acquires, checks every word of
// the pattern and the metadata on the device (twice, around an optional hold, to catch a
// slot that changes while it is held), then acknowledges. Violations and timeouts are counted
// in the descriptor's status words.
#include "ring_protocol.cuh"

// Splitmix64 finaliser: the synthetic payload is a function of (src, generation, word).
static __device__ __forceinline__ uint64_t mix64(uint64_t v) {
    v ^= v >> 30;
    v *= 0xBF58476D1CE4E5B9ull;
    v ^= v >> 27;
    v *= 0x94D049BB133111EBull;
    v ^= v >> 31;
    return v;
}
static __device__ __forceinline__ uint32_t pattern32(int64_t src, uint64_t gen, int64_t region, int64_t i) {
    return (uint32_t)mix64(gen * 0x9E3779B97F4A7C15ull ^ ((uint64_t)src << 56) ^ ((uint64_t)region << 48) ^
                           (uint64_t)i);
}

// The synthetic payload of a publication kind: (offset, bytes) spans of the slot.
struct Span {
    int64_t off;
    int64_t bytes;
};
static __device__ __forceinline__ int payload_spans(const RingDesc* d, int kind, int64_t slot, Span* out) {
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
            m[META_CHUNK] = (uint64_t)chunk;
            m[META_BASE] = (uint64_t)(chunk * d->tokens_per_slot);
            m[META_VALID] = (uint64_t)d->tokens_per_slot;
            m[META_ROUTE_GEN] = g;
            m[META_ROUTE_NS] = now;
        } else {
            m[META_LAYOUT_GEN] = g;
            m[META_LAYOUT_NS] = now;
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
            uint64_t c = x.load64(m + META_CHUNK, (int)src, s_pb);
            uint64_t rg = x.load64(m + META_ROUTE_GEN, (int)src, s_pb);
            uint64_t lg = x.load64(m + META_LAYOUT_GEN, (int)src, s_pb);
            if (c != (uint64_t)chunk || rg != g || lg != g) {
                record_error(d, RE_META, src, chunk, c != (uint64_t)chunk ? c : (rg != g ? rg : lg),
                             c != (uint64_t)chunk ? (uint64_t)chunk : g,
                             c != (uint64_t)chunk ? META_CHUNK : (rg != g ? META_ROUTE_GEN : META_LAYOUT_GEN));
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

// One block: fill my slot's `kind` payload of chunk `chunk` with the pattern, then publish.
extern "C" __global__ void ring_produce(const RingDesc* d, uint8_t* buf, const uint64_t* peers, int me,
                                        int64_t chunk, int kind, int inject, long long delay_cycles,
                                        uint64_t* t_pub) {
    if (d->num_chunks <= 0) return;
    SR_WITH_TRANSPORT(buf, me, peers, produce_block(d, x, kind, chunk, inject, delay_cycles, t_pub));
}

// Grid = #sources: block b acquires, checks and acknowledges source src0 + b's chunk `chunk`.
extern "C" __global__ void ring_consume(const RingDesc* d, uint8_t* buf, const uint64_t* peers, int me,
                                        int64_t src0, int64_t chunk, int inject, long long hold_cycles,
                                        uint64_t* t_acq) {
    if (d->num_chunks <= 0) return;
    SR_WITH_TRANSPORT(buf, me, peers, consume_block(d, x, src0 + blockIdx.x, chunk, inject, hold_cycles, t_acq));
}
