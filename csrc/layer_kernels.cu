// Fused element-wise kernels of a Qwen3 layer (phase 9).
//
// In a decode step every layer runs a few matrix products and dozens of tiny
// element-wise operations (norms, rotary embedding, activation, residual
// adds). Each of those is its own kernel in eager PyTorch: ~50 launches a
// layer, each a few microseconds, which for a small model costs as much as
// the matrix products. These kernels fuse each group into one launch:
//
//   rms_norm            y = w * norm(x)
//   fused_add_rms_norm  r = x + r;  x = w * norm(r)          (in place)
//   qk_norm_rope        q, k = rope(w_q * norm(q)), rope(w_k * norm(k))  (in place, per head),
//                       optionally also storing k and v in the KV cache
//   silu_and_mul        y = silu(gate) * up
//
// With the norms folded into the weights (mini_vllm/gpu/fused_layers.py), the
// matrix products before q/k-norm + RoPE and before silu_and_mul take the raw
// residual stream r; these two kernels then multiply their inputs by the
// token's 1 / rms(r) first (row_inv_rms below), which is all that is left of
// the decoder layer's two RMSNorms.
//
// They round where the torch reference rounds (after every bf16/fp16
// operation of the eager code); only the order of the float32 sums inside a
// reduction differs, so outputs match the reference to within one rounding.
#include <algorithm>

#include "common.cuh"
#include "layer_params.h"
#include "pdl.cuh"
#include "silu_mul.cuh"  // round_to, inv_rms, silu_mul

namespace mini_vllm {
namespace {

template <typename T>
__device__ __forceinline__ void pack8(const float (&f)[8], uint4& v) {
  T* out = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = TypeTraits<T>::from_float(f[i]);
}

// --8<-- [start:row_inv_rms]
// 1 / sqrt(mean(r^2) + eps) of one row of `hidden` elements (a multiple of 8),
// summed in float32 by all the threads of the block; every thread gets it.
template <typename T>
__device__ __forceinline__ float row_inv_rms(const T* __restrict__ r, int hidden, float eps,
                                             float* scratch) {
  float sumsq = 0.f;
  for (int c = threadIdx.x; c < hidden / 8; c += blockDim.x) {
    float v[8];
    unpack8<T>(*reinterpret_cast<const uint4*>(r + c * 8), v);
#pragma unroll
    for (int j = 0; j < 8; ++j) sumsq += v[j] * v[j];
  }
  return inv_rms(block_sum(sumsq, scratch), hidden, eps);
}
// --8<-- [end:row_inv_rms]

// --8<-- [start:rms_norm]
// One block of NT threads per row; each thread holds VPT 16-byte vectors of
// the row in registers, so the row is read once and written once.
//   torch reference: weight * F.rms_norm(x)  ==  round(w * round(x * rsqrt(mean(x^2) + eps)))
template <typename T, int NT, int VPT, bool ADD>
__global__ void __launch_bounds__(NT) rms_norm_kernel(T* __restrict__ out,
                                                       T* __restrict__ residual,
                                                       const T* __restrict__ x,
                                                       const T* __restrict__ weight,
                                                       int hidden, int64_t x_stride,
                                                       int64_t out_stride, float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int num_vec = hidden / 8;
  pdl_launch_dependents();  // launched with PDL (pdl.cuh): x comes from the kernel before
  pdl_wait();
  float v[VPT][8];
  float sumsq = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = threadIdx.x + i * NT;
    if (c < num_vec) {
      unpack8<T>(*reinterpret_cast<const uint4*>(x + row * x_stride + c * 8), v[i]);
      if constexpr (ADD) {
        // r = round(x + r): the residual stream is stored in the model's dtype.
        float r[8];
        uint4* rp = reinterpret_cast<uint4*>(residual + row * hidden + c * 8);
        unpack8<T>(*rp, r);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[i][j] = round_to<T>(v[i][j] + r[j]);
        uint4 packed;
        pack8<T>(v[i], packed);
        *rp = packed;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) sumsq += v[i][j] * v[i][j];
    }
  }
  const float inv_rms = rsqrtf(block_sum(sumsq, scratch) / hidden + eps);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = threadIdx.x + i * NT;
    if (c < num_vec) {
      float w[8], y[8];
      unpack8<T>(*reinterpret_cast<const uint4*>(weight + c * 8), w);
#pragma unroll
      for (int j = 0; j < 8; ++j) y[j] = w[j] * round_to<T>(v[i][j] * inv_rms);
      uint4 packed;
      pack8<T>(y, packed);
      *reinterpret_cast<uint4*>(out + row * out_stride + c * 8) = packed;
    }
  }
}
// --8<-- [end:rms_norm]

