// Declarations only (see nvshmem.h beside this file).
#pragma once
#include "nvshmem.h"
__device__ void nvshmemx_getmem_block(void* dest, const void* source, size_t nelems, int pe);
__device__ void nvshmemx_putmem_block(void* dest, const void* source, size_t nelems, int pe);
__device__ void nvshmemx_putmem_signal_block(void* dest, const void* source, size_t nelems, uint64_t* sig_addr,
                                             uint64_t signal, int sig_op, int pe);
__device__ void nvshmemx_signal_op(uint64_t* sig_addr, uint64_t signal, int sig_op, int pe);
