// Fused sampling: one token per row of logits, reading them once (phase 9).
//
// The torch sampler draws a token as argmax_i p_i / E_i with E_i ~ Exp(1):
// a float32 copy of the logits, a division by the temperature, a softmax,
// the noise, a division and an argmax, each a full pass over [rows, vocab].
// Taking logs gives the same distribution with no softmax at all (the
// Gumbel-max trick):
//
//   argmax_i p_i / E_i  =  argmax_i (logit_i / T - log E_i),   -log E_i ~ Gumbel(0, 1)
//
// Done over the whole row, that is a random number per token: compute-bound.
// Done in two levels (below), it reads the logits once in the model's dtype
// and draws noise for one chunk of each row: memory-bound. The noise is
// counter-based (Philox4x32-10): each random word is a pure function of (the
// row's key, the row's counter, its index), so a seeded request gets the same
// token whatever else is in the batch, and nothing is stored between steps.
#include <cmath>
#include <stdexcept>
#include <string>

#include "common.cuh"
#include "layer_params.h"
#include "pdl.cuh"

namespace mini_vllm {
namespace {

// The Philox counter's last word tells the two races' noise apart.
constexpr uint32_t kChunkTag = 0x63686e6bu;  // "chnk": the race among a row's chunks
constexpr uint32_t kTokenTag = 0x6d696e69u;  // "mini": the race among a chunk's tokens
constexpr int kSampleThreads = 256;          // per block of both kernels

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
// Two levels of one race. Split a row into chunks of kSampleChunk tokens. The
// largest of a chunk's scores s_i + G_i is itself Gumbel-distributed, around
// the chunk's log-sum-exp: max_i (s_i + G_i) ~ logsumexp_i(s_i) + G. So
//   1. sample_chunk_kernel, grid (rows, chunks): each block reads its chunk
//      once and writes one float, the chunk's log-sum-exp of s_i = logit_i / T
//      (its maximum for a greedy row): memory-bound, no random numbers;
//   2. sample_pick_kernel, a block per row: a Gumbel race among the chunks'
//      values picks a chunk, with probability sum(exp(s) in it) / sum(exp(s));
//      a second race among that chunk's tokens, with noise of its own, picks
//      the token, with probability exp(s_i) / sum(exp(s) in the chunk).
// The product is exp(s_i) / sum(exp(s)): exactly softmax(logits / T). Only
// one chunk of each row needs a random number per token, so the noise costs
// about 1/37 of what a race over the whole vocabulary would, at Qwen3's 151,936.
template <typename T, int NT>
__global__ void __launch_bounds__(NT) sample_chunk_kernel(const SampleParams p) {
  constexpr int kPerThread = kSampleChunk / NT;
  const int row = blockIdx.x, chunk = blockIdx.y;
  pdl_launch_dependents();  // launched with PDL (pdl.cuh): the logits come from before
  pdl_wait();
  const T* x = static_cast<const T*>(p.logits) + row * p.row_stride;
  const float inv_t = p.inv_temperature[row];
  const bool greedy = inv_t == 0.0f;
  const int first = chunk * kSampleChunk + threadIdx.x;
  float s[kPerThread];
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {  // all the loads first, then the arithmetic
    const int i = first + j * NT;
    s[j] = i < p.vocab ? load_float(x + i) : -INFINITY;
  }
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    // NaN and -inf (filtered out) are never drawn: both become -inf.
    s[j] = s[j] > -INFINITY ? (greedy ? s[j] : s[j] * inv_t) : -INFINITY;
    m = fmaxf(m, s[j]);
  }
  __shared__ float scratch[32];
  const float chunk_max = block_max(m, scratch);
  float value = chunk_max;
  if (!greedy && isfinite(chunk_max)) {
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) sum += __expf(s[j] - chunk_max);  // exp(-inf) = 0
    value = chunk_max + __logf(block_sum(sum, scratch));  // the sum is at least 1
  }
  if (threadIdx.x == 0) p.partials[static_cast<int64_t>(row) * p.num_chunks + chunk] = value;
}

// The noise of one race: this thread's groups of 4 candidates, group g =
// threadIdx.x + k * NT, drawn from the Philox call for counter (g, the row's
// counter, tag). Greedy rows race without noise.
template <int G, int NT>
__device__ __forceinline__ void race_noise(uint4 (&r)[G], uint32_t tag, bool greedy,
                                           uint64_t ctr, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int k = 0; k < G; ++k) {
    r[k] = greedy ? make_uint4(0, 0, 0, 0)
                  : philox4x32(make_uint4(threadIdx.x + k * NT, static_cast<uint32_t>(ctr),
                                          static_cast<uint32_t>(ctr >> 32), tag),
                               k0, k1);
  }
}