// --8<-- [start:qk_norm_rope]
// A warp per HPW heads of one token's q and k, in place in the fused qkv
// output; a block holds the warps of one token, or a group of them past 32
// warps (blockIdx.x the token, blockIdx.y the group). Lane l owns E = D/64
// neighbouring rotary pairs, (i, i + D/2) for i in [l*E, l*E + E): both
// halves of a pair meet in one thread, so the rotation needs no shuffle, and
// each half is one load of E elements (4 bytes at D = 128), not E loads.
//   torch reference, per head:  y = round(w * round(x * inv_rms))
//                               c, s = round(cos), round(sin)
//   y1' = round(round(y1 * c) - round(y2 * s)),  y2' = round(round(y2 * c) + round(y1 * s))
// With CACHE, the warp of k head h also does reshape_and_cache's work for
// that head: it stores the values it writes back into qkv in slot
// slot_mapping[token] of the K cache (the same bits, nothing rounded again)
// and copies v head h into the V cache; slot < 0 (a padding token) is skipped.
// With SCALED (folded norms), q, k and v first become round(x * s) with s the
// token's 1 / rms of `residual`: the block computes s once, the k-head warps
// scale their v head too and write it back into qkv (and the cache).
// Every row, head and cache slot starts on 16 bytes (the wrapper checks).

// N elements of T (or floats) moved as one load or store.
template <typename T, int N>
struct alignas(sizeof(T) * N) Packed {
  T v[N];
};

