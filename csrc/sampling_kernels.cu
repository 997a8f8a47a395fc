// Fused sampling: one token per row of logits in a single pass (phase 9).
//
// The torch sampler draws a token as argmax_i p_i / E_i with E_i ~ Exp(1):
// a float32 copy of the logits, a division by the temperature, a softmax,
// the noise, a division and an argmax, each a full pass over [rows, vocab].
// Taking logs gives the same distribution with no softmax at all (the
// Gumbel-max trick):
//
//   argmax_i p_i / E_i  =  argmax_i (logit_i / T - log E_i),   -log E_i ~ Gumbel(0, 1)
//
// so one kernel reads the logits once, in the model's dtype, and writes one
// int64 per row. The noise is counter-based (Philox4x32-10): element i of a
// row is a pure function of (the row's key, the row's counter, i), so a
// seeded request gets the same token whatever else is in the batch, and
// nothing is stored between steps.
#include <cmath>
#include <stdexcept>

#include "common.cuh"
#include "layer_params.h"
#include "pdl.cuh"

namespace mini_vllm {
namespace {

// --8<-- [start:philox]
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC 2011): ten rounds of two 32x32->64-bit multiplies and a key schedule
// turn a 128-bit counter into four independent 32-bit random words.
__device__ __forceinline__ uint4 philox4x32(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// Gumbel(0, 1) noise from 32 random bits: G = -log(E), E = -log(1 - w) ~ Exp(1),
// w uniform in (0, 1).
//
// The draws that decide an argmax are the large G, i.e. the tiny E, i.e. the
// tiny w, so w must resolve small values: w = r * 2^-32 + 2^-33 is exact for
// every r < 2^24 (float has 24 significant bits), down to 2^-33 (G up to 22.9),
// and E = -log1p(-w) keeps all of that precision. The naive -log(-log(u)) with
// u near 1 rounds log(u) to 0 and G to +inf: with 151,936 tokens a row, a few
// percent of the draws would go to a uniformly random token.
__device__ __forceinline__ float uniform(uint32_t r) {
  return fminf(fmaf(static_cast<float>(r), 2.3283064365386963e-10f,  // 2^-32
                    1.1641532182693481e-10f),                        // 2^-33
               0.99999994f);  // the largest float below 1: E stays finite
}
__device__ __forceinline__ float gumbel(float w) {
  const float e = -log1pf(-w);  // > 0 for every w >= 2^-33
  return -__logf(e);            // any tiny relative error here is harmless
}
// A cheap upper bound: E = -log(1 - w) >= w, so G <= -log(w). An element whose
// bound cannot beat the best score so far needs neither accurate logarithm;
// after the first few elements of a thread's slice that is almost all of them.
__device__ __forceinline__ float gumbel_bound(float w) { return -__logf(w); }
// --8<-- [end:philox]

// A (value, index) pair as one orderable 64-bit key: larger value first, then
// the smaller index (torch.argmax keeps the first maximum). 0 = nothing seen.
__device__ __forceinline__ uint64_t pack(float v, uint32_t i) {
  uint32_t u = __float_as_uint(v);
  u ^= (u & 0x80000000u) ? 0xffffffffu : 0x80000000u;  // IEEE order -> unsigned order
  return (static_cast<uint64_t>(u) << 32) | (0xffffffffu - i);
}

__device__ __forceinline__ float load_float(const float* p) { return __ldg(p); }
__device__ __forceinline__ float load_float(const __half* p) { return __half2float(__ldg(p)); }
__device__ __forceinline__ float load_float(const __nv_bfloat16* p) {
  return __bfloat162float(__ldg(p));
}

// --8<-- [start:sample]
// Grid (num_rows, num_splits): block (r, s) scans a 1/num_splits slice of row
// r, four elements (one Philox call) per thread at a time, and writes its best
// packed (value, index) to partials[r, s]. Greedy rows (inv_temperature 0)
// take the logits as they are: the same kernel is their argmax.
template <typename T, int NT>
__global__ void __launch_bounds__(NT) sample_partial_kernel(const SampleParams p) {
  const int row = blockIdx.x, split = blockIdx.y;
  pdl_launch_dependents();  // launched with PDL (pdl.cuh): the logits come from before
  pdl_wait();
  const T* x = static_cast<const T*>(p.logits) + row * p.row_stride;
  const float inv_t = p.inv_temperature[row];
  const bool greedy = inv_t == 0.0f;
  const uint64_t key = static_cast<uint64_t>(p.seeds[2 * row]);
  const uint64_t ctr = static_cast<uint64_t>(p.seeds[2 * row + 1]);
  const uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);

  const int groups = (p.vocab + 3) / 4;                  // four elements per Philox call
  const int per_split = (groups + p.num_splits - 1) / p.num_splits;
  const int g_end = min(groups, (split + 1) * per_split);
  uint64_t best = 0;
  float best_value = -INFINITY;
  for (int g = split * per_split + threadIdx.x; g < g_end; g += NT) {
    uint4 r = make_uint4(0, 0, 0, 0);
    if (!greedy) {
      r = philox4x32(make_uint4(static_cast<uint32_t>(g), static_cast<uint32_t>(ctr),
                                static_cast<uint32_t>(ctr >> 32), 0x6d696e69u),  // "mini"
                     k0, k1);
    }
    const uint32_t bits[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = 4 * g + j;
      if (i >= p.vocab) break;
      const float l = load_float(x + i);
      if (!(l > -INFINITY)) continue;  // filtered out (-inf) or NaN: never drawn
      float v = l;
      if (!greedy) {
        const float w = uniform(bits[j]);
        // Indices only grow within a thread: an equal score would lose the tie.
        // The slack covers the fast logarithm's rounding.
        if (fmaf(l, inv_t, gumbel_bound(w)) + 1e-3f <= best_value) continue;
        v = fmaf(l, inv_t, gumbel(w));
      }
      const uint64_t k = pack(v, static_cast<uint32_t>(i));
      if (k > best) best = k, best_value = v;
    }
  }
  // Block maximum: warp shuffles, then one value per warp through shared memory.
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    const uint64_t other = __shfl_xor_sync(0xffffffffu, best, off);
    best = other > best ? other : best;
  }
  __shared__ uint64_t warp_best[NT / 32];
  if (threadIdx.x % 32 == 0) warp_best[threadIdx.x / 32] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < NT / 32; ++w) best = warp_best[w] > best ? warp_best[w] : best;
    p.partials[static_cast<int64_t>(row) * p.num_splits + split] = best;
  }
}

