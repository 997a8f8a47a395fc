// Device helpers shared by every kernel: element types, 16-byte vectors,
// warp and block reductions, and launch-error checks.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "params.h"

namespace mini_vllm {

// Throw a C++ exception (pybind11 turns it into a Python RuntimeError) when a
// CUDA call or the launch just made failed.
inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
  }
}
#define MINI_VLLM_CHECK_LAUNCH(what) ::mini_vllm::check_cuda(cudaGetLastError(), what)

// An attribute of the current device (SM count, compute capability, ...),
// asked of the driver once and remembered (csrc/device.cu).
int device_attribute(cudaDeviceAttr attr);

// How many blocks of `threads` threads (and `smem` bytes of dynamic shared
// memory) of `kernel` one SM of the current device holds at once; asked once
// per (device, kernel, threads, smem) and remembered (csrc/device.cu).
int resident_blocks_per_sm(const void* kernel, int threads, size_t smem);

// How many clusters of `cluster` CTAs of `kernel` (each of `threads` threads
// and `smem` bytes) the current device runs at once: a cluster's CTAs share a
// GPC, so this can be fewer than the SM count suggests. Asked once per
// (device, kernel, threads, smem, cluster) and remembered (csrc/device.cu).
int max_active_clusters(const void* kernel, int threads, size_t smem, int cluster);

// Let `kernel` use `bytes` of dynamic shared memory and ask for the largest
// shared-memory carveout (K/V bypass L1); set on the current device the first
// time, and again only when more is asked (csrc/device.cu).
void allow_dynamic_smem(const void* kernel, size_t bytes);

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

inline int log2_exact(int x) {
  int l = 0;
  while ((1 << l) < x) ++l;
  if ((1 << l) != x) throw std::invalid_argument("block_size must be a power of two");
  return l;
}

// ---------------------------------------------------------------------------
// Element types. A 16-byte vector (uint4) holds 8 elements of either type.
// ---------------------------------------------------------------------------
template <typename T>
struct TypeTraits;

template <>
struct TypeTraits<__half> {
  // Two packed halves in one 32-bit word -> two floats.
  static __device__ __forceinline__ float2 to_float2(uint32_t w) {
    __half2 h = *reinterpret_cast<__half2*>(&w);
    return __half22float2(h);
  }
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

template <>
struct TypeTraits<__nv_bfloat16> {
  // bf16 is the top half of a float32: widening is a shift or a mask.
  static __device__ __forceinline__ float2 to_float2(uint32_t w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) {
    return __bfloat162float(x);
  }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) {
    return __float2bfloat16_rn(x);
  }
};

// Two floats -> one register of two 16-bit elements, `lo` in the low half
// (an mma operand, or a pair stored at once).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Eight elements of a 16-byte vector, widened to float.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  float2 a = TypeTraits<T>::to_float2(v.x);
  float2 b = TypeTraits<T>::to_float2(v.y);
  float2 c = TypeTraits<T>::to_float2(v.z);
  float2 d = TypeTraits<T>::to_float2(v.w);
  f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
  f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
}

// One 16-byte read-only load that does not pollute L1: K and V are streamed once.
__device__ __forceinline__ uint4 load_stream16(const void* ptr) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(ptr));
  return r;
}

// ---------------------------------------------------------------------------
// Reductions.
// ---------------------------------------------------------------------------
// Sum over the WIDTH consecutive lanes that share one row (WIDTH a power of 2).
template <int WIDTH>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Block-wide reductions over all the threads of the block (a multiple of 32, at
// most 1024); every thread gets the result. `scratch` holds one T per warp.
// `op` combines two values; `identity` is its neutral element.
template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T x, Op op) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x = op(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T x, T* scratch, T identity, Op op) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  x = warp_reduce(x, op);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < blockDim.x / 32 ? scratch[lane] : identity;
  return warp_reduce(x, op);
}

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
  __device__ __forceinline__ uint64_t operator()(uint64_t a, uint64_t b) const {
    return a > b ? a : b;
  }
};
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

__device__ __forceinline__ float block_max(float x, float* scratch) {
  return block_reduce(x, scratch, -INFINITY, MaxOp{});
}

__device__ __forceinline__ float block_sum(float x, float* scratch) {
  return block_reduce(x, scratch, 0.0f, SumOp{});
}

// log2(e): scores are kept in base 2 so that exp2f (one MUFU instruction) does
// the softmax; q is pre-multiplied by scale * log2(e).
constexpr float kLog2e = 1.4426950408889634f;

}  // namespace mini_vllm
