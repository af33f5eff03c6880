// streamring: the two transports the device-side protocol is instantiated with.
//
//  * NvX  - the NVSHMEM device API (nvshmemx_signal_op, nvshmem_uint64_atomic_fetch_or,
//           nvshmem_fence, nvshmem_ptr / nvshmem_uint32_g). Needs the library's
//           device state, i.e. the context in which nvshmem library_init ran; works
//           for peers without a load/store mapping (another node).
//  * P2pX - plain PTX on peer pointers taken from nvshmem_ptr once on the host side
//           (sr_peer_table). Context-free: the only one usable in green contexts,
//           where NVSHMEM's device state is not initialised.
//
// A ring kernel gets `peers` (the device table of peer pointers) or nullptr: the
// kernel then uses P2pX or NvX. The host chooses once per ring (DeviceRing.transport).
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include "ptx.cuh"

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
    // release-ordered ADD on a signal word (the caller released its data first)
    __device__ void signal_add(uint64_t* sym, uint64_t v, int pe) const {
        nvshmemx_signal_op(sym, v, NVSHMEM_SIGNAL_ADD, pe);
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
    // release(): fence.acq_rel.sys orders every earlier memory operation of this thread (and, through
    // the caller's block barrier and the kernel boundaries of the stream, what happened before it)
    // before the stores that follow, which can then be relaxed (a release pattern; one fence per
    // publication instead of one per PE)
    __device__ void release() const { fence_acq_rel_sys(); }
    __device__ void signal_set(uint64_t* sym, uint64_t v, int pe) const { st_relaxed_sys_u64(translate(sym, pe), v); }
    __device__ uint64_t fetch_or(uint64_t* sym, uint64_t v, int pe) const {
        return atom_or_release_sys(translate(sym, pe), v);
    }
    __device__ void signal_add(uint64_t* sym, uint64_t v, int pe) const { atom_add_release_sys(translate(sym, pe), v); }
    __device__ uint32_t load32(const uint32_t* sym, int, const uint8_t* pb) const {
        return ld_relaxed_sys_u32((const uint32_t*)(pb + ((const uint8_t*)sym - buf)));
    }
    __device__ uint64_t load64(const uint64_t* sym, int, const uint8_t* pb) const {
        return ld_relaxed_sys_u64((const uint64_t*)(pb + ((const uint8_t*)sym - buf)));
    }
};

// Run the statement(s) after the first three arguments with `x` bound to the transport the host
// chose: P2P when `peers` is given, else NVSHMEM (variadic, so the body may contain commas).
#define SR_WITH_TRANSPORT(buf, me, peers, ...) \
    do {                                       \
        if (peers) {                           \
            P2pX x{(buf), (me), (peers)};      \
            __VA_ARGS__;                       \
        } else {                               \
            NvX x{(buf), (me)};                \
            __VA_ARGS__;                       \
        }                                      \
    } while (0)
