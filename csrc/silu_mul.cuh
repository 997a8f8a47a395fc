// The arithmetic of SiLU · mul, shared by the kernel that runs it on its own
// (layer_kernels.cu) and by the matrix products that run it in their epilogue
// (gemv.cu, gemm_wgmma.cu: gate_up_proj and the activation in one launch).
//
// With the post-attention norm folded into gate_up_proj (chapter 9), the
// product's rows still need the norm's row scale, 1 / rms(residual), before
// SiLU. Every step rounds where the eager torch code rounds: the product's
// output, the scaled gate and up, SiLU's output, and the final product.
#pragma once

#include "common.cuh"

namespace mini_vllm {

// --8<-- [start:round_to]
// Round a float to the storage type and back: what one eager torch op does.
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return TypeTraits<T>::to_float(TypeTraits<T>::from_float(x));
}
// --8<-- [end:round_to]

// 1 / sqrt(mean(r^2) + eps) of a row of `hidden` elements, from its sum of squares.
__device__ __forceinline__ float inv_rms(float sumsq, int hidden, float eps) {
  return rsqrtf(sumsq / hidden + eps);
}

// --8<-- [start:silu_mul]
// silu(gate) * up for one pair already in the storage type's values; with
// SCALED both are first multiplied by the row's 1 / rms(residual) and rounded.
template <typename T, bool SCALED>
__device__ __forceinline__ float silu_mul(float gate, float up, float scale) {
  if constexpr (SCALED) {
    gate = round_to<T>(gate * scale);
    up = round_to<T>(up * scale);
  }
  return round_to<T>(gate / (1.f + __expf(-gate))) * up;
}
// --8<-- [end:silu_mul]

}  // namespace mini_vllm
