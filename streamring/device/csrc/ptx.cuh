// streamring: PTX memory-model helpers shared by every kernel file.
//
// release = every thread's stores, then a system-scope fence (fence.acq_rel.sys: enough for a
//           release pattern; the sequentially consistent fence.sc.sys is not needed for it), block
//           barrier, then one thread's store / atomic of the flag;
// acquire = one thread's ld.acquire.sys of the flag word, block barrier, then the
//           payload loads. Payload loads from peers use ld.relaxed.sys so that a
//           stale L1 line of an earlier graph replay is never served.
#pragma once

#include <stdint.h>

static __device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
static __device__ __forceinline__ uint64_t ld_relaxed_sys_u64(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
static __device__ __forceinline__ uint32_t ld_relaxed_sys_u32(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
static __device__ __forceinline__ void st_relaxed_sys_u64(uint64_t* p, uint64_t v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
static __device__ __forceinline__ void st_release_sys_u64(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
static __device__ __forceinline__ uint64_t atom_or_release_sys(uint64_t* p, uint64_t v) {
    uint64_t old;
    asm volatile("atom.release.sys.global.or.b64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    return old;
}
static __device__ __forceinline__ uint64_t atom_add_release_sys(uint64_t* p, uint64_t v) {
    uint64_t old;
    asm volatile("atom.release.sys.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    return old;
}
// A release/acquire fence at system scope: with a later relaxed store it forms a release pattern, with
// an earlier relaxed load an acquire pattern (PTX memory model). Lighter than fence.sc.sys
// (__threadfence_system), which also orders fences among themselves; nothing here relies on that.
static __device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
static __device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