// One Gumbel race: candidate c = 4 * g + j (g as above) scores v * scale + its
// noise, where v = values[k][j]; -inf and NaN never win. Returns the winner's
// packed (score, c) on every thread, 0 when no candidate can win.
template <int G, int NT>
__device__ __forceinline__ uint64_t race(const float (&values)[G][4], const uint4 (&r)[G],
                                         bool greedy, float scale, uint64_t* scratch) {
  uint64_t best = 0;
#pragma unroll
  for (int k = 0; k < G; ++k) {
    const uint32_t bits[4] = {r[k].x, r[k].y, r[k].z, r[k].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float v = values[k][j];
      if (!(v > -INFINITY)) continue;
      if (!greedy) v = fmaf(v, scale, gumbel(uniform(bits[j])));
      const uint64_t key = pack(v, static_cast<uint32_t>(4 * (threadIdx.x + k * NT) + j));
      best = key > best ? key : best;
    }
  }
  return block_reduce(best, scratch, uint64_t{0}, MaxOp{});  // every thread gets it
}

__device__ __forceinline__ uint32_t unpack_index(uint64_t k) {
  return 0xffffffffu - static_cast<uint32_t>(k);
}

// Up to 4 * NT chunks a row (a vocabulary of 4,194,304 tokens with NT = 256).
template <typename T, int NT>
__global__ void __launch_bounds__(NT) sample_pick_kernel(const SampleParams p) {
  constexpr int kGroups = kSampleChunk / 4 / NT;  // the token race's groups per thread
  const int row = blockIdx.x;
  pdl_launch_dependents();  // launched with PDL: the chunks' values come from the kernel before
  pdl_wait();
  const T* x = static_cast<const T*>(p.logits) + row * p.row_stride;
  const float inv_t = p.inv_temperature[row];
  const bool greedy = inv_t == 0.0f;
  const uint64_t key = static_cast<uint64_t>(p.seeds[2 * row]);
  const uint64_t ctr = static_cast<uint64_t>(p.seeds[2 * row + 1]);
  const uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  __shared__ uint64_t scratch[NT / 32];

  const float* values = p.partials + static_cast<int64_t>(row) * p.num_chunks;
  float chunk_values[1][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int c = 4 * threadIdx.x + j;
    chunk_values[0][j] = c < p.num_chunks ? values[c] : -INFINITY;
  }
  // Both races' noise while those loads are on their way. The token race's
  // noise is keyed by the position within the chunk: only one chunk races.
  uint4 chunk_noise[1], token_noise[kGroups];
  race_noise<1, NT>(chunk_noise, kChunkTag, greedy, ctr, k0, k1);
  race_noise<kGroups, NT>(token_noise, kTokenTag, greedy, ctr, k0, k1);

  // The chunk: its values are already divided by T.
  const uint64_t chunk_best = race<1, NT>(chunk_values, chunk_noise, greedy, 1.0f, scratch);
  if (chunk_best == 0) {  // every logit -inf: token 0, as argmax would
    if (threadIdx.x == 0) p.out[row] = 0;
    return;
  }
  // The token within it.
  const int begin = static_cast<int>(unpack_index(chunk_best)) * kSampleChunk;
  const int n = min(kSampleChunk, p.vocab - begin);
  float logits[kGroups][4];
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = 4 * (threadIdx.x + k * NT) + j;
      logits[k][j] = c < n ? load_float(x + begin + c) : -INFINITY;
    }
  }
  const uint64_t best = race<kGroups, NT>(logits, token_noise, greedy, inv_t, scratch);
  // A chunk that won holds a token that is not -inf, so best != 0.
  if (threadIdx.x == 0) p.out[row] = begin + unpack_index(best);
}
// --8<-- [end:sample]

template <typename T>
void launch_sample(const SampleParams& p, cudaStream_t stream) {
  constexpr int NT = kSampleThreads;
  static_assert(kSampleChunk % NT == 0 && kSampleChunk % 4 == 0);
  // Rows on x (up to 2^31 - 1 of them), chunks on y (38 at Qwen3's vocabulary).
  launch_kernel(sample_chunk_kernel<T, NT>, dim3(p.num_rows, p.num_chunks), dim3(NT), 0,
                stream, "sample_tokens (chunks)", p);
  launch_kernel(sample_pick_kernel<T, NT>, dim3(p.num_rows), dim3(NT), 0, stream,
                "sample_tokens (pick)", p);
}

}  // namespace

void sample_tokens(const SampleParams& p, cudaStream_t stream) {
  if (p.num_rows == 0) return;
  if (p.vocab < 1) throw std::invalid_argument("sample_tokens: empty rows");
  if (p.num_chunks != (p.vocab + kSampleChunk - 1) / kSampleChunk) {
    throw std::invalid_argument("sample_tokens: num_chunks must be ceil(vocab / " +
                                std::to_string(kSampleChunk) + ")");
  }
  if (p.num_chunks > 4 * kSampleThreads) {
    throw std::invalid_argument("sample_tokens: a vocabulary of at most " +
                                std::to_string(4 * kSampleThreads * kSampleChunk) +
                                " tokens");
  }
  switch (p.dtype) {
    case DType::kBFloat16: return launch_sample<__nv_bfloat16>(p, stream);
    case DType::kFloat16: return launch_sample<__half>(p, stream);
    case DType::kFloat32: return launch_sample<float>(p, stream);
  }
  throw std::invalid_argument("sample_tokens: unknown dtype");
}

}  // namespace mini_vllm
