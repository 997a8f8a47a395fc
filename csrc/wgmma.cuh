// Hopper's warpgroup tensor-core product (wgmma, sm_90a): the few PTX
// instructions a GEMM fed by the TMA needs.
//
// A *warpgroup* is four consecutive warps (128 threads). `wgmma.mma_async`
// multiplies a 64 x 16 tile of A by a 16 x N tile of B into a 64 x N tile of
// float32 accumulators spread over the warpgroup's registers, reading both
// operands straight from shared memory, described by 64-bit *matrix
// descriptors*. It is asynchronous: `wgmma_commit` closes a group of products
// and `wgmma_wait<n>` waits until at most n groups are still running.
//
// These instructions exist only on sm_90a (the arch-specific target of the
// H100/H200); on every other target the helpers compile to nothing, and no
// kernel that calls them may run there (`wgmma_gemm_supported`).
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MINI_VLLM_WGMMA 1
#endif

namespace mini_vllm {

// --8<-- [start:desc]
// The descriptor of an operand tile in shared memory that the TMA wrote with
// the 128-byte swizzle: rows of 64 16-bit elements (128 bytes, K contiguous),
// groups of 8 rows 1,024 bytes apart, the tile 1,024-byte aligned. Stepping
// 16 elements along K inside a row is 32 bytes on the start address: the
// hardware applies the swizzle to the final address, as the TMA did.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t smem_addr) {
  uint64_t desc = (smem_addr & 0x3FFFF) >> 4;  // start address, in 16-byte units
  desc |= uint64_t{1} << 16;                    // leading offset: unused with this swizzle
  desc |= uint64_t{1024 >> 4} << 32;            // stride between groups of 8 rows
  desc |= uint64_t{1} << 62;                    // layout: 128-byte swizzle
  return desc;
}
// --8<-- [end:desc]

// Before the first product of a group: orders earlier writes of the
// accumulator registers before the asynchronous products that read them.
__device__ __forceinline__ void wgmma_fence() {
#ifdef MINI_VLLM_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#ifdef MINI_VLLM_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef MINI_VLLM_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}

// Keep the compiler from moving reads or writes of accumulator registers
// across a fence or a wait (the products write them behind its back).
template <int R>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulator operands of a product of N = 64 or 128 columns: 32 or 64
// floats per thread, the first 32 shared.
#define MINI_VLLM_WGMMA_D32 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define MINI_VLLM_WGMMA_D64 \
  MINI_VLLM_WGMMA_D32, \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// Their names in the PTX template, then the two descriptors after them.
#define MINI_VLLM_WGMMA_R32 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MINI_VLLM_WGMMA_R64 \
  MINI_VLLM_WGMMA_R32 ", " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

// d += A * B^T for the shape "m64nNk16", float32 sums of PTX_TYPE operands,
// the accumulators' names REGS and the descriptors' DESCS.
#define MINI_VLLM_WGMMA_PTX(SHAPE, PTX_TYPE, REGS, DESCS) \
  "{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n" \
  " wgmma.mma_async.sync.aligned." SHAPE ".f32." PTX_TYPE "." PTX_TYPE " {" \
  REGS "}, " DESCS ", p, 1, 1, 0, 0;\n}"
#define MINI_VLLM_WGMMA_N128(PTX_TYPE) \
  MINI_VLLM_WGMMA_PTX("m64n128k16", PTX_TYPE, MINI_VLLM_WGMMA_R64, "%64, %65")
#define MINI_VLLM_WGMMA_N64(PTX_TYPE) \
  MINI_VLLM_WGMMA_PTX("m64n64k16", PTX_TYPE, MINI_VLLM_WGMMA_R32, "%32, %33")

// --8<-- [start:mma]
// d[64 x N] += A[64 x 16] * B[N x 16]^T for N = 128 or 64, A and B K-major in
// shared memory (the descriptors). Thread t of the warpgroup (warp w = t / 32,
// lane l) holds, for j = 0 .. N / 8 - 1, d[4j] and d[4j + 1] at row
// 16 w + l / 4, columns 8 j + 2 (l % 4) and the next, and d[4j + 2], d[4j + 3]
// eight rows below.
template <typename T, int N>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[N / 2], uint64_t desc_a,
                                             uint64_t desc_b) {
  static_assert(N == 64 || N == 128, "wgmma tiles of 64 or 128 columns");
#ifdef MINI_VLLM_WGMMA
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (N == 128 && kBf16) {
    asm volatile(MINI_VLLM_WGMMA_N128("bf16") : MINI_VLLM_WGMMA_D64 : "l"(desc_a), "l"(desc_b));
  } else if constexpr (N == 128) {
    asm volatile(MINI_VLLM_WGMMA_N128("f16") : MINI_VLLM_WGMMA_D64 : "l"(desc_a), "l"(desc_b));
  } else if constexpr (kBf16) {
    asm volatile(MINI_VLLM_WGMMA_N64("bf16") : MINI_VLLM_WGMMA_D32 : "l"(desc_a), "l"(desc_b));
  } else {
    asm volatile(MINI_VLLM_WGMMA_N64("f16") : MINI_VLLM_WGMMA_D32 : "l"(desc_a), "l"(desc_b));
  }
#else
  (void)d;
  (void)desc_a;
  (void)desc_b;
#endif
}
// --8<-- [end:mma]

#undef MINI_VLLM_WGMMA_N64
#undef MINI_VLLM_WGMMA_N128
#undef MINI_VLLM_WGMMA_PTX
#undef MINI_VLLM_WGMMA_R64
#undef MINI_VLLM_WGMMA_R32
#undef MINI_VLLM_WGMMA_D64
#undef MINI_VLLM_WGMMA_D32

}  // namespace mini_vllm
