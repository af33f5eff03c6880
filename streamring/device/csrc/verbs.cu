// streamring: the verb kernels of the NVSHMEM backend (streamring/device/nvshmem.py).
//
// One launch per host verb, then a stream sync on the host, so each verb is complete (in the
// sense of streamring/device/verbs.py) when it returns. Pointers are symmetric addresses (this
// PE's copy); pe is the target. op: 0 = SET, 1 = ADD (translated here so Python never depends
// on NVSHMEM's enum values).
#include <nvshmem.h>
#include <nvshmemx.h>

#include "ptx.cuh"

static __device__ __forceinline__ int sr_sig_op(int op) { return op == 1 ? NVSHMEM_SIGNAL_ADD : NVSHMEM_SIGNAL_SET; }

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
