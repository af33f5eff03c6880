// Declarations only of the NVSHMEM device API the streamring kernels call (signatures as NVSHMEM 3.4's),
// so that tests/unit/test_gpu.py can compile every csrc/*.cu with nvcc on a machine without NVSHMEM: a
// syntax and type check of the kernels, not a build (nothing is linked or run).
#pragma once
#include <stddef.h>
#include <stdint.h>
#define NVSHMEM_SIGNAL_SET 0
#define NVSHMEM_SIGNAL_ADD 5
__device__ void nvshmem_fence(void);
__device__ void nvshmem_quiet(void);
__device__ int nvshmem_my_pe(void);
__device__ int nvshmem_n_pes(void);
__device__ void* nvshmem_ptr(const void* dest, int pe);
__device__ uint32_t nvshmem_uint32_g(const uint32_t* source, int pe);
__device__ uint64_t nvshmem_uint64_g(const uint64_t* source, int pe);
__device__ uint64_t nvshmem_uint64_atomic_fetch_add(uint64_t* dest, uint64_t value, int pe);
__device__ uint64_t nvshmem_uint64_atomic_fetch_or(uint64_t* dest, uint64_t value, int pe);
