// The tensor-core instruction the GEMV and decode attention v7 share:
// mma.sync m16n8k16, 16-bit inputs, float32 accumulators (sm_80+).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace mini_vllm {

// --8<-- [start:mma]
// d += a b for a 16 x 16 tile a (row-major) and a 16 x 8 tile b (column-major),
// in float32. Registers hold pairs of 16-bit elements; lane l = 4 g + q owns
//   a: rows g and g + 8, columns 2q, 2q + 1, 2q + 8, 2q + 9
//   b: columns (n) g, rows (k) 2q, 2q + 1, 2q + 8, 2q + 9
//   d: rows g and g + 8, columns 2q and 2q + 1
// (the fragment layout of the PTX ISA for mma.m16n8k16).
template <typename T>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], uint32_t a0, uint32_t a1,
                                            uint32_t a2, uint32_t a3, uint32_t b0,
                                            uint32_t b1);

template <>
__device__ __forceinline__ void mma_16x8x16<__nv_bfloat16>(float (&d)[4], uint32_t a0,
                                                           uint32_t a1, uint32_t a2,
                                                           uint32_t a3, uint32_t b0,
                                                           uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16x8x16<__half>(float (&d)[4], uint32_t a0, uint32_t a1,
                                                    uint32_t a2, uint32_t a3, uint32_t b0,
                                                    uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// --8<-- [end:mma]

}  // namespace mini_vllm