// One warp per row: the maximum of the row's partials, unpacked to a token id.
__global__ void sample_final_kernel(const SampleParams p) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  pdl_launch_dependents();  // launched with PDL: the partials come from the kernel before
  pdl_wait();
  if (row >= p.num_rows) return;
  const int lane = threadIdx.x % 32;
  uint64_t best = 0;
  for (int s = lane; s < p.num_splits; s += 32) {
    const uint64_t k = p.partials[static_cast<int64_t>(row) * p.num_splits + s];
    best = k > best ? k : best;
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    const uint64_t other = __shfl_xor_sync(0xffffffffu, best, off);
    best = other > best ? other : best;
  }
  // A row with nothing to draw (every logit -inf) gets token 0, as argmax would.
  if (lane == 0) p.out[row] = best == 0 ? 0 : 0xffffffffu - static_cast<uint32_t>(best);
}
// --8<-- [end:sample]

template <typename T>
void launch_sample(const SampleParams& p, cudaStream_t stream) {
  constexpr int NT = 256;
  // Rows on x (up to 2^31 - 1 of them), splits on y (at most a few hundred).
  launch_kernel(sample_partial_kernel<T, NT>, dim3(p.num_rows, p.num_splits), dim3(NT), 0,
                stream, "sample_tokens (partial)", p);
  constexpr int kRowsPerBlock = 8;
  launch_kernel(sample_final_kernel, dim3(ceil_div(p.num_rows, kRowsPerBlock)),
                dim3(32 * kRowsPerBlock), 0, stream, "sample_tokens (final)", p);
}

}  // namespace

void sample_tokens(const SampleParams& p, cudaStream_t stream) {
  if (p.num_rows == 0) return;
  if (p.num_splits < 1 || p.vocab < 1) throw std::invalid_argument("sample_tokens: empty rows");
  switch (p.dtype) {
    case DType::kBFloat16: return launch_sample<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return launch_sample<__half>(p, stream);
    case DType::kFloat32: return launch_sample<float>(p, stream);
  }
  throw std::invalid_argument("sample_tokens: unknown dtype");
}

}  // namespace mini_vllm
