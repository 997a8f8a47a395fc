// Hopper's Tensor Memory Accelerator (TMA, sm_90+): a copy engine per SM that
// moves a whole tile between global and shared memory from one instruction,
// described by a tensor map (the tensor's address, sizes, strides, the box to
// copy and the swizzle to apply). Completion is counted in bytes on an
// mbarrier in shared memory, which the consumers wait on.
//
// Host side: `make_tensor_map` encodes a map through the driver (asked for
// its entry point at run time, so the module still links only the runtime).
// Device side: the few PTX instructions a TMA pipeline needs. They compile to
// nothing below sm_90, where no kernel that calls them may run.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (types only: no link to the driver)

#include <cstdint>

#include "params.h"

namespace mini_vllm {

// A map of a tensor of 16-bit elements of `rank` (at most 5) dimensions:
// sizes[0] contiguous, strides (bytes) of dims 1 .. rank - 1, copies of a
// box of box[0] x box[1] x ... elements with the 128-byte swizzle (box[0] * 2
// must then be at most 128). Throws std::invalid_argument naming what the
// driver refused.
CUtensorMap make_tensor_map(const void* base, DType dtype, int rank, const uint64_t* sizes,
                            const uint64_t* strides, const uint32_t* box);

// The 32-bit shared-memory address of `p` (what mbarrier, TMA and wgmma
// descriptors take).
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// --8<-- [start:tma_ptx]
// Make this thread's barrier count `count` arrivals per phase.
__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
#endif
}

// Make barrier initialisations visible to the copy engine (the async proxy).
__device__ __forceinline__ void mbarrier_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// Arrive once, and add `bytes` to the bytes the current phase still waits for.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
               "r"(bytes)
               : "memory");
#endif
}

// Wait until the phase of parity `parity` has completed (all arrivals made,
// all bytes landed); the bytes are then visible to the waiting thread.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n"
        " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
#endif
}

// Order this thread's earlier shared-memory accesses before later copies of
// the copy engine into the same bytes.
__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// Copy the box at coordinates (c0, c1, c2, c3) of a 4-D `map` to shared
// memory at `dst`, counting its bytes on `bar`. One thread issues it.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2, int c3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
#endif
}
// --8<-- [end:tma_ptx]

// Copy the box at coordinates (c0, c1, c2) of a 3-D `map` to shared memory at
// `dst`, counting its bytes on `bar`. One thread issues it.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
#endif
}

// Arrive once on a barrier (no bytes): a consumer saying it is done with a stage.
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
#endif
}

// Copy the box at coordinates (c0, c1) of a 2-D `map` to shared memory at
// `dst`, counting its bytes on `bar`. One thread issues it.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
#endif
}

}  // namespace mini_vllm
