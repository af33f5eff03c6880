// streamring: the ring kernels a streamed layer enqueues (streamring/device_ring.py launches them
// through the typed launchers of streamring/device/kernels.py).
//
// Every kernel takes the ring's descriptor and its symmetric base; the ones that touch peers
// take `peers` (the device table of peer pointers: P2P transport) or nullptr (NVSHMEM device
// API), chosen once per ring by the host. num_chunks <= 0 in the descriptor makes every kernel
// return at once (the warm-up launches).
#include "ring_protocol.cuh"

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

// One thread increments the device epoch word. Put last in a captured graph (after every
// stream joined) so the next replay runs the next epoch.
extern "C" __global__ void ring_advance_epoch(const RingDesc* d) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        d->epoch[0] = d->epoch[0] + 1;
        __threadfence_system();
    }
}

// Progress policy spin_kernel (and the exact generation check of every policy): one thread per
// block spins (acquire, with deadline) until the route and layout generations of (src, chunk)
// are ready. Grid = #sources: block b waits for source src0 + b.
extern "C" __global__ void ring_spin_wait(const RingDesc* d, uint8_t* buf, int64_t src0, int64_t chunk, int inject) {
    if (threadIdx.x != 0 || d->num_chunks <= 0 || (inject & INJ_SKIP_ACQUIRE)) return;
    uint64_t g = ring_make_gen(cur_epoch(d), chunk);
    acquire_wait(d, buf, src0 + blockIdx.x, chunk, g, inject);
}

// Publish one readiness generation (kind RING_ROUTE or RING_LAYOUT) of my slot's chunk `chunk`
// at every PE; the payload was written by earlier kernels of this stream (stream order), the
// release inside publish() orders it before the generation.
extern "C" __global__ void ring_publish(const RingDesc* d, uint8_t* buf, const uint64_t* peers, int me,
                                        int64_t chunk, int kind) {
    if (d->num_chunks <= 0 || threadIdx.x != 0) return;
    const uint64_t g = ring_make_gen(cur_epoch(d), chunk);
    SR_WITH_TRANSPORT(buf, me, peers, publish(d, x, kind, chunk, g));
}

// Acknowledge (src0 + blockIdx.x, chunk): the caller's earlier kernels on this stream acquired
// (ring_spin_wait) and copied what they need out of the slot; stream order puts their reads
// before this kernel, whose release precedes the fetch_or. Grid = #sources.
extern "C" __global__ void ring_ack(const RingDesc* d, uint8_t* buf, const uint64_t* peers, int me, int64_t src0,
                                    int64_t chunk) {
    if (d->num_chunks <= 0 || threadIdx.x != 0) return;
    __threadfence_system();
    const uint64_t g = ring_make_gen(cur_epoch(d), chunk);
    SR_WITH_TRANSPORT(buf, me, peers, ack_slot(d, x, src0 + blockIdx.x, chunk, g, 0));
}