template <typename T, int D, bool CACHE, bool SCALED, int HPW>
__global__ void __launch_bounds__(1024) qk_norm_rope_kernel(
    T* __restrict__ qkv, T* __restrict__ k_cache, T* __restrict__ v_cache,
    const int64_t* __restrict__ slot_mapping, const T* __restrict__ q_weight,
    const T* __restrict__ k_weight, const float* __restrict__ cos_sin_cache,
    const int64_t* __restrict__ positions, const T* __restrict__ residual, int hidden,
    float residual_eps, int num_q_heads, int num_kv_heads, int64_t token_stride, float eps) {
  constexpr int HALF = D / 2;
  constexpr int E = HALF / 32;  // pairs per lane, neighbours
  constexpr int VN = D / 32;    // elements of the v head per lane
  using TRun = Packed<T, E>;
  using FRun = Packed<float, E>;
  using VRun = Packed<T, VN>;
  const int token = blockIdx.x;
  const int lane = threadIdx.x % 32;
  const int heads = num_q_heads + num_kv_heads;
  // A warp takes HPW heads, its loads of all of them issued before it uses
  // any: with HPW = 2 a token takes half the warps, and more tokens fit on an
  // SM at once (what a prefill of thousands needs). Heads past the
  // last one (a head count that the warps do not divide evenly) load head 0
  // with the others, join the block's sum of the residual, and store nothing.
  const int first_head = (blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32) * HPW;
  const int i0 = lane * E;  // this lane's first pair
  // Before the wait (pdl.cuh): the norm weights, which no kernel writes, and
  // the position and slot, copied from the host before the step's first
  // kernel. Their loads overlap the kernel before. (The rotary table's row
  // needs the position's value: it is loaded after qkv's, so that a block
  // that starts after the wait, as most do in a long prefill, does not wait
  // for the position before asking for its head.)
  const int64_t position = positions[token];
  const int64_t slot = CACHE && first_head + HPW > num_q_heads ? slot_mapping[token] : -1;
  int head[HPW];
  bool active[HPW], has_v[HPW];
  TRun w1[HPW], w2[HPW];
  // Where each head goes in each cache ([num_blocks * block_size, num_kv_heads,
  // D] seen flat), or -1: a q head, a padding token, or no CACHE.
  int64_t cache_off[HPW];
#pragma unroll
  for (int i = 0; i < HPW; ++i) {
    active[i] = first_head + i < heads;
    head[i] = active[i] ? first_head + i : 0;
    const bool is_q = head[i] < num_q_heads;
    const T* w = is_q ? q_weight : k_weight;
    w1[i] = *reinterpret_cast<const TRun*>(w + i0);
    w2[i] = *reinterpret_cast<const TRun*>(w + i0 + HALF);
    cache_off[i] = !is_q && slot >= 0 ? (slot * num_kv_heads + head[i] - num_q_heads) * D : -1;
    // Scaled, the v head of every k head is rewritten; else only copied to the cache.
    has_v[i] = !is_q && (SCALED || cache_off[i] >= 0);
  }
  pdl_launch_dependents();  // launched with PDL (pdl.cuh): qkv comes from the kernel before
  pdl_wait();
  T* const row = qkv + token * token_stride;  // q heads, then k heads, then v heads
  TRun x1[HPW], x2[HPW];  // kept packed, as loaded, until the residual's sum is done
  VRun v[HPW];
#pragma unroll
  for (int i = 0; i < HPW; ++i) {
    const T* x = row + head[i] * D;
    x1[i] = *reinterpret_cast<const TRun*>(x + i0);
    x2[i] = *reinterpret_cast<const TRun*>(x + i0 + HALF);
    // v head h (num_kv_heads heads past k head h), loaded with k rather than
    // after it: one trip to memory fewer on the warp's path.
    if (has_v[i]) v[i] = *reinterpret_cast<const VRun*>(x + num_kv_heads * D + lane * VN);
  }
  const float* cs = cos_sin_cache + position * D;  // [cos (D/2) | sin (D/2)]
  const FRun c1 = *reinterpret_cast<const FRun*>(cs + i0);
  const FRun s1 = *reinterpret_cast<const FRun*>(cs + i0 + HALF);
  float scale = 1.f;
  if constexpr (SCALED) {  // the residual's row is read while the loads above are on their way
    __shared__ float scratch[32];
    scale = row_inv_rms<T>(residual + static_cast<int64_t>(token) * hidden, hidden, residual_eps,
                           scratch);
  }
#pragma unroll
  for (int i = 0; i < HPW; ++i) {
    if (!active[i]) continue;  // the same in every lane of the warp
    float a[E], b[E];
#pragma unroll
    for (int p = 0; p < E; ++p) {
      a[p] = TypeTraits<T>::to_float(x1[i].v[p]);
      b[p] = TypeTraits<T>::to_float(x2[i].v[p]);
      if constexpr (SCALED) {
        a[p] = round_to<T>(a[p] * scale);
        b[p] = round_to<T>(b[p] * scale);
      }
    }
    if (SCALED && has_v[i]) {
#pragma unroll
      for (int j = 0; j < VN; ++j) {
        v[i].v[j] = TypeTraits<T>::from_float(TypeTraits<T>::to_float(v[i].v[j]) * scale);
      }
    }
    float sumsq = 0.f;
#pragma unroll
    for (int p = 0; p < E; ++p) sumsq += a[p] * a[p] + b[p] * b[p];
    const float inv_rms = rsqrtf(warp_sum(sumsq) / D + eps);
    TRun out1, out2;
#pragma unroll
    for (int p = 0; p < E; ++p) {
      const float y1 =
          round_to<T>(TypeTraits<T>::to_float(w1[i].v[p]) * round_to<T>(a[p] * inv_rms));
      const float y2 =
          round_to<T>(TypeTraits<T>::to_float(w2[i].v[p]) * round_to<T>(b[p] * inv_rms));
      const float c = round_to<T>(c1.v[p]), s = round_to<T>(s1.v[p]);
      out1.v[p] = TypeTraits<T>::from_float(round_to<T>(y1 * c) - round_to<T>(y2 * s));
      out2.v[p] = TypeTraits<T>::from_float(round_to<T>(y2 * c) + round_to<T>(y1 * s));
    }
    T* const x = row + head[i] * D;
    *reinterpret_cast<TRun*>(x + i0) = out1;
    *reinterpret_cast<TRun*>(x + i0 + HALF) = out2;
    if (CACHE && cache_off[i] >= 0) {
      *reinterpret_cast<TRun*>(k_cache + cache_off[i] + i0) = out1;
      *reinterpret_cast<TRun*>(k_cache + cache_off[i] + i0 + HALF) = out2;
    }
    if (has_v[i]) {
      if constexpr (SCALED) *reinterpret_cast<VRun*>(x + num_kv_heads * D + lane * VN) = v[i];
      if (CACHE && cache_off[i] >= 0) {
        *reinterpret_cast<VRun*>(v_cache + cache_off[i] + lane * VN) = v[i];
      }
    }
  }
}
// --8<-- [end:qk_norm_rope]

