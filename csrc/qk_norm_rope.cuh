// Qwen3's per-head q/k RMSNorm and neox rotary embedding of one head, done
// by one warp: the arithmetic of layer_kernels.cu's qk_norm_rope kernel,
// shared with the version 7 decode kernel, which can do the same work for a
// decode step's one new token per sequence itself (its prologue, chapter 9).
// Both kernels call these functions, so they round the same values in the
// same order and their outputs are the same bits.
//
// Lane l owns the rotary pairs (i, i + D/2) for i = l, l + 32, ...: both
// halves of a pair meet in one thread, so the rotation needs no shuffle.
//   torch reference, per head:  y = round(w * round(x * inv_rms))
//                               c, s = round(cos), round(sin)
//   y1' = round(round(y1 * c) - round(y2 * s)),  y2' = round(round(y2 * c) + round(y1 * s))
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

// --8<-- [start:warp_row_inv_rms]
// 1 / sqrt(mean(r^2) + eps) of one row of `hidden` elements (a multiple of 8),
// summed in float32 by the 32 lanes of one warp, in an order that does not
// depend on the block's size: every kernel that scales by it gets the same bits.
template <typename T>
__device__ __forceinline__ float warp_row_inv_rms(const T* __restrict__ r, int hidden,
                                                  float eps) {
  const int lane = threadIdx.x % 32;
  float sumsq = 0.f;
  for (int c = lane; c < hidden / 8; c += 32) {
    float v[8];
    unpack8<T>(*reinterpret_cast<const uint4*>(r + c * 8), v);
#pragma unroll
    for (int j = 0; j < 8; ++j) sumsq += v[j] * v[j];
  }
  return rsqrtf(warp_sum(sumsq) / hidden + eps);
}
// --8<-- [end:warp_row_inv_rms]

// This lane's pairs of head `x` as floats: a[p] = x[i], b[p] = x[i + D/2],
// i = lane + 32 p.
template <typename T, int D>
__device__ __forceinline__ void load_head_pairs(const T* x, int lane, float (&a)[D / 64],
                                                float (&b)[D / 64]) {
#pragma unroll
  for (int p = 0; p < D / 64; ++p) {
    a[p] = TypeTraits<T>::to_float(x[lane + p * 32]);
    b[p] = TypeTraits<T>::to_float(x[lane + p * 32 + D / 2]);
  }
}

// With the norms folded into qkv_proj: x = round(x * scale), scale the token's
// 1 / rms of the residual stream.
template <typename T, int D>
__device__ __forceinline__ void scale_head_pairs(float (&a)[D / 64], float (&b)[D / 64],
                                                 float scale) {
#pragma unroll
  for (int p = 0; p < D / 64; ++p) {
    a[p] = round_to<T>(a[p] * scale);
    b[p] = round_to<T>(b[p] * scale);
  }
}

// --8<-- [start:norm_rope_head]
// This lane's share of a head's norm weight (w[i], w[i + D/2]) and of a
// position's row `cs` of the cos/sin table ([cos (D/2) | sin (D/2)], float32,
// rounded as the reference rounds them): loaded apart from the head itself,
// so that a kernel can have them in registers before the head arrives.
template <typename T, int D>
struct NormRopeConsts {
  float w_lo[D / 64], w_hi[D / 64];
  float c[D / 64], s[D / 64];

  __device__ __forceinline__ void load_weight(const T* __restrict__ w, int lane) {
#pragma unroll
    for (int p = 0; p < D / 64; ++p) {
      w_lo[p] = TypeTraits<T>::to_float(w[lane + p * 32]);
      w_hi[p] = TypeTraits<T>::to_float(w[lane + p * 32 + D / 2]);
    }
  }
  __device__ __forceinline__ void load_rope(const float* __restrict__ cs, int lane) {
#pragma unroll
    for (int p = 0; p < D / 64; ++p) {
      c[p] = round_to<T>(cs[lane + p * 32]);
      s[p] = round_to<T>(cs[lane + p * 32 + D / 2]);
    }
  }
};

// The head's RMSNorm then its rotation: lo[p], hi[p] are the new x[i],
// x[i + D/2]. Every lane of the warp must call it (the norm's sum is a warp
// reduction).
template <typename T, int D>
__device__ __forceinline__ void norm_rope_head(const float (&a)[D / 64], const float (&b)[D / 64],
                                               const NormRopeConsts<T, D>& k, float eps,
                                               T (&lo)[D / 64], T (&hi)[D / 64]) {
  float sumsq = 0.f;
#pragma unroll
  for (int p = 0; p < D / 64; ++p) sumsq += a[p] * a[p] + b[p] * b[p];
  const float inv_rms = rsqrtf(warp_sum(sumsq) / D + eps);
#pragma unroll
  for (int p = 0; p < D / 64; ++p) {
    const float y1 = round_to<T>(k.w_lo[p] * round_to<T>(a[p] * inv_rms));
    const float y2 = round_to<T>(k.w_hi[p] * round_to<T>(b[p] * inv_rms));
    lo[p] = TypeTraits<T>::from_float(round_to<T>(y1 * k.c[p]) - round_to<T>(y2 * k.s[p]));
    hi[p] = TypeTraits<T>::from_float(round_to<T>(y2 * k.c[p]) + round_to<T>(y1 * k.s[p]));
  }
}
// --8<-- [end:norm_rope_head]

// Store a head's pairs (as norm_rope_head leaves them) at `out`.
template <typename T, int D>
__device__ __forceinline__ void store_head_pairs(T* out, int lane, const T (&lo)[D / 64],
                                                 const T (&hi)[D / 64]) {
#pragma unroll
  for (int p = 0; p < D / 64; ++p) {
    out[lane + p * 32] = lo[p];
    out[lane + p * 32 + D / 2] = hi[p];
  }
}

}  // namespace mini_vllm
