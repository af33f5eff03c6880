// streamring: the device-visible descriptor of one chunk-ready ring.
//
// The first block of fields mirrors streamring.protocol.RingLayout.descriptor()
// ONE TO ONE: same names, same order, all int64 (tests/test_gpu.py parses this
// header and compares it with the Python dict). The host packs the struct as a
// flat int64 array in exactly this order (streamring/host/gpu.py:pack_desc), so
// a field added on one side and not the other fails that test instead of
// silently shifting every offset.
//
// The device side re-derives NOTHING: every offset and stride below comes from
// the Python layout. All offsets are bytes from the start of one PE's copy of
// the symmetric ring buffer.
#pragma once

#include <stdint.h>

struct RingDesc {
    // -- RingLayout.descriptor() (keep in sync; checked by tests/test_gpu.py) --
    int64_t num_ranks;
    int64_t num_slots;
    int64_t tokens_per_slot;
    int64_t hidden;
    int64_t topk;
    int64_t num_experts;
    int64_t mask_words;
    int64_t sf_cols;
    int64_t off_route_ready_gen;
    int64_t off_layout_ready_gen;
    int64_t off_consumed_gen;
    int64_t off_ack_mask;
    int64_t off_meta;
    int64_t off_x;
    int64_t off_x_sf;
    int64_t off_topk_idx;
    int64_t off_topk_weights;
    int64_t off_combine;
    int64_t stride_x_slot;
    int64_t stride_x_sf_slot;
    int64_t stride_topk_idx_slot;
    int64_t stride_topk_weights_slot;
    int64_t meta_words;
    int64_t total_bytes;
    // -- device-side stream state (not part of the layout) --
    // epoch: device word read by every kernel at run time, so a captured CUDA
    // graph replays with a new epoch after ring_advance_epoch, without re-capture.
    uint64_t* epoch;
    // number of valid chunks of the stream (the same on every PE, as in StreamPlan).
    int64_t num_chunks;
    // status: RS_* words below (violation and timeout counters, first error).
    unsigned long long* status;
    // a wait gives up after this many clock64() cycles and records a timeout.
    int64_t deadline_cycles;
    // offset of the wake ("doorbell") words [2][num_ranks][num_slots] used by the
    // stream_wait progress policy, or -1. They live after the layout's bytes in
    // the same symmetric allocation (see docs/gpu.md).
    int64_t off_wake;
};

// Number of int64 words of the layout part and of the whole struct.
#define RING_DESC_LAYOUT_WORDS 24
#define RING_DESC_WORDS 29

// Meta words of a slot (protocol.META_*).
#define RING_META_CHUNK 0
#define RING_META_BASE 1
#define RING_META_VALID 2
#define RING_META_ROUTE_GEN 3
#define RING_META_ROUTE_NS 4
#define RING_META_LAYOUT_GEN 5
#define RING_META_LAYOUT_NS 6

// status[] words.
#define RS_VIOLATIONS 0      // protocol/payload violations seen by checks
#define RS_TIMEOUTS 1        // waits that passed their deadline
#define RS_FIRST_ERROR 2     // first error: code | src << 8 | chunk << 24 (0 = none)
#define RS_ABORT 3           // set on the first timeout: later waits give up at once
#define RS_CONSUMED 4        // (src, chunk) pairs consumed and acknowledged
#define RS_PUBLISHED 5       // publications (route + layout count separately)
#define RS_BAD_SEEN 6        // value seen at the first error
#define RS_BAD_WANT 7        // value expected at the first error
#define RS_WORDS 16

// Error codes of RS_FIRST_ERROR.
#define RE_ACQUIRE_TIMEOUT 1
#define RE_REUSE_TIMEOUT 2
#define RE_NEWER_GEN 3
#define RE_PAYLOAD 4
#define RE_META 5
#define RE_DOUBLE_ACK 6
#define RE_DRAIN_TIMEOUT 7
#define RE_CHANGED_WHILE_HELD 8

// Deliberate mutations (negative controls; protocol.Inject).
#define INJ_SKIP_ACQUIRE 1
#define INJ_SIGNAL_BEFORE_PAYLOAD 2
#define INJ_SKIP_ACK_WAIT 4
#define INJ_IGNORE_EPOCH 8

// kind of a publication
#define RING_ROUTE 0
#define RING_LAYOUT 1

#define RING_SEQ_BITS 32

#ifdef __CUDACC__
__host__ __device__ static inline uint64_t ring_make_gen(uint64_t epoch, int64_t chunk) {
    return (epoch << RING_SEQ_BITS) | (uint64_t)(chunk + 1);
}
#endif