// --8<-- [start:silu_and_mul]
// y = round(round(silu(gate)) * up), 8 elements (16 bytes) per thread, one
// block per row (a row wider than the block is taken in several rounds). With
// SCALED (folded norms), gate and up first become round(x * s), s the row's
// 1 / rms of `residual`. Gate and up stay packed, as loaded, until the sum of
// the residual's row is done: the loads of all three are in flight together,
// and (in bf16) a thread holds fewer registers while it waits, so more rows
// fit on an SM at once (what a prefill of thousands of rows needs).
template <typename T, bool SCALED>
__global__ void __launch_bounds__(1024) silu_and_mul_kernel(T* __restrict__ out,
                                                           const T* __restrict__ x, int d,
                                                           const T* __restrict__ residual,
                                                           int hidden, float residual_eps) {
  const int64_t row = blockIdx.x;
  pdl_launch_dependents();  // launched with PDL (pdl.cuh): x comes from the kernel before
  pdl_wait();
  float scale = 1.f;
  for (int c = threadIdx.x * 8, first = 1; c < d || first; c += blockDim.x * 8, first = 0) {
    uint4 gate, up;
    if (c < d) {
      gate = *reinterpret_cast<const uint4*>(x + row * 2 * d + c);
      up = *reinterpret_cast<const uint4*>(x + row * 2 * d + d + c);
    }
    if (SCALED && first) {  // the residual's row is read while gate and up are on their way
      __shared__ float scratch[32];
      scale = row_inv_rms<T>(residual + row * hidden, hidden, residual_eps, scratch);
    }
    if (c >= d) continue;
    float g[8], u[8], y[8];
    unpack8<T>(gate, g);
    unpack8<T>(up, u);
#pragma unroll
    for (int j = 0; j < 8; ++j) y[j] = silu_mul<T, SCALED>(g[j], u[j], scale);
    uint4 packed;
    pack8<T>(y, packed);
    *reinterpret_cast<uint4*>(out + row * d + c) = packed;
  }
}
// --8<-- [end:silu_and_mul]

template <typename T, bool ADD>
void launch_rms_norm(const RmsNormParams& p, cudaStream_t stream) {
  constexpr int NT = 128;
  const int num_vec = p.hidden / 8;
  void* out = p.out;
  const dim3 grid(p.num_tokens);
  // Enough vectors per thread to hold the whole row in registers.
#define MINI_VLLM_RMS_LAUNCH(VPT)                                                          \
  launch_kernel(rms_norm_kernel<T, NT, VPT, ADD>, grid, dim3(NT), 0, stream, "rms_norm",    \
                static_cast<T*>(out), static_cast<T*>(p.residual),                         \
                static_cast<const T*>(p.x), static_cast<const T*>(p.weight), p.hidden,     \
                p.x_stride, p.out_stride, p.eps)
  if (num_vec <= NT) {
    MINI_VLLM_RMS_LAUNCH(1);
  } else if (num_vec <= 2 * NT) {
    MINI_VLLM_RMS_LAUNCH(2);
  } else if (num_vec <= 4 * NT) {
    MINI_VLLM_RMS_LAUNCH(4);
  } else if (num_vec <= 8 * NT) {
    MINI_VLLM_RMS_LAUNCH(8);
  } else {
    throw std::invalid_argument("rms_norm: hidden size above 8192 is not supported");
  }
#undef MINI_VLLM_RMS_LAUNCH
}

template <typename T, int D, int HPW>
void launch_qk_norm_rope_h(const QkNormRopeParams& p, cudaStream_t stream) {
  // HPW heads a warp: all the heads of a token in one block (Qwen3-0.6B: 24
  // warps at HPW = 1, 12 at HPW = 2), in groups of at most 32 warps past that.
  const int heads = p.num_q_heads + p.num_kv_heads;
  const int token_warps = (heads + HPW - 1) / HPW;
  const int groups = (token_warps + 31) / 32, warps = (token_warps + groups - 1) / groups;
  const dim3 grid(static_cast<unsigned>(p.num_tokens), groups);
  const bool cache = p.slot_mapping != nullptr, scaled = p.residual != nullptr;
  const auto kernel = cache ? (scaled ? qk_norm_rope_kernel<T, D, true, true, HPW>
                                      : qk_norm_rope_kernel<T, D, true, false, HPW>)
                            : (scaled ? qk_norm_rope_kernel<T, D, false, true, HPW>
                                      : qk_norm_rope_kernel<T, D, false, false, HPW>);
  launch_kernel(kernel, grid, dim3(32 * warps), 0, stream, "qk_norm_rope",
                static_cast<T*>(p.qkv), static_cast<T*>(p.k_cache),
                static_cast<T*>(p.v_cache), p.slot_mapping,
                static_cast<const T*>(p.q_weight), static_cast<const T*>(p.k_weight),
                p.cos_sin_cache, p.positions, static_cast<const T*>(p.residual), p.hidden,
                p.residual_eps, p.num_q_heads, p.num_kv_heads, p.token_stride, p.eps);
}

template <typename T, int D>
void launch_qk_norm_rope_d(const QkNormRopeParams& p, cudaStream_t stream) {
  // Two heads a warp from kQkNormWideTokens tokens (a prefill chunk), else one:
  // at a decode step's few tokens the wider warps only lengthen each token, and
  // four heads a warp were no faster than two at any size measured
  // (kernels.py --tables fused).
  const int hpw = p.heads_per_warp ? p.heads_per_warp
                                   : (p.num_tokens >= kQkNormWideTokens ? 2 : 1);
  switch (hpw) {
    case 1: return launch_qk_norm_rope_h<T, D, 1>(p, stream);
    case 2: return launch_qk_norm_rope_h<T, D, 2>(p, stream);
    case 4: return launch_qk_norm_rope_h<T, D, 4>(p, stream);
    default: throw std::invalid_argument("qk_norm_rope: heads_per_warp must be 0, 1, 2 or 4");
  }
}

template <typename T>
void launch_qk_norm_rope(const QkNormRopeParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_qk_norm_rope_d<T, 64>(p, stream);
    case 128: return launch_qk_norm_rope_d<T, 128>(p, stream);
    case 256: return launch_qk_norm_rope_d<T, 256>(p, stream);
    default: throw std::invalid_argument("qk_norm_rope: head_dim must be 64, 128 or 256");
  }
}

template <typename T>
void launch_silu_and_mul(const SiluAndMulParams& p, cudaStream_t stream) {
  // A thread per 16-byte vector of the row (Qwen3-0.6B: 384), at most 1024.
  const int threads = std::min(1024, (p.d / 8 + 31) / 32 * 32);
  const auto kernel = p.residual != nullptr ? silu_and_mul_kernel<T, true>
                                            : silu_and_mul_kernel<T, false>;
  launch_kernel(kernel, dim3(static_cast<unsigned>(p.num_tokens)), dim3(threads), 0, stream,
                "silu_and_mul", static_cast<T*>(p.out), static_cast<const T*>(p.x), p.d,
                static_cast<const T*>(p.residual), p.hidden, p.residual_eps);
}

}  // namespace

void rms_norm(const RmsNormParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return;
  if (p.hidden % 8) throw std::invalid_argument("rms_norm: hidden size must be a multiple of 8");
  const bool add = p.residual != nullptr;
  switch (p.dtype) {
    case DType::kBFloat16:
      return add ? launch_rms_norm<__nv_bfloat16, true>(p, stream)
                 : launch_rms_norm<__nv_bfloat16, false>(p, stream);
    case DType::kFloat16:
      return add ? launch_rms_norm<__half, true>(p, stream)
                 : launch_rms_norm<__half, false>(p, stream);
    default: throw std::invalid_argument("rms_norm: dtype must be float16 or bfloat16");
  }
}

void qk_norm_rope(const QkNormRopeParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return;
  if (p.slot_mapping != nullptr && (p.k_cache == nullptr || p.v_cache == nullptr)) {
    throw std::invalid_argument("qk_norm_rope: slot_mapping needs both k_cache and v_cache");
  }
  if (p.residual != nullptr && (p.hidden <= 0 || p.hidden % 8)) {
    throw std::invalid_argument("qk_norm_rope: the residual's width must be a multiple of 8");
  }
  switch (p.dtype) {
    case DType::kBFloat16: return launch_qk_norm_rope<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return launch_qk_norm_rope<__half>(p, stream);
    default: throw std::invalid_argument("qk_norm_rope: dtype must be float16 or bfloat16");
  }
}

void silu_and_mul(const SiluAndMulParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return;
  if (p.d % 8) throw std::invalid_argument("silu_and_mul: the width must be a multiple of 8");
  if (p.residual != nullptr && (p.hidden <= 0 || p.hidden % 8)) {
    throw std::invalid_argument("silu_and_mul: the residual's width must be a multiple of 8");
  }
  switch (p.dtype) {
    case DType::kBFloat16: return launch_silu_and_mul<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return launch_silu_and_mul<__half>(p, stream);
    default: throw std::invalid_argument("silu_and_mul: dtype must be float16 or bfloat16");
  }
}

}  // namespace mini_vllm
